"""Runs test methods inside a rank process (the rank side of the control channel)."""

from __future__ import annotations

import datetime
import functools
import inspect
import os
import sys
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from harness._protocol import (
    BodyReturned,
    Probe,
    ProbeResult,
    Ready,
    RunTest,
    Shutdown,
    Status,
    TestFinished,
    WorkerSpec,
)
from harness._rank import context as rank_context
from harness._rank import group_cache
from harness._rank.cuda_mapping import mapped
from harness._rank.importer import import_test_module, resolve_qualname
from harness._rank.isolation import GroupTracker, LeakCheck, StateBaseline, default_group_alive
from harness._rank.profiling import profiled


def pg_timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def serve(spec: WorkerSpec, conn: Connection) -> int:
    device = _init_process_group(spec)
    cache = group_cache.install() if spec.reuse_groups else None
    baseline = StateBaseline.capture(spec.isolated_modules)
    leaks = LeakCheck(device)
    conn.send(Ready(spec.rank, os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return 0  # the pytest process went away: nothing left to report to
        if isinstance(message, Shutdown):
            _shutdown_process_group()
            return 0
        if isinstance(message, Probe):
            conn.send(ProbeResult(spec.rank, _empty_cache_and_probe(cache, device)))
            continue
        assert isinstance(message, RunTest), message
        outcome = profiled(
            spec.profile_dir,
            f"{message.nodeid}.rank{spec.rank}",
            functools.partial(run_test, message, spec, device, conn, baseline, leaks),
        )
        conn.send(outcome)


_PROBE_WAIT = datetime.timedelta(seconds=5)


def _empty_cache_and_probe(cache: group_cache.GroupCache | None, device: torch.device) -> bool:
    """Every rank empties its group cache at the same point (see [Note: Process
    groups reused across tests]), then probes the default group."""
    if cache is not None:
        try:
            cache.clear()
        except Exception:
            return False
    return probe_default_group(device)


def probe_default_group(device: torch.device) -> bool:
    """Every rank all-reduces its rank + 1: in step, each gets the same known sum."""
    world_size = dist.get_world_size()
    value = torch.full((1,), float(dist.get_rank() + 1), device=device)
    try:
        dist.all_reduce(value, async_op=True).wait(timeout=_PROBE_WAIT)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception:
        return False
    return value.item() == world_size * (world_size + 1) / 2


def _init_process_group(spec: WorkerSpec) -> torch.device:
    # torch was imported (unpickling this process's target imports the harness)
    # before the worker applied spec.env: TORCH_DISTRIBUTED_DEBUG is read again.
    dist.set_debug_level_from_env()
    one_thread_per_rank()
    if spec.device_type == "cuda":
        torch.cuda.set_device(spec.rank)
        device = torch.device("cuda", spec.rank)
    else:
        device = torch.device("cpu")
    store = dist.TCPStore(
        "127.0.0.1",
        spec.store_port,
        spec.world_size + 1,
        is_master=False,
        timeout=pg_timeout(60),
    )
    dist.init_process_group(
        spec.backend,
        store=store,
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=pg_timeout(spec.pg_timeout_s),
        device_id=device if spec.device_type == "cuda" else None,
    )
    return device


def one_thread_per_rank() -> None:
    """[Note: CPU threads per rank]
    Every rank of every xdist worker computes on the same cores; torch's default
    of one intra-op thread per core would run ranks x workers x cores threads on
    them, and the ranks of a collective wait for the slowest. The small models of
    distributed tests gain nothing from intra-op threads, so a rank uses one,
    unless the user chose a number through ``OMP_NUM_THREADS``. CUDA ranks too:
    their CPU work (building models, offloaded optimizer steps, state-dict
    copies) started a pool of a thread per core on first use, which the leak
    check counted after the test and replaced the pool for (31 threads on the
    32-core GPU hosts, docs/runs/gpu-runs.md runs 72–75)."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def _shutdown_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def run_test(
    message: RunTest,
    spec: WorkerSpec,
    device: torch.device,
    conn: Connection,
    baseline: StateBaseline,
    leaks: LeakCheck,
) -> TestFinished:
    baseline.reseed(message.seed)  # the state was restored after the last test
    groups = GroupTracker()
    before = groups.live()
    context = rank_context.RankContext(
        rank=spec.rank,
        world_size=spec.world_size,
        device=device,
        backend=spec.backend,
        conn=conn,
        subtest_filter=message.subtest_filter,
        resume_after=message.resume_after,
        groups=groups,
    )
    rank_context.activate(context)
    try:
        status, text, exc_type = _call_test(message, device, baseline)
    finally:
        rank_context.activate(None)
    subtests_failed, deselected, space = (
        context.any_subtest_failed,
        context.deselected,
        context.space,
    )
    # On CUDA the body may return with a collective still queued (an NCCL
    # all_reduce does not block the host): the parent learns that the wait
    # below is for device work, not for the test's Python code.
    conn.send(BodyReturned(spec.rank, status))
    del context  # a test's objects must be unreachable before the leak check
    healthy = _settle(device, groups, before, baseline)
    leak = leaks.check(groups.destroyed) if healthy else ""
    if healthy and device.type == "cuda" and spec.release_cached_memory:
        # The pool idles on GPUs that another worker may lease next (see [Note:
        # GPUs under pytest-xdist] in harness._controller.devices): the test's
        # tensors are collected now, and the allocator gives its cache back.
        torch.cuda.empty_cache()
    cache = group_cache.active()
    return TestFinished(
        rank=spec.rank,
        status=status,
        text=text,
        exc_type=exc_type,
        subtests_failed=subtests_failed,
        deselected=deselected,
        healthy=healthy,
        leak=leak,
        subtest_space=space.offered() if space is not None else (),
        filter_hits=tuple(space.hits) if space is not None else (),
        groups_dirty=cache is not None and cache.dirty(),
    )


def _call_test(
    message: RunTest, device: torch.device, baseline: StateBaseline
) -> tuple[Status, str, str]:
    try:
        if tuple(sys.path) != message.sys_path:
            sys.path[:] = list(message.sys_path)
        module = import_test_module(
            message.module_name, message.module_file, message.rewrite_asserts
        )
        baseline.track_module(module.__name__)
        cls = resolve_qualname(module, message.class_qualname)
        instance = cls.__new__(cls)
        with mapped(message.map_cuda_to_cpu, device):  # see harness._rank.cuda_mapping
            _run_with_setup(instance, message.method_name, message.kwargs)
    except rank_context.SKIP_EXCEPTIONS as exc:
        return Status.SKIPPED, rank_context.skip_reason(exc), type(exc).__name__
    except BaseException as exc:
        return Status.FAILED, rank_context.format_exception(exc), type(exc).__name__
    return Status.PASSED, "", ""


def _run_with_setup(instance: object, method_name: str, kwargs: dict[str, object]) -> None:
    """``setUp``/``tearDown`` run in every rank around the body (pytest's
    ``setup_method`` stays a pytest hook and runs in the pytest process)."""
    method = getattr(instance, method_name)
    setup = getattr(instance, "setUp", None)
    if setup is not None:
        setup()
    try:
        _never_deferred(method_name, method(**kwargs))
    finally:
        teardown = getattr(instance, "tearDown", None)
        if teardown is not None:
            teardown()


def _never_deferred(method_name: str, result: object) -> None:
    """A body that only builds a coroutine or a generator never ran: that is an
    error, not a pass (the harness calls test methods, it runs no event loop)."""
    if inspect.iscoroutine(result) or inspect.isgenerator(result):
        result.close()
        kind = "a coroutine (async def)" if inspect.iscoroutine(result) else "a generator"
        raise TypeError(
            f"{method_name} returned {kind}, so its body never ran: test methods of a "
            "DistributedTest are called on the ranks and must run to the end when called"
        )


def _settle(
    device: torch.device, groups: GroupTracker, before: set[int], baseline: StateBaseline
) -> bool:
    """Brings the rank back to the baseline; returns whether it is still usable."""
    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        groups.destroy_since(before)
        baseline.restore()
    except Exception:
        return False
    return default_group_alive()
