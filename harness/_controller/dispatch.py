"""Runs one test item on a pool, replacing the pool when it breaks."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from harness._controller.leases import GpuLeases
from harness._controller.pool import PoolStartError, RankPool
from harness._controller.report import RunInfo, Verdict, compose
from harness._protocol import RunTest, Status
from harness._types import Attempt, Placement, PoolKey, PoolSettings


@dataclass(frozen=True)
class TestRequest:
    """Everything the pytest process knows about one distributed test item."""

    key: PoolKey
    placement: Placement
    message: RunTest
    fresh_pool: bool
    timeout_s: float  # the ranks' time on the test (see run())
    grace_s: float
    wall_limit_s: float | None = None  # pytest-timeout's, less a margin; pool start included
    subtest_option: str = "--subtest"  # the spelling re-run hints print

    def info(self) -> RunInfo:
        return RunInfo(
            self.key.world_size,
            self.placement.device_type,
            self.placement.backend,
            self.reported_timeout_s(),
            self.message.subtest_filter,
            self.subtest_option,
        )

    def reported_timeout_s(self) -> float:
        if self.wall_limit_s is None:
            return self.timeout_s
        return min(self.timeout_s, self.wall_limit_s)


_IDLE_LEASED_POOLS = 4  # pools on leased GPUs a process keeps (least recently used go first)


class PoolManager:
    """One reusable pool per (world size, device type, leased GPUs) in this pytest
    process; ``leases`` hands out the GPUs (None: this process leases none)."""

    def __init__(self, settings: PoolSettings, leases: GpuLeases | None = None) -> None:
        self._settings = settings
        self._leases = leases
        self._pools: dict[PoolKey, RankPool] = {}  # least recently used first
        self.pools_started = 0
        self.tests_run = 0

    @contextlib.contextmanager
    def leased(self, request: TestRequest) -> Iterator[TestRequest]:
        """The request bound to GPUs leased for it, held until the block ends
        (see [Note: GPUs under pytest-xdist] in ``harness._controller.devices``)."""
        count = request.placement.lease
        if count == 0:
            yield request
            return
        if self._leases is None:
            raise RuntimeError(f"{request.message.nodeid} needs {count} GPUs but none are leased")
        with self._leases.leased(count, request.message.nodeid, self._kept_gpus(request)) as lease:
            yield replace(request, key=request.key._replace(gpus=lease.gpus))

    def _kept_gpus(self, request: TestRequest) -> list[tuple[str, ...]]:
        """GPU sets of this process's ready pools for the request, most recent first."""
        unbound = request.key._replace(gpus=())
        return [
            key.gpus
            for key, pool in reversed(self._pools.items())
            if key._replace(gpus=()) == unbound and key.gpus and pool.state.is_ready()
        ]

    def acquire(self, request: TestRequest) -> RankPool:
        if not request.fresh_pool:
            pool = self._pools.pop(request.key, None)
            if pool is not None and pool.state.is_ready():
                self._pools[request.key] = pool  # now the most recently used
                return pool
            if pool is not None:
                pool.stop()
        pool = RankPool(
            request.key,
            request.placement,
            self._settings,
        )
        self.pools_started += 1
        started = time.monotonic()
        pool.start(request.message.sys_path)
        self._note_start(pool, time.monotonic() - started)
        if not request.fresh_pool:
            self._pools[request.key] = pool
            self._evict_idle_leased()
        return pool

    def _note_start(self, pool: RankPool, seconds: float) -> None:
        """With --rank-profile, how long each pool took to start."""
        if self._settings.profile_dir is None:
            return
        line = json.dumps({"key": list(pool.key), "seconds": round(seconds, 4), "pid": os.getpid()})
        with open(Path(self._settings.profile_dir) / "pool-starts.jsonl", "a") as f:
            f.write(line + "\n")

    def _evict_idle_leased(self) -> None:
        leased = [key for key in self._pools if key.gpus]
        for key in leased[: max(0, len(leased) - _IDLE_LEASED_POOLS)]:
            self.discard(key)

    def release(self, pool: RankPool, request: TestRequest) -> None:
        if request.fresh_pool or not pool.state.is_ready():
            pool.stop()
            if self._pools.get(pool.key) is pool:
                del self._pools[pool.key]

    def discard(self, key: PoolKey) -> None:
        pool = self._pools.pop(key, None)
        if pool is not None:
            pool.stop()

    def shutdown(self) -> None:
        for key in list(self._pools):
            self.discard(key)


def run(
    manager: PoolManager, request: TestRequest, on_ready: Callable[[], None] = lambda: None
) -> Verdict:
    """Runs the test, resuming after a subtest whose failure broke the pool.
    ``on_ready`` is called once, when the test's first pool is ready.

    [Note: What a test's deadline counts]
    Neither ``timeout_s`` nor pytest-timeout's limit counts the time a pool
    takes to start (the pool's own start timeout bounds that, and says so when
    it expires). On CUDA a fresh pool spends seconds spawning processes and
    initialising CUDA and NCCL, and on a loaded machine a CPU pool can take
    longer than a short test limit: counted against it, the test failed with
    pytest-timeout's message from inside the pool start instead of its ranks'
    stacks. So the plugin starts pytest-timeout's timer from ``on_ready``, and
    ``wall_limit_s`` (just below that limit) runs from there too; ``timeout_s``
    counts the ranks' time on the test only. Nor does the wait for a lease of
    GPUs: the test's time starts once its GPUs are leased and its pool ready."""
    manager.tests_run += 1
    with manager.leased(request) as bound:
        verdict = _run_leased(manager, bound, on_ready)
    verdict.gpus = bound.key.gpus
    return verdict


def _run_leased(
    manager: PoolManager, request: TestRequest, on_ready: Callable[[], None]
) -> Verdict:
    wall_end: float | None = None
    budget = request.timeout_s
    attempts: list[Attempt] = []
    message = request.message
    while True:
        try:
            pool = manager.acquire(request)
        except PoolStartError as exc:
            return _start_failed(attempts, request, exc)
        started = time.monotonic()
        if not attempts:
            on_ready()
            if request.wall_limit_s is not None:
                wall_end = started + request.wall_limit_s
        deadline = started + budget if wall_end is None else min(started + budget, wall_end)
        try:
            attempt = pool.execute(message, deadline, request.grace_s)
        finally:
            manager.release(pool, request)
        attempts.append(attempt)
        budget -= time.monotonic() - started
        if attempt.restart_after is None or time.monotonic() >= deadline:
            return compose(attempts, request.info(), None)
        message = replace(message, resume_after=attempt.restart_after)


def _start_failed(attempts: list[Attempt], request: TestRequest, exc: PoolStartError) -> Verdict:
    if not attempts:
        return compose(attempts, request.info(), str(exc))
    verdict = compose(attempts, request.info(), None)
    verdict.status = Status.FAILED
    verdict.text = verdict.text.rstrip() + f"\n\nthe remaining subtests did not run: {exc}\n"
    return verdict
