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
first and costs a foreign test nothing.
"""

from __future__ import annotations

import importlib
import math
import sys
import warnings
from typing import TYPE_CHECKING, Any

import pytest

from harness import hookspec
from harness._controller import options
from harness._controller.devices import DevicePlan, visible_gpus
from harness._controller.pytest_reports import (
    SessionReporter,
    placement_properties,
    report_subtests,
)
from harness._controller.report import PoolLeakWarning
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
placement_key = pytest.StashKey[Placement]()
distributed_seen_key = pytest.StashKey[bool]()
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
    ):
        config.addinivalue_line("markers", line)
    config.stash[filter_key] = options.check(config)
    if config.getoption("dist_device") == "cuda":
        _check_gpus_visible(config)
    config.stash[settings_key] = PoolSettings(
        capture_output=config.getoption("capture") != "no",
        pg_timeout_s=_PG_TIMEOUT_S,
        isolated_modules=isolated_modules(config),
    )
    reporter = SessionReporter(config, lambda: _pool_line(config))
    config.pluginmanager.register(reporter, "harness-reporter")


def _check_gpus_visible(config: pytest.Config) -> None:
    visible = visible_gpus()
    if not visible or _device_count() == 0:
        options.refuse_cuda_without_gpus(config, visible)


def _device_count() -> int:
    import torch

    return int(torch.cuda.device_count())


def device_plan(config: pytest.Config) -> DevicePlan:
    """Which GPUs this process owns, worked out (and torch imported) on first use."""
    plan = config.stash.get(plan_key, None)
    if plan is None:
        plan = config.stash[plan_key] = DevicePlan.detect(config.getoption("dist_device"))
    return plan


def pool_manager(config: pytest.Config) -> PoolManager:
    manager = config.stash.get(manager_key, None)
    if manager is None:
        from harness._controller.dispatch import PoolManager

        manager = config.stash[manager_key] = PoolManager(config.stash[settings_key])
    return manager


def _pool_line(config: pytest.Config) -> str | None:
    controller = bool(getattr(config.option, "numprocesses", 0)) and not hasattr(
        config, "workerinput"
    )
    if controller or not config.stash.get(distributed_seen_key, False):
        return None
    manager = config.stash.get(manager_key, None)
    started, ran = (manager.pools_started, manager.tests_run) if manager else (0, 0)
    return f"rank pools: {started} started, {ran} distributed tests ran on them"


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
    from harness.rank_calls import CallSettings, RankCalls

    config = pytestconfig
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
    """The ranks ``item`` runs on: its class's ``world_size``, else the option.
    A class's value below 1 fails the test (an error at setup) naming the class."""
    from harness.testcase import declared_world_size

    cls = item.cls  # type: ignore[attr-defined]
    pinned = declared_world_size(cls)
    if pinned is None:
        return int(item.config.getoption("dist_world_size"))
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
    placement = device_plan(item.config).placement(world_size_of(item))
    if isinstance(placement, str):
        spelled = options.spelling(item.config, options.ALIASES[0])
        pytest.fail(f"{placement} ({spelled} cuda)", pytrace=False)
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
    from harness._controller.dispatch import run

    request = _request(pyfuncitem)
    pyfuncitem.user_properties.extend(
        placement_properties(request.key.world_size, request.placement)
    )
    verdict = run(
        pool_manager(pyfuncitem.config), request, lambda: _start_deferred_timer(pyfuncitem)
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
        subtest_option=options.spelling(config, options.ALIASES[2]),
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
