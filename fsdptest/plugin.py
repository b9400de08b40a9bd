"""The FSDP test layer's pytest plugin: which FSDP implementation is under test.

It sits on top of the generic runner (``harness.plugin``) and talks to it only
through the runner's hooks: it adds ``--fsdp-impl`` (a built-in name, a registered
entry point or a module path; see ``fsdptest.implementations``), resolves it once
(an unknown name is a usage error listing the known ones), exports it to the
ranks (``FSDP_HARNESS_IMPL``, read by ``fsdptest.api`` when first imported; the
ranks inherit the environment), asks the ranks to restore the FSDP packages
after every test, and skips, before any rank starts, configurations torch's
FSDP cannot run on CPU-only machines (except in tests marked
``torch_cpu_offload_asserted``, which assert that failure themselves:
``fsdptest.api.assert_torch_refuses_cpu_offload``). For the property search
(``fsdptest.properties``) it registers and loads the hypothesis profiles and
gives the ``property_search`` and ``replayed_example`` fixtures; for the
differential conformance search (``fsdptest.conformance``) it adds
``--fsdp-reference`` and gives the ``conformance_search`` and
``replayed_scenario`` fixtures.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

from fsdptest._constants import (
    CPU_OFFLOAD_ASSERTED_HELP,
    CPU_OFFLOAD_ASSERTED_MARKER,
    IMPL_ENV,
    TORCH_CPU_OFFLOAD_SKIP,
)
from fsdptest.conformance.scenario import Scenario
from fsdptest.conformance.search import BUDGETS, Budget, ConformanceSearch, Tally
from fsdptest.implementations import (
    ENTRY_POINT_GROUP,
    Implementation,
    UnknownImplementation,
    resolve,
)
from fsdptest.properties.examples import Example
from fsdptest.properties.search import PropertySearch, chosen_profile, register_profiles
from harness._types import Placement
from harness.rank_calls import RankCalls

impl_key = pytest.StashKey[Implementation]()
reference_key = pytest.StashKey[Implementation]()
tally_key = pytest.StashKey[Tally]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fsdp", "FSDP implementation under test (fsdptest)")
    group.addoption(
        "--fsdp-impl",
        default="local",
        metavar="NAME",
        help="FSDP under test: this project's fsdp package (local), torch.distributed.fsdp "
        f"(torch), a name registered in the entry-point group {ENTRY_POINT_GROUP}, or the "
        "path of a module exposing the FSDP1 API (mypkg.fsdp). Default: local.",
    )
    group.addoption(
        "--fsdp-reference",
        default="torch",
        metavar="NAME",
        help="the FSDP the conformance search compares the one under test with (names as "
        "--fsdp-impl). Default: torch.",
    )
    group.addoption(
        "--conformance-scenarios",
        type=int,
        default=None,
        metavar="N",
        help="scenarios per world size of the conformance search, instead of the hypothesis "
        f"profile's (ci: {BUDGETS['ci'].scenarios}, deep: {BUDGETS['deep'].scenarios}).",
    )
    group.addoption(
        "--conformance-stats",
        default=None,
        metavar="PATH",
        help="append one JSON line per conformance scenario (how each run ended, what was "
        "compared, which allowed differences applied) to PATH.",
    )
    group.addoption(
        "--conformance-survey",
        action="store_true",
        help="run every scenario of the conformance search's budget without stopping at "
        "the first failure (no shrinking); failures go to --conformance-stats with their "
        "replay commands, and the test fails at the end if any scenario did.",
    )
    group.addoption(
        "--replay-example",
        default=None,
        metavar="ID",
        help="run test_replay_example of a property suite with the example of this "
        "replay id (a property failure prints the command), without hypothesis.",
    )
    group.addoption(
        "--property-examples",
        type=int,
        default=None,
        metavar="N",
        help="examples per property test, instead of the hypothesis profile's "
        "(ci: 40, deep: 2000); e.g. to bound a deep run's time.",
    )


@pytest.hookimpl(tryfirst=True)  # before the runner's, which asks for the isolated modules
def pytest_configure(config: pytest.Config) -> None:
    """Resolves the implementation, then loads the hypothesis profile; it runs
    before hypothesis's own ``pytest_configure``, which applies its
    ``--hypothesis-*`` options on top of the profile loaded here."""
    name = config.getoption("fsdp_impl")
    for option, key in (("--fsdp-impl", impl_key), ("--fsdp-reference", reference_key)):
        try:
            config.stash[key] = resolve(config.getoption(option))
        except UnknownImplementation as error:
            raise pytest.UsageError(str(error).replace("--fsdp-impl", option, 1)) from None
    config.stash[tally_key] = Tally()
    os.environ[IMPL_ENV] = name
    config.addinivalue_line("markers", CPU_OFFLOAD_ASSERTED_HELP)
    register_profiles(config.getoption("property_examples"))
    settings.load_profile(chosen_profile(config.getoption("hypothesis_profile", None)))


def pytest_report_header(config: pytest.Config) -> str:
    impl = config.stash[impl_key]
    return f"fsdp implementation: {impl.describe()} ({impl.origin})"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    tally = terminalreporter.config.stash.get(tally_key, None)
    if tally is not None and tally.scenarios:
        terminalreporter.write_line(tally.summary())


@pytest.fixture(scope="module")
def property_search(request: pytest.FixtureRequest, rank_calls: RankCalls) -> PropertySearch:
    """Runs property examples on pooled ranks (see fsdptest.properties.search);
    failures name ``test_replay_example`` of the requesting module for replay."""
    replay_test = f"{request.node.nodeid}::test_replay_example"
    return PropertySearch(rank_calls, request.config.getoption("fsdp_impl"), replay_test)


@pytest.fixture(scope="module")
def conformance_search(request: pytest.FixtureRequest, rank_calls: RankCalls) -> ConformanceSearch:
    """Runs conformance scenarios on pooled ranks (see fsdptest.conformance.search);
    failures name ``test_replay_scenario`` of the requesting module for replay."""
    config = request.config
    profile = chosen_profile(config.getoption("hypothesis_profile", None))
    budget = BUDGETS.get(profile, BUDGETS["ci"])
    count = config.getoption("conformance_scenarios")
    stats = config.getoption("conformance_stats")
    return ConformanceSearch(
        rank_calls,
        config.getoption("fsdp_impl"),
        config.getoption("fsdp_reference"),
        f"{request.node.nodeid}::test_replay_scenario",
        Budget(count or budget.scenarios, budget.steps),
        config.stash[tally_key],
        Path(stats) if stats else None,
        survey=config.getoption("conformance_survey"),
    )


@pytest.fixture
def replayed_scenario(request: pytest.FixtureRequest) -> Scenario:
    """The scenario of ``--replay-example``; skips without one."""
    replay_id = request.config.getoption("replay_example")
    if replay_id is None:
        pytest.skip(
            "no scenario to replay: pass --replay-example ID (a conformance failure prints it)"
        )
    return Scenario.from_replay_id(replay_id)


@pytest.fixture
def replayed_example(request: pytest.FixtureRequest) -> Example:
    """The example of ``--replay-example``; skips without one."""
    replay_id = request.config.getoption("replay_example")
    if replay_id is None:
        pytest.skip("no example to replay: pass --replay-example ID (a property failure prints it)")
    return Example.from_replay_id(replay_id)


def pytest_harness_isolated_modules(config: pytest.Config) -> list[str]:
    impl = config.stash[impl_key]
    return ["fsdp", "fsdptest", *([] if impl.is_builtin else [impl.module])]


@pytest.hookimpl(trylast=True)
def pytest_harness_skip_reason(item: pytest.Item, placement: Placement) -> str | None:
    """Torch's FSDP cannot offload parameters on a CPU-only run: such cases are
    skipped here, before any rank starts, when the parametrization says so."""
    if item.config.stash[impl_key].kind != "torch" or placement.device_type != "cpu":
        return None
    if item.get_closest_marker(CPU_OFFLOAD_ASSERTED_MARKER) is not None:
        return None
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec is not None else {}
    for name, value in params.items():
        if getattr(value, "offload_params", False) is True or (
            name == "offload_params" and value is True
        ):
            return TORCH_CPU_OFFLOAD_SKIP
    return None
