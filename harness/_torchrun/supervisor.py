"""Supervises one test on one torchrun rank, as ``pool._AttemptDriver`` drives a pool.

The rank thread runs the test (``harness._rank.runner.run_test``) and sends what
a pooled rank sends through its pipe; this rank's supervisor publishes it in the
test's part of the store, answers subtest barriers once every rank finished the
subtest, and decides when its own rank is blocked: at the deadline, or
``grace_s`` after another rank failed or skipped the test or the current subtest
(or stopped beating). It then publishes how its rank ended (``RankEnd``) and
reads every rank's ending to build the same ``Attempt`` on every rank.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from harness._controller.pool import note_stragglers
from harness._protocol import (
    BodyReturned,
    Proceed,
    Status,
    SubtestFinished,
    SubtestStarted,
    TestFinished,
)
from harness._torchrun.exchange import Exchange
from harness._torchrun.rank_thread import LocalChannel, RankThread
from harness._types import Attempt, RankResult, SubtestRecord

_IDLE_POLL_S = 0.01
_BARRIER_POLL_S = 0.002
_COLLECT_MARGIN_S = 30.0  # how long the others may take to publish their ending


@dataclass
class RankEnd:
    """How one rank ended a test, as every rank reads it from the store."""

    finished: TestFinished | None = None
    stack: str | None = None  # blocked in the test: the rank thread's stack
    waiting_at: int | None = None  # blocked at this subtest's barrier, having finished it
    timed_out: bool = False
    current_subtest: tuple[int, str] | None = None
    body_returned: Status | None = None
    subtests_started: int = 0

    def blocked(self) -> bool:
        return self.finished is None


@dataclass
class _Done:
    future: Future[TestFinished]


def _finished(future: Future[TestFinished], rank: int) -> TestFinished:
    """What run_test returned (it reports a test's errors), or its own error."""
    error = future.exception()
    if error is None:
        return future.result()
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return TestFinished(rank, Status.FAILED, text, type(error).__name__, False, 0, healthy=False)


@dataclass
class Supervisor:
    exchange: Exchange  # the test's part of the store
    thread: RankThread
    deadline: float
    grace_s: float
    gone: Callable[[], set[int]]
    end: RankEnd = field(default_factory=RankEnd)
    _barrier: int | None = None  # this rank finished this subtest and waits for the others
    _completed: int = -1  # the last subtest every rank finished
    _grace_deadline: float | None = None
    _channel: LocalChannel = field(default_factory=LocalChannel)
    _future: Future[TestFinished] | None = None
    # By subtest: time.time() when this rank began it and when every rank had
    # finished it (0: never), for its report's start and duration.
    _times: dict[int, tuple[float, float]] = field(default_factory=dict)

    def run(
        self, job: Callable[[LocalChannel], TestFinished]
    ) -> tuple[Attempt, dict[int, RankEnd]]:
        channel = self._channel
        self._future = future = self.thread.submit(lambda: job(channel))
        future.add_done_callback(lambda f: channel.inbox.put(_Done(f)))
        self._supervise(channel)
        self.exchange.put_mine("end", self.end)
        ends = self.exchange.gather(
            "end", self.deadline + self.grace_s + _COLLECT_MARGIN_S, self.gone
        )
        return self._attempt(ends), ends

    def release_barrier(self) -> None:
        """A rank thread waiting at a subtest barrier that will not open fails there."""
        if self.end.waiting_at is not None:
            self._channel.abort()

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether the rank thread finished the test within ``timeout_s``."""
        assert self._future is not None
        with contextlib.suppress(concurrent.futures.TimeoutError):
            self._future.exception(timeout=timeout_s)
        return self._future.done()

    # -- this rank --------------------------------------------------------------

    def _supervise(self, channel: LocalChannel) -> None:
        while True:
            poll = _BARRIER_POLL_S if self._barrier is not None else _IDLE_POLL_S
            try:
                message = channel.inbox.get(timeout=poll)
            except queue.Empty:
                message = None
            if message is not None and self._handle(message):
                return
            self._open_barrier(channel)
            self._watch_failures()
            if time.monotonic() >= self._expiry():
                self._stop_blocked()
                return

    def _handle(self, message: object) -> bool:
        """Records one message of the rank thread; True when the test finished."""
        if isinstance(message, SubtestStarted):
            self.end.current_subtest = (message.index, message.config)
            self.end.subtests_started = max(self.end.subtests_started, message.index + 1)
            self._times.setdefault(message.index, (time.time(), 0.0))
        elif isinstance(message, SubtestFinished):
            self.exchange.put_mine(f"sub/{message.index}", message)
            if message.status is not Status.PASSED:
                self.exchange.put(f"failed/{message.index}", self.exchange.rank)
            self._barrier = message.index
        elif isinstance(message, BodyReturned):
            self.end.body_returned = message.status
        elif isinstance(message, _Done):
            self.end.finished = _finished(message.future, self.exchange.rank)
            self.end.current_subtest = None
            if self.end.finished.status is not Status.PASSED:
                self.exchange.put("failed/test", self.exchange.rank)
            return True
        return False

    def _open_barrier(self, channel: LocalChannel) -> None:
        index = self._barrier
        if index is None:
            return
        finished = self.exchange.everyones(f"sub/{index}")
        if len(finished) < self.exchange.world_size:
            return
        record = SubtestRecord(index, finished[0].config, finished)
        self._times[index] = (self._times.get(index, (time.time(), 0.0))[0], time.time())
        self._barrier, self._completed, self._grace_deadline = None, index, None
        self.end.current_subtest = None
        channel.reply(Proceed(index, record.any_failed()))

    def _watch_failures(self) -> None:
        """Another rank failed (or skipped) the test or the current subtest, or is gone."""
        if self._grace_deadline is not None:
            return
        if self.exchange.has("failed/test") or self.exchange.has(f"failed/{self._completed + 1}"):
            self._grace_deadline = time.monotonic() + self.grace_s
        elif self.gone():
            self._grace_deadline = time.monotonic() + self.grace_s

    def _expiry(self) -> float:
        if self._grace_deadline is None:
            return self.deadline
        return min(self.deadline, self._grace_deadline)

    def _stop_blocked(self) -> None:
        self.end.timed_out = time.monotonic() >= self.deadline
        if self._barrier is not None:
            self.end.waiting_at = self._barrier
        else:
            self.end.stack = self.thread.stack() or "(no stack: it did not answer)"

    # -- every rank -------------------------------------------------------------

    def _attempt(self, ends: dict[int, RankEnd]) -> Attempt:
        world = self.exchange.world_size
        attempt = Attempt(ranks={r: RankResult(r) for r in range(world)})
        for rank, result in attempt.ranks.items():
            end = ends.get(rank)
            if end is None:
                result.death = "stopped answering (no heartbeat; see torchrun's error summary)"
                attempt.pool_broken = True
                continue
            result.finished, result.body_returned = end.finished, end.body_returned
            result.current_subtest = end.current_subtest
            if end.stack is not None:
                result.stopped_stack = end.stack
            elif end.waiting_at is not None:
                result.stopped_stack = (
                    f"(waiting for the other ranks after subtest {end.waiting_at})"
                )
            attempt.timed_out |= end.timed_out
            attempt.pool_broken |= end.blocked() or not (end.finished and end.finished.healthy)
        attempt.subtests = self._subtests(ends)
        waiting = [e.waiting_at for e in ends.values() if e.waiting_at is not None]
        if waiting and not attempt.timed_out:
            attempt.restart_after = waiting[0]
            note_stragglers(attempt, waiting[0])
        return attempt

    def _subtests(self, ends: dict[int, RankEnd]) -> dict[int, SubtestRecord]:
        records: dict[int, SubtestRecord] = {}
        started = max((e.subtests_started for e in ends.values()), default=0)
        for index in range(started):
            finished: dict[int, SubtestFinished] = self.exchange.everyones(f"sub/{index}")
            config = next(iter(finished.values())).config if finished else None
            for end in ends.values():
                if config is None and end.current_subtest and end.current_subtest[0] == index:
                    config = end.current_subtest[1]
            if config is not None:
                started, stopped = self._times.get(index, (0.0, 0.0))
                records[index] = SubtestRecord(index, config, finished, [], started, stopped)
        return records
