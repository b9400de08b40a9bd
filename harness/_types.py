"""Value types the controller side passes around: where a pool runs, and what
its ranks did for one test."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from harness._protocol import Status, SubtestFinished, TestFinished


@dataclass(frozen=True)
class PoolSettings:
    """What every pool of a pytest process is started with."""

    capture_output: bool
    pg_timeout_s: float
    isolated_modules: tuple[str, ...]  # see harness.plugin.isolated_modules
    release_cached_memory: bool = False  # other processes may lease the pools' GPUs
    profile_dir: str | None = None  # --rank-profile
    reuse_groups: bool = True  # not --fresh-groups


class PoolKey(NamedTuple):
    world_size: int
    device_type: str
    check_collectives: bool = False  # see [Note: Checking collectives] in harness.plugin
    gpus: tuple[str, ...] = ()  # the leased GPUs the pool runs on (see harness._controller.devices)


class Placement(NamedTuple):
    """Where a test's ranks run. ``cuda_visible_devices`` is what the ranks see:
    None for the GPUs of the test's lease, "" for none. ``lease`` is how many GPUs
    the test leases (0: none); ``fallback`` says why a test that would have run on
    GPUs runs on CPU ranks."""

    device_type: str
    backend: str
    cuda_visible_devices: str | None
    lease: int = 0
    fallback: str = ""


@dataclass
class RankResult:
    rank: int
    finished: TestFinished | None = None
    death: str | None = None
    stopped_stack: str | None = None
    output: str = ""
    current_subtest: tuple[int, str] | None = None
    deselected: int = 0
    body_returned: Status | None = None

    def deselected_total(self) -> int:
        return self.finished.deselected if self.finished is not None else self.deselected


@dataclass
class SubtestRecord:
    index: int
    config: str
    finished: dict[int, SubtestFinished] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    started: float = 0.0  # time.time() when the first rank began it
    stopped: float = 0.0  # when the last rank finished it (0: never)

    def any_failed(self) -> bool:
        failed = any(f.status.is_failed() for f in self.finished.values())
        return bool(self.notes) or failed or bool(self.inconsistent_skip())

    def all_skipped(self) -> bool:
        return bool(self.finished) and all(
            f.status is Status.SKIPPED for f in self.finished.values()
        )

    def inconsistent_skip(self) -> str:
        """A description when some ranks skipped this subtest and others ran it."""
        skipped = sorted(r for r, f in self.finished.items() if f.status is Status.SKIPPED)
        ran = sorted(r for r, f in self.finished.items() if f.status is not Status.SKIPPED)
        if not skipped or not ran:
            return ""
        reason = self.finished[skipped[0]].text
        return (
            f"inconsistent skip: skipped on {_ranks(skipped)} ({reason}) but run on {_ranks(ran)}"
        )


def _ranks(ranks: list[int]) -> str:
    return ", ".join(f"rank {r}" for r in ranks)


@dataclass
class Attempt:
    """What one execution of a test on one pool produced."""

    ranks: dict[int, RankResult]
    subtests: dict[int, SubtestRecord] = field(default_factory=dict)
    timed_out: bool = False
    restart_after: int | None = None
    pool_broken: bool = False
    leaks: dict[int, str] = field(default_factory=dict)  # rank -> what it could not release
