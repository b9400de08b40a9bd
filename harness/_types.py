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


class PoolKey(NamedTuple):
    world_size: int
    device_type: str


class Placement(NamedTuple):
    device_type: str
    backend: str
    cuda_visible_devices: str | None


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

    def any_failed(self) -> bool:
        return bool(self.notes) or any(f.status.is_failed() for f in self.finished.values())


@dataclass
class Attempt:
    """What one execution of a test on one pool produced."""

    ranks: dict[int, RankResult]
    subtests: dict[int, SubtestRecord] = field(default_factory=dict)
    timed_out: bool = False
    restart_after: int | None = None
    pool_broken: bool = False
    leaks: dict[int, str] = field(default_factory=dict)  # rank -> what it could not release
