"""The pytest plugin: options, markers, and the dispatch of distributed tests to rank pools.

Enable it with ``pytest_plugins = ["harness.plugin"]`` in a conftest file or
``-p harness.plugin`` on the command line.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any

import pytest

from harness import hookspec
from harness._controller.devices import DevicePlan
from harness._controller.dispatch import PoolManager, TestRequest, run
from harness._controller.report import PoolLeakWarning
from harness._protocol import RunTest, Status, SubtestCounts
from harness._types import Placement, PoolKey, PoolSettings
from harness.rank_calls import CallSettings, RankCalls
from harness.subtests import parse_filter
from harness.testcase import DistributedTest, declared_world_size

_PG_TIMEOUT_S = 1800.0
_SEED = 0

plan_key = pytest.StashKey[DevicePlan]()
manager_key = pytest.StashKey[PoolManager]()
placement_key = pytest.StashKey[Placement]()
distributed_seen_key = pytest.StashKey[bool]()
_deferred_timer_key = pytest.StashKey[object]()
_STARTING = object()  # the deferred timer is being handed to pytest-timeout


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspec)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "harness_isolated_modules",
        "packages whose module and class attributes are restored in the ranks after "
        "every distributed test (the test's own module always is)",
        type="linelist",
        default=[],
    )
    parser.addini(
        "map_cuda_to_cpu",
        "as --map-cuda-to-cpu, for every distributed test of the session",
        type="bool",
        default=False,
    )
    group = parser.getgroup("distributed", "distributed tests (harness)")
    group.addoption(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where ranks run: cuda+nccl when enough GPUs are visible (auto), "
        "always cpu+gloo (cpu), or cuda only, skipping tests that lack GPUs (cuda). "
        "Default: auto.",
    )
    group.addoption(
        "--world-size",
        type=int,
        default=2,
        help="ranks for test classes that do not pin world_size. Default: 2.",
    )
    group.addoption(
        "--subtest",
        default=None,
        metavar="KEY=VALUE,...",
        help="run only the subtest combinations matching every pair, e.g. "
        '--subtest "sharding_strategy=SHARD_GRAD_OP,use_orig_params=True". '
        "Values are matched as they appear in reports.",
    )
    group.addoption(
        "--dist-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="per-test deadline on the ranks' time (starting a pool is not counted); "
        "on expiry every rank's Python stack is reported and the ranks are stopped. "
        "A dist_timeout marker replaces it; pytest-timeout's marker, option or ini "
        "value also bounds the whole call, pool start included. Default: 600.",
    )
    group.addoption(
        "--fail-grace",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="after one rank fails, how long the other ranks have to report their own "
        "outcome before they are stopped (with their stacks). Default: 2.",
    )
    group.addoption(
        "--check-collectives",
        action="store_true",
        default=False,
        help="run distributed tests in pools started with TORCH_DISTRIBUTED_DEBUG=DETAIL: "
        "torch compares each collective (op, shapes, dtypes) across ranks before running "
        "it, so a mismatch fails at once, naming every rank's call, instead of hanging "
        "until the deadline. Slower per collective; the check_collectives marker does "
        "this for one test.",
    )
    group.addoption(
        "--map-cuda-to-cpu",
        action="store_true",
        default=False,
        help="on CPU ranks, resolve the CUDA devices tests name (tensor.cuda(), "
        "module.cuda(), device='cuda', .to('cuda')) to the rank's device, for tests "
        "written for GPUs. The map_cuda_to_cpu marker or ini value enables it too.",
    )
    group.addoption(
        "--fresh-pool",
        action="store_true",
        default=False,
        help="give every distributed test a fresh pool of ranks instead of reusing one.",
    )


def pytest_configure(config: pytest.Config) -> None:
    for line in (
        "fresh_pool: run this distributed test in a fresh pool of ranks of its own",
        "check_collectives: check every collective across ranks (see --check-collectives)",
        "dist_timeout(seconds): per-test deadline for a distributed test",
        "requires_gpu(reason): skip unless the ranks run on CUDA",
        "requires_module(name, reason=None): skip unless `name` imports in this environment",
        "map_cuda_to_cpu: on CPU ranks, CUDA devices the test names resolve to the rank's device",
        "min_world_size(n): the test needs n ranks: unless its class pins world_size, it runs "
        "with max(--world-size, n)",
    ):
        config.addinivalue_line("markers", line)
    config.stash[plan_key] = DevicePlan.detect(config.getoption("device"))
    settings = PoolSettings(
        capture_output=config.getoption("capture") != "no",
        pg_timeout_s=_PG_TIMEOUT_S,
        isolated_modules=isolated_modules(config),
    )
    config.stash[manager_key] = PoolManager(settings)
    config.pluginmanager.register(SubtestReporter(config), "harness-subtests")
    parse_filter(config.getoption("subtest"))  # fail early on a malformed filter


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    controller = bool(getattr(config.option, "numprocesses", 0)) and not hasattr(
        config, "workerinput"
    )
    manager = config.stash.get(manager_key, None)
    if manager is None or controller or not config.stash.get(distributed_seen_key, False):
        return
    terminalreporter.write_line(
        f"rank pools: {manager.pools_started} started, "
        f"{manager.tests_run} distributed tests ran on them"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    config.stash[distributed_seen_key] = any(is_distributed(item) for item in items)


def pytest_unconfigure(config: pytest.Config) -> None:
    manager = config.stash.get(manager_key, None)
    if manager is not None:
        manager.shutdown()


@pytest.fixture(scope="session")
def rank_calls(pytestconfig: pytest.Config) -> RankCalls:
    """Runs methods of ``DistributedTest`` subclasses on pooled ranks from a test
    that stays in the pytest process (see [Note: Tests that drive the ranks])."""
    config = pytestconfig
    settings = CallSettings(
        manager=config.stash[manager_key],
        timeout_s=float(config.getoption("dist_timeout")),
        grace_s=float(config.getoption("fail_grace")),
        rewrite_asserts=config.getoption("assertmode") == "rewrite",
        seed=_SEED,
    )

    def seen() -> None:
        config.stash[distributed_seen_key] = True

    return RankCalls(settings, config.stash[plan_key].placement, seen)


def is_distributed(item: pytest.Item) -> bool:
    cls = getattr(item, "cls", None)
    return (
        isinstance(item, pytest.Function) and cls is not None and issubclass(cls, DistributedTest)
    )


def world_size_of(item: pytest.Item) -> int:
    """The class's pinned world size, else ``--world-size`` raised to the
    ``min_world_size`` marker's count."""
    pinned = declared_world_size(item.cls)  # type: ignore[attr-defined]
    if pinned is not None:
        return pinned
    size = int(item.config.getoption("world_size"))
    marker = item.get_closest_marker("min_world_size")
    return size if marker is None else max(size, int(marker.args[0]))


def pytest_runtest_setup(item: pytest.Item) -> None:
    if not is_distributed(item):
        return
    plan = item.config.stash[plan_key]
    placement = plan.placement(world_size_of(item))
    if isinstance(placement, str):
        pytest.skip(placement)
    reason = _marker_skip_reason(item, placement) or item.config.hook.pytest_harness_skip_reason(
        item=item, placement=placement
    )
    if reason:
        pytest.skip(reason)
    item.stash[placement_key] = placement


def isolated_modules(config: pytest.Config) -> tuple[str, ...]:
    """The packages whose module and class attributes every test gets back as it
    found them (see harness._rank.isolation): the ``harness_isolated_modules``
    ini value, what plugins add through ``pytest_harness_isolated_modules``, and
    the harness's own patchable module."""
    names = ["harness.collectives", *config.getini("harness_isolated_modules")]
    for contributed in config.hook.pytest_harness_isolated_modules(config=config):
        names.extend(contributed)
    return tuple(dict.fromkeys(names))


def _marker_skip_reason(item: pytest.Item, placement: Placement) -> str | None:
    gpu = item.get_closest_marker("requires_gpu")
    if gpu is not None and placement.device_type != "cuda":
        why = gpu.args[0] if gpu.args else gpu.kwargs.get("reason", "needs CUDA")
        return f"{why} (ranks run on {placement.device_type})"
    for marker in item.iter_markers("requires_module"):
        name = marker.args[0]
        error = _import_error(name)
        if error is not None:
            why = marker.kwargs.get("reason") or f"needs {name}"
            return f"{why}: {error}"
    return None


_IMPORT_ERRORS: dict[str, str | None] = {}


def _import_error(name: str) -> str | None:
    if name not in _IMPORT_ERRORS:
        try:
            importlib.import_module(name)
            _IMPORT_ERRORS[name] = None
        except Exception as exc:
            _IMPORT_ERRORS[name] = f"import {name} failed: {type(exc).__name__}: {exc}"
    return _IMPORT_ERRORS[name]


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if not is_distributed(pyfuncitem):
        return None
    request = _request(pyfuncitem)
    verdict = run(
        pyfuncitem.config.stash[manager_key], request, lambda: _start_deferred_timer(pyfuncitem)
    )
    for rank, output in sorted(verdict.outputs.items()):
        pyfuncitem.add_report_section("call", f"rank {rank} output", output)
    for text in verdict.warnings:
        warnings.warn(PoolLeakWarning(text), stacklevel=1)
    if verdict.counts is not None:
        pyfuncitem.user_properties.append(("subtests", verdict.counts.as_dict()))
    if verdict.status is Status.FAILED:
        pytest.fail(verdict.text, pytrace=False)
    if verdict.status is Status.SKIPPED:
        raise pytest.skip.Exception(verdict.text, _use_item_location=True)
    return True


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """pytest-timeout's timer of a distributed test starts once its pool is ready
    (see [Note: What a test's deadline counts]); other tests are left to it."""
    if not is_distributed(item) or item.stash.get(_deferred_timer_key, None) is _STARTING:
        return None
    item.stash[_deferred_timer_key] = settings
    return True


def _start_deferred_timer(item: pytest.Item) -> None:
    settings = item.stash.get(_deferred_timer_key, None)
    if settings is None or settings is _STARTING:
        return
    item.stash[_deferred_timer_key] = _STARTING
    item.config.hook.pytest_timeout_set_timer(item=item, settings=settings)


def _request(item: pytest.Function) -> TestRequest:
    config = item.config
    placement = item.stash[placement_key]
    world_size = world_size_of(item)
    argnames = item._fixtureinfo.argnames  # the test function's own arguments
    message = RunTest(
        nodeid=item.nodeid,
        module_name=item.module.__name__,  # type: ignore[union-attr]
        module_file=str(item.path),
        class_qualname=item.cls.__qualname__,  # type: ignore[union-attr]
        method_name=item.originalname,
        kwargs={name: item.funcargs[name] for name in argnames},
        seed=_SEED,
        sys_path=tuple(sys.path),
        rewrite_asserts=config.getoption("assertmode") == "rewrite",
        subtest_filter=parse_filter(config.getoption("subtest")),
        resume_after=-1,
        map_cuda_to_cpu=maps_cuda_to_cpu(item),
    )
    return TestRequest(
        key=PoolKey(world_size, placement.device_type, _checks_collectives(item)),
        placement=placement,
        message=message,
        fresh_pool=config.getoption("fresh_pool")
        or item.get_closest_marker("fresh_pool") is not None,
        timeout_s=_timeout_s(item),
        grace_s=float(config.getoption("fail_grace")),
        wall_limit_s=_wall_limit_s(item),
    )


def _checks_collectives(item: pytest.Item) -> bool:
    """[Note: Checking collectives]
    With ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` torch wraps every process group in a
    checker that, before each collective, compares its op, shapes and dtypes
    across ranks over a side group and raises on every rank at the first
    mismatch. The variable must be set before the process group exists, so such
    tests run in pools of their own (the pool key says so)."""
    return bool(item.config.getoption("check_collectives")) or (
        item.get_closest_marker("check_collectives") is not None
    )


def maps_cuda_to_cpu(item: pytest.Item) -> bool:
    """Whether the ranks resolve CUDA devices to a CPU rank's device (see
    ``harness._rank.cuda_mapping``): the option, the ini value or the marker."""
    config = item.config
    return (
        bool(config.getoption("map_cuda_to_cpu"))
        or bool(config.getini("map_cuda_to_cpu"))
        or item.get_closest_marker("map_cuda_to_cpu") is not None
    )


def _timeout_s(item: pytest.Item) -> float:
    """Our deadline for the ranks' time on the test: the option, or the marker."""
    marker = item.get_closest_marker("dist_timeout")
    if marker is not None:
        return float(marker.args[0] if marker.args else marker.kwargs["seconds"])
    return float(item.config.getoption("dist_timeout"))


def _wall_limit_s(item: pytest.Item) -> float | None:
    """Kept below pytest-timeout's own timer, so that the stacks of the ranks
    are reported before it fires."""
    outer = _pytest_timeout_s(item)
    if outer is None or outer <= 0:
        return None
    return outer - min(5.0, 0.1 * outer)


def _pytest_timeout_s(item: pytest.Item) -> float | None:
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value: Any = marker.args[0] if marker.args else marker.kwargs.get("timeout")
        return float(value) if value is not None else None
    if not item.config.pluginmanager.hasplugin("timeout"):
        return None
    option = item.config.getoption("timeout", None)
    if option:
        return float(option)
    try:
        ini = item.config.getini("timeout")
    except ValueError:
        return None
    return float(ini) if ini not in (None, "") else None


class SubtestReporter:
    """Collects subtest counts per test from reports (also those xdist workers send)
    and prints them in the terminal summary."""

    def __init__(self, config: pytest.Config) -> None:
        self._config = config
        self.per_test: dict[str, SubtestCounts] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call":
            return
        for name, value in report.user_properties:
            if name == "subtests" and isinstance(value, dict):
                self.per_test[report.nodeid] = SubtestCounts(**value)

    def totals(self) -> SubtestCounts:
        fields = ("ran", "failed", "skipped", "deselected")
        sums = {f: sum(getattr(c, f) for c in self.per_test.values()) for f in fields}
        return SubtestCounts(**sums)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.per_test:
            return
        tr = terminalreporter
        tr.section("subtests")
        if self._config.getoption("verbose") > 0:
            for nodeid, c in self.per_test.items():
                tr.write_line(
                    f"{nodeid}: {c.ran} ran, {c.failed} failed, {c.skipped} skipped, "
                    f"{c.deselected} deselected"
                )
        t = self.totals()
        tr.write_line(
            f"{len(self.per_test)} tests with subtests: {t.ran} subtests ran, {t.failed} failed, "
            f"{t.skipped} skipped, {t.deselected} deselected"
        )
