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
test is collected or a profile of ours is asked for.

The runner's hooks it implements are optional: with ``-p no:harness.plugin`` the
runner and its hook specifications are gone, and this plugin still loads.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import pytest

from fsdptest._constants import (
    CPU_OFFLOAD_ASSERTED_HELP,
    CPU_OFFLOAD_ASSERTED_MARKER,
    IMPL_ENV,
    TORCH_CPU_OFFLOAD_SKIP,
)
from fsdptest.implementations import (
    ENTRY_POINT_GROUP,
    Implementation,
    UnknownImplementation,
    resolve,
)
from fsdptest.properties.examples import Example
from harness._types import Placement

if TYPE_CHECKING:
    from fsdptest.properties.search import PropertySearch
    from harness.rank_calls import RankCalls

impl_key = pytest.StashKey[Implementation]()
replay_key = pytest.StashKey[Example]()
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
    try:
        config.stash[impl_key] = resolve(name)
    except UnknownImplementation as error:
        raise pytest.UsageError(str(error)) from None
    os.environ[IMPL_ENV] = name
    config.addinivalue_line("markers", CPU_OFFLOAD_ASSERTED_HELP)
    examples = config.getoption("property_examples")
    if examples is not None and examples < 1:
        raise pytest.UsageError(f"--property-examples needs at least 1 example, got {examples}")
    replay_id = config.getoption("replay_example")
    if replay_id is not None:
        config.stash[replay_key] = _replayed(replay_id)
    if config.getoption("hypothesis_profile", None) in _OUR_PROFILES:
        from fsdptest.properties.search import register_profiles

        register_profiles(examples)


def _replayed(replay_id: str) -> Example:
    try:
        return Example.from_replay_id(replay_id)
    except Exception as error:  # base64, zlib, json or the example's own fields
        raise pytest.UsageError(
            f"--replay-example {replay_id!r} is not a replay id that a property failure "
            f"printed ({type(error).__name__}: {error})"
        ) from None


def pytest_report_header(config: pytest.Config) -> str:
    impl = config.stash[impl_key]
    return f"fsdp implementation: {impl.describe()} ({impl.origin})"


@pytest.fixture(scope="module")
def property_search(request: pytest.FixtureRequest, rank_calls: RankCalls) -> PropertySearch:
    """Runs property examples on pooled ranks (see fsdptest.properties.search);
    failures name ``test_replay_example`` of the requesting module for replay."""
    from fsdptest.properties.search import PropertySearch

    replay_test = f"{request.node.nodeid}::test_replay_example"
    return PropertySearch(rank_calls, request.config.getoption("fsdp_impl"), replay_test)


@pytest.fixture
def replayed_example(request: pytest.FixtureRequest) -> Example:
    """The example of ``--replay-example``; skips without one."""
    example = request.config.stash.get(replay_key, None)
    if example is None:
        pytest.skip("no example to replay: pass --replay-example ID (a property failure prints it)")
    return example


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
    """A property test that sent no example to the ranks checked nothing: it fails."""
    search = getattr(item, "funcargs", {}).get("property_search")
    before = getattr(search, "checked", None)
    result = yield
    if before is not None and search.checked == before:
        pytest.fail(
            "no example was checked: hypothesis ran the test, but no drawn example was "
            "sent to the ranks (does the body set every example aside?)",
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
