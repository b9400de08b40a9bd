"""The pytest plugin: options, markers, and the dispatch of distributed tests to rank pools.

Enable it with ``pytest_plugins = ["harness.plugin"]`` in a conftest file or
``-p harness.plugin`` on the command line; an installed package loads it as a
``pytest11`` entry point.

[Note: A plugin in every session]
An entry point is loaded by every pytest session of the environment, most of
which are not ours. So the plugin adds options whose names cannot clash (see
``harness._controller.options``), and imports neither torch nor the pools when
it loads: a session learns what the GPUs are, and imports torch and the
controller side, only once it collects or runs a distributed test or asks for
``rank_calls``. A test class can only subclass ``DistributedTest`` after
``harness.testcase`` is imported, so ``is_distributed`` asks ``sys.modules``
first and costs a foreign test nothing. What configuring costs such a session
is the options' checks and the name of a lease directory (nothing is created
on disk until a test leases a GPU).

[Note: Two launchers]
Distributed tests run where the session's ``Dispatch`` says: on the harness's
own pools (``spawn``: placements from the device plan, GPUs leased per test), or
on the ranks torchrun started (``--dist-launcher torchrun``, see
``harness._torchrun``: one pytest session per rank, the test run in-process).
Both produce the same ``Verdict``, so everything after it is shared: the
placement properties and ``-v`` word, subtests as reports, the no-vacuous-pass
checks of ``harness._controller.report`` and the summary, to which each
dispatch adds what its process started (pools, or the torchrun rank).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import os
import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import pytest

from harness import hookspec
from harness._controller import options
from harness._controller.devices import DevicePlan, LeaseDirectory, visible_gpus
from harness._controller.durations import DurationLog
from harness._controller.leases import GpuLeases, recorded_slots
from harness._controller.pytest_reports import (
    SessionReporter,
    placement_properties,
    report_subtests,
)
from harness._controller.report import PoolLeakWarning, Verdict
from harness._controller.workers import WorkerBudget, memory_gib, usable_cores
from harness._protocol import RunTest, Status
from harness._types import Placement, PoolKey, PoolSettings

if TYPE_CHECKING:
    from harness._controller.dispatch import PoolManager, TestRequest
    from harness.rank_calls import RankCalls

_PG_TIMEOUT_S = 1800.0
_SEED = 0

plan_key = pytest.StashKey[DevicePlan]()
manager_key = pytest.StashKey["PoolManager"]()
settings_key = pytest.StashKey[PoolSettings]()
filter_key = pytest.StashKey[tuple[tuple[str, str], ...]]()
lease_dir_key = pytest.StashKey[LeaseDirectory]()
durations_key = pytest.StashKey[DurationLog]()
leases_key = pytest.StashKey["GpuLeases | None"]()


class Dispatch(NamedTuple):
    """Where distributed tests run (see [Note: Two launchers])."""

    placement: Callable[[int], Placement | str]  # a str: why none fits
    run: Callable[[TestRequest, Callable[[], None]], Verdict]
    started: Callable[[], list[str]]  # summary lines: what this process started
    launcher: str  # "spawn" | "torchrun"


dispatch_key = pytest.StashKey[Dispatch]()
placement_key = pytest.StashKey[Placement]()
distributed_seen_key = pytest.StashKey[bool]()
worker_budget_key = pytest.StashKey[WorkerBudget]()
_deferred_timer_key = pytest.StashKey[object]()
_STARTING = object()  # the deferred timer is being handed to pytest-timeout


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspec)


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
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
    parser.addini(
        "harness_durations",
        "a JSON file of test ids to seconds (relative to the ini file) for "
        "--dist-schedule longest; --dist-record-durations writes it",
        default="",
    )
    parser.addini(
        "harness_fake_gpus",
        "comma-separated ids of GPUs that do not exist: tests lease them as GPUs, "
        "their ranks compute on CPU (for testing the leasing without GPUs)",
        default="",
    )
    options.add_options(parser, pluginmanager)


@pytest.hookimpl(wrapper=True)
def pytest_load_initial_conftests(
    early_config: pytest.Config, parser: pytest.Parser, args: list[str]
) -> Any:
    """The short option spellings are added once the initial conftest files have
    added theirs (see [Note: Option names that cannot clash])."""
    try:
        return (yield)
    finally:
        options.add_free_aliases(parser, early_config.pluginmanager)


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
    config.stash[filter_key] = options.check(config)
    if config.getoption("dist_device") == "cuda" and not options.fake_gpus(config):
        _check_gpus_visible(config)
    profile_dir = options.directory(config, "rank_profile")
    settings = config.stash[settings_key] = PoolSettings(
        capture_output=config.getoption("capture") != "no",
        pg_timeout_s=_PG_TIMEOUT_S,
        isolated_modules=isolated_modules(config),
        profile_dir=str(profile_dir) if profile_dir is not None else None,
        reuse_groups=not config.getoption("fresh_groups"),
    )
    if config.getoption("dist_launcher") == "torchrun":
        config.stash[dispatch_key] = _torchrun_dispatch(config, settings)
    else:
        given = options.directory(config, "gpu_lease_dir")
        config.stash[lease_dir_key] = LeaseDirectory.for_session(config, given)
        config.stash[dispatch_key] = Dispatch(
            lambda world_size: device_plan(config).placement(world_size),
            functools.partial(_run_on_pools, config),
            functools.partial(_pool_lines, config),
            "spawn",
        )
    reporter = SessionReporter(
        config, lambda: [*_slot_lines(config), *config.stash[dispatch_key].started()]
    )
    config.pluginmanager.register(reporter, "harness-reporter")
    if not hasattr(config, "workerinput"):
        log = config.stash[durations_key] = DurationLog(
            config, options.durations_file(config), config.getoption("dist_record_durations")
        )
        config.pluginmanager.register(log, "harness-durations")


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """See [Note: Workers under -n auto] in harness._controller.workers."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS") or config.option.numprocesses == "logical":
        return None
    if config.getoption("dist_device") == "cpu":
        gpus = 0
    else:
        gpus = len(options.fake_gpus(config) or visible_gpus())
    budget = WorkerBudget(usable_cores(), memory_gib(), gpus, config.getoption("dist_world_size"))
    config.stash[worker_budget_key] = budget
    return budget.workers


def pytest_report_header(config: pytest.Config) -> list[str]:
    budget = config.stash.get(worker_budget_key, None)
    return [budget.describe()] if budget is not None else []


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """See [Note: Longest tests first] in harness._controller.schedule."""
    durations = config.stash.get(durations_key, None)
    if durations is None:
        return None
    from harness._controller.schedule import make_scheduler

    return make_scheduler(config, log, durations)


def _torchrun_dispatch(config: pytest.Config, settings: PoolSettings) -> Dispatch:
    from harness._torchrun.session import TorchrunSession

    session = TorchrunSession.start(config, settings, is_distributed)
    config.pluginmanager.register(session, "harness-torchrun")
    return Dispatch(session.placement, session.run, session.summary_lines, "torchrun")


def _check_gpus_visible(config: pytest.Config) -> None:
    visible = visible_gpus()
    if not visible or _device_count() == 0:
        options.refuse_cuda_without_gpus(config, visible)


def _device_count() -> int:
    import torch

    return int(torch.cuda.device_count())


def device_plan(config: pytest.Config) -> DevicePlan:
    """Which GPUs the session's tests lease, worked out (and torch imported) on
    first use (see [Note: GPUs under pytest-xdist] in harness._controller.devices)."""
    plan = config.stash.get(plan_key, None)
    if plan is None:
        requested = config.getoption("dist_device")
        plan = DevicePlan.detect(requested, options.fake_gpus(config))
        config.stash[plan_key] = plan
    return plan


def lease_directory(config: pytest.Config) -> LeaseDirectory:
    """Where the session's GPU leases are (the harness's own tests share it with
    their inner sessions)."""
    return config.stash[lease_dir_key]


def pool_manager(config: pytest.Config) -> PoolManager:
    """This process's pools, and the leases of the GPUs they run on, on first use."""
    manager = config.stash.get(manager_key, None)
    if manager is None:
        from harness._controller.dispatch import PoolManager

        plan, directory = device_plan(config), lease_directory(config)
        leases = None
        if plan.gpus:
            adopt = options.given_slots(config) is None
            leases = GpuLeases(directory.path, plan.gpus, options.gpu_slots(config), adopt)
        config.stash[leases_key] = leases
        settings = dataclasses.replace(
            config.stash[settings_key],
            release_cached_memory=leases is not None and directory.shared(config),
        )
        manager = config.stash[manager_key] = PoolManager(settings, leases)
    return manager


def _run_on_pools(
    config: pytest.Config, request: TestRequest, on_ready: Callable[[], None]
) -> Verdict:
    from harness._controller.dispatch import run

    return run(pool_manager(config), request, on_ready)


def _slot_lines(config: pytest.Config) -> list[str]:
    """How many tests a GPU could hold at once, where the session leased GPUs."""
    directory = config.stash.get(lease_dir_key, None)
    slots = recorded_slots(directory.path) if directory is not None else None
    if slots is None:
        return []
    how = "--gpu-slots auto" if options.given_slots(config) is None else "--gpu-slots"
    return [f"GPU slots: up to {slots} test(s) on a GPU at once ({how})"]


def _pool_lines(config: pytest.Config) -> list[str]:
    controller = bool(getattr(config.option, "numprocesses", 0)) and not hasattr(
        config, "workerinput"
    )
    if controller or not config.stash.get(distributed_seen_key, False):
        return []
    manager = config.stash.get(manager_key, None)
    started, ran = (manager.pools_started, manager.tests_run) if manager else (0, 0)
    return [f"rank pools: {started} started, {ran} distributed tests ran on them"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    config.stash[distributed_seen_key] = any(is_distributed(item) for item in items)


def pytest_unconfigure(config: pytest.Config) -> None:
    manager = config.stash.get(manager_key, None)
    if manager is not None:
        manager.shutdown()
    leases = config.stash.get(leases_key, None)
    if leases is not None:
        leases.close()
    directory = config.stash.get(lease_dir_key, None)
    if directory is not None:
        directory.remove()


@pytest.fixture(scope="session")
def rank_calls(pytestconfig: pytest.Config) -> RankCalls:
    """Runs methods of ``DistributedTest`` subclasses on pooled ranks from a test
    that stays in the pytest process (see [Note: Tests that drive the ranks])."""
    from harness.rank_calls import CallSettings, RankCalls

    config = pytestconfig
    if config.stash[dispatch_key].launcher == "torchrun":
        spelled = options.spelling(config, options.LAUNCHER)
        pytest.skip(f"rank_calls starts the harness's own pools: run it without {spelled} torchrun")
    settings = CallSettings(
        manager=pool_manager(config),
        timeout_s=float(config.getoption("dist_timeout")),
        grace_s=float(config.getoption("fail_grace")),
        rewrite_asserts=config.getoption("assertmode") == "rewrite",
        seed=_SEED,
    )

    def seen() -> None:
        config.stash[distributed_seen_key] = True

    return RankCalls(settings, device_plan(config).placement, seen)


def is_distributed(item: pytest.Item) -> bool:
    """Whether ``item`` is a test method of a ``DistributedTest`` subclass (see
    [Note: A plugin in every session])."""
    cls = getattr(item, "cls", None)
    testcase = sys.modules.get("harness.testcase")
    return (
        testcase is not None
        and cls is not None
        and isinstance(item, pytest.Function)
        and issubclass(cls, testcase.DistributedTest)
    )


def world_size_of(item: pytest.Item) -> int:
    """The ranks ``item`` runs on: its class's ``world_size``, else the option
    raised to the ``min_world_size`` marker's count. A class's value below 1
    fails the test (an error at setup) naming the class."""
    from harness.testcase import declared_world_size

    cls = item.cls  # type: ignore[attr-defined]
    size = int(item.config.getoption("dist_world_size"))
    marker = item.get_closest_marker("min_world_size")
    unpinned = size if marker is None else max(size, int(marker.args[0]))
    pinned = declared_world_size(cls, unpinned if maps_cuda_to_cpu(item) else None)
    if pinned is None:
        return unpinned
    if pinned < 1:
        pytest.fail(
            f"{cls.__qualname__}.world_size is {pinned}: a distributed test needs at least "
            "1 rank, and a pool of none would run nothing",
            pytrace=False,
        )
    return pinned


def pytest_runtest_setup(item: pytest.Item) -> None:
    if not is_distributed(item):
        return
    dispatch = item.config.stash[dispatch_key]
    placement = dispatch.placement(world_size_of(item))
    if isinstance(placement, str):
        if dispatch.launcher == "torchrun":
            pytest.skip(placement)  # another world size: counted in the summary
        spelled = options.spelling(item.config, options.DEVICE)
        pytest.fail(
            f"{placement} ({spelled} cuda; {spelled} auto would run it on CPU ranks)",
            pytrace=False,
        )
    _check_timeout_marker(item)
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
    dispatch = pyfuncitem.config.stash[dispatch_key]
    verdict = dispatch.run(request, lambda: _start_deferred_timer(pyfuncitem))
    pyfuncitem.user_properties.extend(
        placement_properties(request.key.world_size, request.placement, verdict.gpus)
    )
    for rank, output in sorted(verdict.outputs.items()):
        pyfuncitem.add_report_section("call", f"rank {rank} output", output)
    for text in verdict.warnings:
        warnings.warn(PoolLeakWarning(text), stacklevel=1)
    if verdict.counts is not None:
        report_subtests(pyfuncitem, verdict.subtests, verdict.counts.deselected)
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
    from harness._controller.dispatch import TestRequest

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
        subtest_filter=config.stash[filter_key],
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
        subtest_option=options.spelling(config, options.SUBTEST),
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


def _check_timeout_marker(item: pytest.Item) -> None:
    if item.get_closest_marker("dist_timeout") is None:
        return
    try:
        seconds = _timeout_s(item)
    except (KeyError, TypeError, ValueError):
        seconds = float("nan")
    if not (seconds > 0 and math.isfinite(seconds)):
        pytest.fail(
            f"dist_timeout marker: needs a finite number of seconds above 0, got {seconds:g}",
            pytrace=False,
        )


def _wall_limit_s(item: pytest.Item) -> float | None:
    """Kept below pytest-timeout's own timer, so that the stacks of the ranks
    are reported before it fires: the stacks are collected and the hung pool is
    stopped (terminated, joined) before the report returns, which takes more
    than half a second on a loaded machine, so the margin is a fifth of the
    limit (at most 5 s)."""
    outer = _pytest_timeout_s(item)
    if outer is None or outer <= 0:
        return None
    return outer - min(5.0, 0.2 * outer)


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
