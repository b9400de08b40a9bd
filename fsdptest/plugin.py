"""The FSDP test layer's pytest plugin: which FSDP implementation is under test.

It sits on top of the generic runner (``harness.plugin``) and talks to it only
through the runner's hooks: it adds ``--fsdp-impl`` (a built-in name, a registered
entry point or a module path; see ``fsdptest.implementations``), resolves it once
(an unknown name is a usage error listing the known ones), exports it to the
ranks (``FSDP_HARNESS_IMPL``, read by ``fsdptest.api`` when first imported; the
ranks inherit the environment), asks the ranks to restore the FSDP packages and ``models``
after every test, and skips, before any rank starts, configurations torch's
FSDP cannot run on CPU-only machines (except in tests marked
``torch_cpu_offload_asserted``, which assert that failure themselves:
``fsdptest.api.assert_torch_refuses_cpu_offload``). For the property search
(``fsdptest.properties``) it gives the ``property_search`` and
``replayed_example`` fixtures and the property tests their budget, without
loading a hypothesis profile (see [Note: Budgets only for the property tests]
in fsdptest.properties.search); hypothesis is imported only where a property
test is collected or a profile of ours is asked for. For the differential
conformance search (``fsdptest.conformance``) it adds ``--fsdp-reference`` and
gives the ``conformance_search`` and ``replayed_scenario`` fixtures (imported
where they are used, as the property search). Tests that need FSDP2 are skipped
before any rank starts where the implementation lacks it, and a session whose
only outcome is such skips fails ([Note: A session of FSDP2 skips is not green]
in ``fsdptest._fsdp2_gate``).

The runner's hooks it implements are optional: with ``-p no:harness.plugin`` the
runner and its hook specifications are gone, and this plugin still loads.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from fsdptest._constants import (
    CPU_OFFLOAD_ASSERTED_HELP,
    CPU_OFFLOAD_ASSERTED_MARKER,
    IMPL_ENV,
    TORCH_CPU_OFFLOAD_SKIP,
)
from fsdptest._fsdp2_gate import FSDP2_MARKER_HELP, Fsdp2Gate
from fsdptest.implementations import (
    ENTRY_POINT_GROUP,
    Implementation,
    UnknownImplementation,
    resolve,
)
from fsdptest.properties.examples import Example
from harness._types import Placement

if TYPE_CHECKING:
    from fsdptest.conformance.scenario import Scenario
    from fsdptest.conformance.search import ConformanceSearch, Tally
    from fsdptest.fsdp2search.program import Program
    from fsdptest.fsdp2search.search import Fsdp2Search
    from fsdptest.properties.search import PropertySearch
    from harness.rank_calls import RankCalls

impl_key = pytest.StashKey[Implementation]()
replay_key: pytest.StashKey[Example | Scenario] = pytest.StashKey()
reference_key = pytest.StashKey[Implementation]()
tally_key: pytest.StashKey[Tally] = pytest.StashKey()
_OUR_PROFILES = ("ci", "deep")


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
        "profile's (ci: 12, deep: 700).",
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
    """Resolves the implementation and checks the options' values; it runs before
    hypothesis's own ``pytest_configure``, so that ``--hypothesis-profile ci`` or
    ``deep`` finds the profile registered (and nothing is loaded otherwise)."""
    name = config.getoption("fsdp_impl")
    for option, key in (("--fsdp-impl", impl_key), ("--fsdp-reference", reference_key)):
        try:
            config.stash[key] = resolve(config.getoption(option))
        except UnknownImplementation as error:
            raise pytest.UsageError(str(error).replace("--fsdp-impl", option, 1)) from None
    os.environ[IMPL_ENV] = name
    config.addinivalue_line("markers", CPU_OFFLOAD_ASSERTED_HELP)
    config.addinivalue_line("markers", FSDP2_MARKER_HELP)
    config.pluginmanager.register(Fsdp2Gate(is_worker=hasattr(config, "workerinput")))
    examples = config.getoption("property_examples")
    if examples is not None and examples < 1:
        raise pytest.UsageError(f"--property-examples needs at least 1 example, got {examples}")
    scenarios = config.getoption("conformance_scenarios")
    if scenarios is not None and scenarios < 1:
        raise pytest.UsageError(
            f"--conformance-scenarios needs at least 1 scenario, got {scenarios}"
        )
    replay_id = config.getoption("replay_example")
    if replay_id is not None:
        config.stash[replay_key] = _replayed(replay_id)
    if config.getoption("hypothesis_profile", None) in _OUR_PROFILES:
        from fsdptest.properties.search import register_profiles

        register_profiles(examples)


def _replayed(replay_id: str) -> Example | Scenario | Program:
    """The property example, conformance scenario or FSDP2 program of ``replay_id``."""
    from fsdptest.conformance.scenario import Scenario
    from fsdptest.fsdp2search.program import Program

    errors = []
    for kind in (Program, Example, Scenario):
        try:
            return kind.from_replay_id(replay_id)
        except Exception as error:  # base64, zlib, json or the value's own fields
            errors.append(f"{type(error).__name__}: {error}")
    raise pytest.UsageError(
        f"--replay-example {replay_id!r} is not a replay id that a property or conformance "
        f"failure printed ({'; '.join(errors)})"
    )


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
    from fsdptest.properties.search import PropertySearch

    replay_test = f"{request.node.nodeid}::test_replay_example"
    return PropertySearch(rank_calls, request.config.getoption("fsdp_impl"), replay_test)


@pytest.fixture(scope="module")
def conformance_search(request: pytest.FixtureRequest, rank_calls: RankCalls) -> ConformanceSearch:
    """Runs conformance scenarios on pooled ranks (see fsdptest.conformance.search);
    failures name ``test_replay_scenario`` of the requesting module for replay."""
    from fsdptest.conformance.search import BUDGETS, ConformanceSearch, Tally
    from fsdptest.properties.search import chosen_profile

    config = request.config
    profile = chosen_profile(config.getoption("hypothesis_profile", None))
    budget = BUDGETS.get(profile, BUDGETS["ci"])._replace(profile=profile)
    stats = config.getoption("conformance_stats")
    if tally_key not in config.stash:
        config.stash[tally_key] = Tally()
    return ConformanceSearch(
        rank_calls,
        config.getoption("fsdp_impl"),
        config.getoption("fsdp_reference"),
        f"{request.node.nodeid}::test_replay_scenario",
        budget._replace(scenarios=config.getoption("conformance_scenarios") or budget.scenarios),
        config.stash[tally_key],
        Path(stats) if stats else None,
        survey=config.getoption("conformance_survey"),
    )


@pytest.fixture(scope="module")
def fsdp2_search(request: pytest.FixtureRequest, rank_calls: RankCalls) -> Fsdp2Search:
    """Runs drawn FSDP2 programs on pooled ranks (see fsdptest.fsdp2search.search);
    failures name ``test_replay_program`` of the requesting module for replay."""
    from fsdptest.fsdp2search.search import BUDGETS, Fsdp2Search
    from fsdptest.properties.search import chosen_profile

    config = request.config
    profile = chosen_profile(config.getoption("hypothesis_profile", None))
    budget = BUDGETS.get(profile, BUDGETS["ci"])._replace(profile=profile)
    count = config.getoption("conformance_scenarios")
    return Fsdp2Search(
        rank_calls,
        config.getoption("fsdp_impl"),
        config.getoption("fsdp_reference"),
        f"{request.node.nodeid}::test_replay_program",
        budget._replace(programs=count or budget.programs),
        survey=config.getoption("conformance_survey"),
        stats_file=Path(stats) if (stats := config.getoption("conformance_stats")) else None,
    )


def _replay_of(request: pytest.FixtureRequest, kind: type, what: str) -> Any:
    value = request.config.stash.get(replay_key, None)
    if not isinstance(value, kind):
        pytest.skip(f"no {what} to replay: pass --replay-example ID (a failure prints it)")
    return value


@pytest.fixture
def replayed_example(request: pytest.FixtureRequest) -> Example:
    """The example of ``--replay-example``; skips without one."""
    return _replay_of(request, Example, "property example")


@pytest.fixture
def replayed_scenario(request: pytest.FixtureRequest) -> Scenario:
    """The conformance scenario of ``--replay-example``; skips without one."""
    from fsdptest.conformance.scenario import Scenario

    return _replay_of(request, Scenario, "conformance scenario")


@pytest.fixture
def replayed_program(request: pytest.FixtureRequest) -> Program:
    """The FSDP2 program of ``--replay-example``; skips without one."""
    from fsdptest.fsdp2search.program import Program

    return _replay_of(request, Program, "FSDP2 program")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The property tests (those that use ``property_search``) get their budget."""
    tests = [item for item in items if "property_search" in getattr(item, "fixturenames", ())]
    if not tests:
        return
    from fsdptest.properties.search import apply_budget, budget_of, chosen_profile

    profile = chosen_profile(config.getoption("hypothesis_profile", None))
    try:
        budget = budget_of(profile, config.getoption("property_examples"))
    except Exception as error:  # hypothesis's InvalidArgument: no such profile
        raise pytest.UsageError(
            f"the property tests' hypothesis profile {profile!r} (--hypothesis-profile or "
            f"HYPOTHESIS_PROFILE) is neither ci, deep nor registered: {error}"
        ) from None
    for item in tests:
        apply_budget(getattr(item, "obj", None), budget)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    """A property (conformance) test that sent no example (scenario) to the
    ranks checked nothing: it fails."""
    funcargs = getattr(item, "funcargs", {})
    search = funcargs.get("property_search")
    before = getattr(search, "checked", None)
    conformance = funcargs.get("conformance_search")
    scenarios = None if conformance is None else conformance.tally.scenarios
    fsdp2 = funcargs.get("fsdp2_search")
    programs = None if fsdp2 is None else fsdp2.checked
    result = yield
    if before is not None and search.checked == before:
        pytest.fail(
            "no example was checked: hypothesis ran the test, but no drawn example was "
            "sent to the ranks (does the body set every example aside?)",
            pytrace=False,
        )
    if scenarios is not None and conformance.tally.scenarios == scenarios:
        pytest.fail(
            "no scenario was checked: the conformance test ran, but no scenario was sent "
            "to the ranks",
            pytrace=False,
        )
    if programs is not None and fsdp2.checked == programs:
        pytest.fail(
            "no FSDP2 program was checked: the search ran, but sent no program to the ranks",
            pytrace=False,
        )
    return result


@pytest.hookimpl(optionalhook=True)
def pytest_harness_isolated_modules(config: pytest.Config) -> list[str]:
    """This layer, the FSDP under test and the test models (the models the
    package installs: a test that patches one must not change the next test's)."""
    impl = config.stash[impl_key]
    return ["fsdp", "fsdptest", "models", *([] if impl.is_builtin else [impl.module])]


@pytest.hookimpl(trylast=True, optionalhook=True)
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
