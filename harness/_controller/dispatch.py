"""Runs one test item on a pool, replacing the pool when it breaks."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

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


class PoolManager:
    """One reusable pool per (world size, device type) in this pytest process."""

    def __init__(self, settings: PoolSettings) -> None:
        self._settings = settings
        self._pools: dict[PoolKey, RankPool] = {}
        self.pools_started = 0
        self.tests_run = 0

    def acquire(self, request: TestRequest) -> RankPool:
        if not request.fresh_pool:
            pool = self._pools.get(request.key)
            if pool is not None and pool.state.is_ready():
                return pool
            self.discard(request.key)
        pool = RankPool(
            request.key,
            request.placement,
            self._settings,
        )
        self.pools_started += 1
        pool.start(request.message.sys_path)
        if not request.fresh_pool:
            self._pools[request.key] = pool
        return pool

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
    counts the ranks' time on the test only."""
    wall_end: float | None = None
    budget = request.timeout_s
    attempts: list[Attempt] = []
    message = request.message
    manager.tests_run += 1
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
