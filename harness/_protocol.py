"""Messages exchanged between the pytest process and its rank processes.

[Note: The control channel]
Each rank owns one duplex pipe to the pytest process. Collectives never carry
harness traffic: a rank that is stuck in a collective must not be able to block
the harness from learning what the other ranks did. The pytest process is the
only arbiter: it decides when a subtest may proceed, when a straggling rank is
stopped, and when a pool is torn down.

Every message is a small frozen dataclass so that it pickles across the spawn
boundary without dragging test objects along. Errors travel as text (the
formatted traceback) so an exception that cannot be pickled still arrives.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Status(enum.Enum):
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"

    def is_failed(self) -> bool:
        return self is Status.FAILED


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank process needs to join its pool."""

    rank: int
    world_size: int
    backend: str
    device_type: str
    store_port: int
    cuda_visible_devices: str | None
    output_dir: str
    capture_output: bool
    parent_pid: int
    sys_path: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    pg_timeout_s: float
    isolated_modules: tuple[str, ...]
    release_cached_memory: bool = False  # empty CUDA's cache after each test
    profile_dir: str | None = None  # a cProfile of each test goes there
    reuse_groups: bool = True  # see [Note: Process groups reused across tests]


@dataclass(frozen=True)
class Ready:
    rank: int
    pid: int


@dataclass(frozen=True)
class RunTest:
    """Run one test method on every rank."""

    nodeid: str
    module_name: str
    module_file: str
    class_qualname: str
    method_name: str
    kwargs: dict[str, object]
    seed: int
    sys_path: tuple[str, ...]
    rewrite_asserts: bool
    subtest_filter: tuple[tuple[str, str], ...]
    resume_after: int
    map_cuda_to_cpu: bool = False  # see harness._rank.cuda_mapping


@dataclass(frozen=True)
class SubtestStarted:
    rank: int
    index: int
    config: str
    deselected: int


@dataclass(frozen=True)
class SubtestFinished:
    rank: int
    index: int
    config: str
    status: Status
    text: str


@dataclass(frozen=True)
class Proceed:
    """Reply to SubtestFinished: every rank finished subtest ``index``."""

    index: int
    any_failed: bool


@dataclass(frozen=True)
class SubtestCounts:
    ran: int = 0
    failed: int = 0
    skipped: int = 0
    deselected: int = 0


@dataclass(frozen=True)
class BodyReturned:
    """The test body returned; the rank now waits for its queued device work."""

    rank: int
    status: Status


@dataclass(frozen=True)
class TestFinished:
    rank: int
    status: Status
    text: str
    exc_type: str
    subtests_failed: bool
    deselected: int
    healthy: bool
    leak: str = ""  # what the test left that the rank could not release
    # Only under a --subtest filter: what the test's run_subtests calls offered
    # (see [Note: A filter that selects nothing] in harness._controller.report).
    subtest_space: tuple[tuple[str, tuple[str, ...]], ...] = ()
    filter_hits: tuple[bool, ...] = ()  # per pair of the filter: matched some combination
    groups_dirty: bool = False  # a cached group was destroyed: every rank empties its cache


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Probe:
    """After a test that did not pass cleanly (or destroyed a cached group): every
    rank empties its group cache; is the default group still in step?"""


@dataclass(frozen=True)
class ProbeResult:
    rank: int
    ok: bool
