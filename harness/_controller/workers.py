"""How many workers ``pytest -n auto`` starts.

[Note: Workers under -n auto]
xdist's own ``auto`` is one worker per physical core. Our tests are not one
process each: a test's ranks are processes of a pool the worker keeps, and
where there are enough GPUs each rank holds one. So the count follows three
budgets, and the smallest wins:

- cores: one worker per core the session may use (``os.sched_getaffinity``). A
  test's ranks spend much of their time waiting for each other, so one worker
  per core keeps the cores busy: ``pytest -n 2`` on two cores is the command CI
  runs.
- GPUs: where at least ``--world-size`` GPUs are visible, the ranks of a test run
  on GPUs, and a GPU holds up to ``AUTO_SLOTS_MAX`` tests at once (see [Note:
  Slots by default] in harness._controller.options): GPUs × slots ÷ ranks per
  test workers keep every slot busy without a worker waiting for a lease.
- memory: a worker's pools (one per world size it met, a rank process each)
  take about ``WORKER_MEMORY_GIB``; the workers fit in the machine's memory.

The session header names the three budgets and the one that decided.
``PYTEST_XDIST_AUTO_NUM_WORKERS`` (xdist's override) and ``-n logical`` are left
to xdist.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from harness._controller.options import AUTO_SLOTS_MAX

WORKER_MEMORY_GIB = 4.0  # a worker's pools at world sizes 2, 3 and 4: 9 rank processes


@dataclass(frozen=True)
class WorkerBudget:
    """The worker count ``-n auto`` chose, and why."""

    cores: int
    memory_gib: float | None  # None: not known on this platform
    gpus: int  # visible GPUs, 0 on CPU runs
    ranks: int  # ranks per test (--world-size)

    @property
    def by_gpus(self) -> int | None:
        """Workers the GPUs' slots hold; None when the ranks do not run on GPUs."""
        if self.gpus < self.ranks:
            return None
        return max(1, self.gpus * AUTO_SLOTS_MAX // self.ranks)

    @property
    def by_memory(self) -> int | None:
        if self.memory_gib is None:
            return None
        return max(1, int(self.memory_gib // WORKER_MEMORY_GIB))

    @property
    def workers(self) -> int:
        return min(b for b in (self.cores, self.by_gpus, self.by_memory) if b is not None)

    def describe(self) -> str:
        budgets = [f"{self.cores} cores: {self.cores}"]
        if self.by_gpus is None:
            budgets.append(f"{self.gpus} GPU(s) for {self.ranks} ranks: ranks on CPU, no limit")
        else:
            budgets.append(
                f"{self.gpus} GPUs x {AUTO_SLOTS_MAX} slots / {self.ranks} ranks: {self.by_gpus}"
            )
        if self.by_memory is not None:
            budgets.append(
                f"{self.memory_gib:.0f} GiB / {WORKER_MEMORY_GIB:.0f} GiB a worker: {self.by_memory}"
            )
        return f"pytest -n auto: {self.workers} worker(s), the least of " + "; ".join(budgets)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (AttributeError, ValueError, OSError):
        return None
