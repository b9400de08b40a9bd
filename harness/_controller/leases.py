"""Leases of GPUs, shared by every pytest process that opens one lease directory.

[Note: Leasing GPUs]
Each GPU has a lock file in the lease directory (``gpu-<id>.lock``); a process
holds a GPU while it holds an exclusive ``flock`` on that file. With ``slots``
S > 1 (``--gpu-slots``) a GPU has S lock files (``gpu-<id>.lock``,
``gpu-<id>.1.lock``, ...) and up to S tests run on it at once; a lease of k GPUs
is still k distinct GPUs (one slot of each), so the ranks of one test never
share a GPU (NCCL refuses two ranks of a communicator on one device), while the
ranks of two tests may. ``flock`` locks belong to the open file, so the kernel
drops them when the process ends, however it ends: a worker killed in the middle
of a test leaves no stale lease behind.
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
  pools its process keeps, see ``PoolManager``), else the k with the most free
  slots, first in the order of ``gpus`` among equals, so a process keeps reusing
  the same few sets and tests spread over the GPUs.

Every process sharing a directory must lease with the same number of slots (a
session leasing one slot of a GPU that another session believes has two would
share it): the first allocator writes the count to ``slots`` in the directory,
and a process given another count refuses to lease there, unless it was told to
adopt the recorded count (``adopt_slots``: ``--gpu-slots auto``).

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
SLOTS = "slots"  # the directory's slot count, written by its first allocator


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
    slots: tuple[int, ...]  # the slot taken of each GPU, in the order of ``gpus``


class GpuLeases:
    """Leases of the GPUs ``gpus`` (ids as ``CUDA_VISIBLE_DEVICES`` names them) to
    this process, shared with every process that opens ``directory``."""

    def __init__(
        self, directory: Path, gpus: tuple[str, ...], slots: int = 1, adopt_slots: bool = False
    ) -> None:
        if len(set(gpus)) != len(gpus):
            raise ValueError(f"GPU ids must be distinct, got {list(gpus)}")
        if slots < 1:
            raise ValueError(f"a GPU needs at least 1 slot, got {slots}")
        self.directory = directory
        self.gpus = gpus
        self.slots = slots
        self.state = LeaseState.FREE
        self._held: Lease | None = None
        self._fds: dict[tuple[str, int], int] = {}
        self._alloc_fd: int | None = None
        self._slots_agreed = False  # the directory's slot count is this process's
        self._adopt_slots = adopt_slots  # take the count the directory records, if any

    def acquire(self, count: int, holder: str, prefer: Sequence[tuple[str, ...]] = ()) -> Lease:
        """Blocks until ``count`` GPUs are leased to this process (see the note)."""
        if not self.state.is_free():
            raise RuntimeError(f"cannot lease GPUs: this process's leases are {self.state.value}")
        if not 1 <= count <= len(self.gpus):
            raise ValueError(f"cannot lease {count} of the {len(self.gpus)} GPUs {list(self.gpus)}")
        started = time.monotonic()
        with self._allocator():
            taken = self._take_when_free(count, prefer)
        gpus, slots = tuple(gpu for gpu, _ in taken), tuple(slot for _, slot in taken)
        self._held = Lease(gpus, holder, time.time(), time.monotonic() - started, slots)
        self.state = LeaseState.HELD
        return self._held

    def release(self) -> None:
        assert self.state is LeaseState.HELD and self._held is not None, self.state
        lease, released_at = self._held, time.time()
        self._journal(lease, released_at)
        for gpu, slot in zip(lease.gpus, lease.slots):
            fcntl.flock(self._fds[gpu, slot], fcntl.LOCK_UN)
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
            if not self._slots_agreed:
                self._agree_on_slots()
                self._slots_agreed = True
            yield
        finally:
            fcntl.flock(self._alloc_fd, fcntl.LOCK_UN)

    def _agree_on_slots(self) -> None:
        """Records this process's slot count in the directory, or refuses to lease
        where another process records a different one (see the note)."""
        path = self.directory / SLOTS
        if not path.exists():
            path.write_text(f"{self.slots}\n")
            return
        recorded = path.read_text().strip()
        if self._adopt_slots and recorded.isdigit() and int(recorded) >= 1:
            self.slots = int(recorded)
        elif recorded != str(self.slots):
            raise ValueError(
                f"the lease directory {self.directory} is shared with processes leasing "
                f"{recorded} slot(s) per GPU; this one leases {self.slots}: every session "
                "sharing a --gpu-lease-dir must give the same --gpu-slots"
            )

    def _take_when_free(
        self, count: int, prefer: Sequence[tuple[str, ...]]
    ) -> tuple[tuple[str, int], ...]:
        delay = _POLL_FIRST_S
        while True:
            taken = self._try_take(count, prefer)
            if taken is not None:
                return taken
            time.sleep(delay)
            delay = min(2 * delay, _POLL_MAX_S)

    def _try_take(
        self, count: int, prefer: Sequence[tuple[str, ...]]
    ) -> tuple[tuple[str, int], ...] | None:
        """Locks every free slot, keeps one of each chosen GPU and lets the rest go."""
        free = {gpu: [s for s in range(self.slots) if self._try_lock(gpu, s)] for gpu in self.gpus}
        chosen = _choose({gpu: len(slots) for gpu, slots in free.items()}, count, prefer)
        kept = tuple((gpu, free[gpu][0]) for gpu in chosen or ())
        for gpu, slots in free.items():
            for slot in slots:
                if (gpu, slot) not in kept:
                    fcntl.flock(self._fds[gpu, slot], fcntl.LOCK_UN)
        return kept if chosen is not None else None

    def _try_lock(self, gpu: str, slot: int) -> bool:
        if (gpu, slot) not in self._fds:
            suffix = f".{slot}" if slot else ""
            name = f"gpu-{urllib.parse.quote(gpu, safe='')}{suffix}.lock"
            self._fds[gpu, slot] = self._open(name)
        try:
            fcntl.flock(self._fds[gpu, slot], fcntl.LOCK_EX | fcntl.LOCK_NB)
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
                "slots": list(lease.slots),
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
    free_slots: dict[str, int], count: int, prefer: Sequence[tuple[str, ...]]
) -> tuple[str, ...] | None:
    """``count`` GPUs with a free slot: a preferred set, else the least busy."""
    free = [gpu for gpu, n in free_slots.items() if n > 0]
    if len(free) < count:
        return None
    for gpus in prefer:
        if len(gpus) == count and all(gpu in free for gpu in gpus):
            return gpus
    order = sorted(range(len(free)), key=lambda i: (-free_slots[free[i]], i))
    return tuple(free[i] for i in sorted(order[:count]))


def read_journal(directory: Path) -> list[dict[str, object]]:
    """The released leases recorded in ``directory``, oldest release first."""
    path = directory / JOURNAL
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def recorded_slots(directory: Path) -> int | None:
    """The slot count a lease directory records (None before its first lease)."""
    try:
        recorded = (directory / SLOTS).read_text().strip()
    except OSError:
        return None
    return int(recorded) if recorded.isdigit() else None
