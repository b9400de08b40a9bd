"""Leases of GPUs, shared by every pytest process that opens one lease directory.

[Note: Leasing GPUs]
Each GPU has a lock file in the lease directory (``gpu-<id>.lock``); a process
holds a GPU while it holds an exclusive ``flock`` on that file. ``flock`` locks
belong to the open file, so the kernel drops them when the process ends, however
it ends: a worker killed in the middle of a test leaves no stale lease behind.
The pytest process holds the locks (its ranks are spawned, and inherit no
descriptors but their pipes), so a lease lasts exactly as long as the test that
holds it.

Acquiring k GPUs is one step under the allocator lock (``alloc.lock``, also an
``flock``): its holder tries the GPU locks without blocking, keeps k free ones
if there are k, else lets them go, sleeps a few milliseconds and tries again,
still holding the allocator lock. Releasing needs no allocator lock. So:

- nobody deadlocks: only the allocator lock is ever waited on while holding
  something, and its holder waits only for GPUs that holders release without it;
- waiting is fair: the allocator lock's holder is the head of the queue and takes
  the next GPUs that come free, while a process that has just released its lease
  queues behind it for the allocator lock. Two workers wanting both GPUs of two
  take turns; a request for more GPUs is never overtaken by a stream of smaller
  ones (the head lets nobody pass, at the cost of a GPU idling while it waits);
- among the GPUs free, the head takes the sets of ``prefer`` first (the GPUs of
  pools its process keeps, see ``PoolManager``), else the first k in the order of
  ``gpus``, so a process keeps reusing the same few sets.

A process holds at most one lease at a time (a second one while holding a first
could deadlock with another process doing the same) and ``acquire`` says so.
Each released lease is appended to ``journal.jsonl`` in the directory (GPUs,
wall-clock times of acquisition and release, the wait, the pid and the holder's
name): what ``bench/lease_cost.py`` and the leasing tests read.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import json
import os
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

_POLL_FIRST_S = 0.002
_POLL_MAX_S = 0.02
JOURNAL = "journal.jsonl"


class LeaseState(enum.Enum):
    FREE = "free"  # this process holds no lease
    HELD = "held"
    CLOSED = "closed"

    def is_free(self) -> bool:
        return self is LeaseState.FREE


@dataclass(frozen=True)
class Lease:
    """GPUs held by this process until ``GpuLeases.release``."""

    gpus: tuple[str, ...]
    holder: str
    acquired_at: float  # time.time() when the GPUs were taken
    waited_s: float


class GpuLeases:
    """Leases of the GPUs ``gpus`` (ids as ``CUDA_VISIBLE_DEVICES`` names them) to
    this process, shared with every process that opens ``directory``."""

    def __init__(self, directory: Path, gpus: tuple[str, ...]) -> None:
        if len(set(gpus)) != len(gpus):
            raise ValueError(f"GPU ids must be distinct, got {list(gpus)}")
        self.directory = directory
        self.gpus = gpus
        self.state = LeaseState.FREE
        self._held: Lease | None = None
        self._fds: dict[str, int] = {}
        self._alloc_fd: int | None = None

    def acquire(self, count: int, holder: str, prefer: Sequence[tuple[str, ...]] = ()) -> Lease:
        """Blocks until ``count`` GPUs are leased to this process (see the note)."""
        if not self.state.is_free():
            raise RuntimeError(f"cannot lease GPUs: this process's leases are {self.state.value}")
        if not 1 <= count <= len(self.gpus):
            raise ValueError(f"cannot lease {count} of the {len(self.gpus)} GPUs {list(self.gpus)}")
        started = time.monotonic()
        with self._allocator():
            gpus = self._take_when_free(count, prefer)
        self._held = Lease(gpus, holder, time.time(), time.monotonic() - started)
        self.state = LeaseState.HELD
        return self._held

    def release(self) -> None:
        assert self.state is LeaseState.HELD and self._held is not None, self.state
        lease, released_at = self._held, time.time()
        self._journal(lease, released_at)
        for gpu in lease.gpus:
            fcntl.flock(self._fds[gpu], fcntl.LOCK_UN)
        self._held = None
        self.state = LeaseState.FREE

    @contextlib.contextmanager
    def leased(
        self, count: int, holder: str, prefer: Sequence[tuple[str, ...]] = ()
    ) -> Iterator[Lease]:
        lease = self.acquire(count, holder, prefer)
        try:
            yield lease
        finally:
            self.release()

    def close(self) -> None:
        if self.state is LeaseState.HELD:
            self.release()
        for fd in [*self._fds.values(), *([self._alloc_fd] if self._alloc_fd is not None else [])]:
            os.close(fd)
        self._fds.clear()
        self._alloc_fd = None
        self.state = LeaseState.CLOSED

    # -- the allocator's side ------------------------------------------------------

    @contextlib.contextmanager
    def _allocator(self) -> Iterator[None]:
        if self._alloc_fd is None:
            self._alloc_fd = self._open("alloc.lock")
        fcntl.flock(self._alloc_fd, fcntl.LOCK_EX)  # the queue of waiting processes
        try:
            yield
        finally:
            fcntl.flock(self._alloc_fd, fcntl.LOCK_UN)

    def _take_when_free(self, count: int, prefer: Sequence[tuple[str, ...]]) -> tuple[str, ...]:
        delay = _POLL_FIRST_S
        while True:
            taken = self._try_take(count, prefer)
            if taken is not None:
                return taken
            time.sleep(delay)
            delay = min(2 * delay, _POLL_MAX_S)

    def _try_take(self, count: int, prefer: Sequence[tuple[str, ...]]) -> tuple[str, ...] | None:
        """Locks every free GPU, keeps the chosen ``count`` and lets the rest go."""
        free = [gpu for gpu in self.gpus if self._try_lock(gpu)]
        chosen = _choose(free, count, prefer)
        for gpu in free:
            if chosen is None or gpu not in chosen:
                fcntl.flock(self._fds[gpu], fcntl.LOCK_UN)
        return chosen

    def _try_lock(self, gpu: str) -> bool:
        if gpu not in self._fds:
            self._fds[gpu] = self._open(f"gpu-{urllib.parse.quote(gpu, safe='')}.lock")
        try:
            fcntl.flock(self._fds[gpu], fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def _open(self, name: str) -> int:
        self.directory.mkdir(parents=True, exist_ok=True)
        return os.open(self.directory / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def _journal(self, lease: Lease, released_at: float) -> None:
        line = json.dumps(
            {
                "gpus": list(lease.gpus),
                "acquired": lease.acquired_at,
                "released": released_at,
                "waited_s": round(lease.waited_s, 6),
                "pid": os.getpid(),
                "holder": lease.holder,
            }
        )
        fd = os.open(self.directory / JOURNAL, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)


def _choose(
    free: list[str], count: int, prefer: Sequence[tuple[str, ...]]
) -> tuple[str, ...] | None:
    if len(free) < count:
        return None
    for gpus in prefer:
        if len(gpus) == count and all(gpu in free for gpu in gpus):
            return gpus
    return tuple(free[:count])


def read_journal(directory: Path) -> list[dict[str, object]]:
    """The released leases recorded in ``directory``, oldest release first."""
    path = directory / JOURNAL
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
