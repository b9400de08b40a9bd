"""``pytest -n auto`` starts as many workers as the cores, the GPUs' slots and the
memory allow, and the session header says which budget decided (see [Note:
Workers under -n auto] in ``harness._controller.workers``)."""

from __future__ import annotations

import pytest

from harness._controller.options import AUTO_SLOTS_MAX
from harness._controller.workers import WORKER_MEMORY_GIB, WorkerBudget

pytest.importorskip("xdist")


def test_two_cores_without_gpus_run_two_workers() -> None:
    budget = WorkerBudget(cores=2, memory_gib=24.0, gpus=0, ranks=2)
    assert budget.workers == 2
    assert budget.by_gpus is None
    assert "2 worker(s)" in budget.describe()
    assert "ranks on CPU" in budget.describe()


def test_gpus_bound_a_many_core_host() -> None:
    budget = WorkerBudget(cores=64, memory_gib=512.0, gpus=4, ranks=2)
    assert budget.by_gpus == 4 * AUTO_SLOTS_MAX // 2
    assert budget.workers == budget.by_gpus
    assert f"4 GPUs x {AUTO_SLOTS_MAX} slots / 2 ranks: {budget.by_gpus}" in budget.describe()


def test_too_few_gpus_leave_the_ranks_on_cpu() -> None:
    """One GPU and 2-rank tests: the ranks run on CPU, so the cores decide."""
    budget = WorkerBudget(cores=16, memory_gib=128.0, gpus=1, ranks=2)
    assert budget.by_gpus is None
    assert budget.workers == 16


def test_memory_bounds_a_small_host() -> None:
    budget = WorkerBudget(cores=32, memory_gib=3 * WORKER_MEMORY_GIB + 1, gpus=0, ranks=2)
    assert budget.workers == 3


def test_never_fewer_than_one_worker() -> None:
    budget = WorkerBudget(cores=1, memory_gib=1.0, gpus=8, ranks=4)
    assert budget.workers == 1


def test_the_header_names_the_choice(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_one():\n    pass\n")
    result = pytester.runpytest_subprocess(
        "-p", "harness.plugin", "-n", "auto", "--dist-device", "cpu"
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["pytest -n auto: * worker(s), the least of * cores: *"])


def test_xdist_override_is_left_to_xdist(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "1")
    pytester.makepyfile("def test_one():\n    pass\n")
    result = pytester.runpytest_subprocess(
        "-p", "harness.plugin", "-n", "auto", "--dist-device", "cpu"
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["created: 1/1 worker*"])
    result.stdout.no_fnmatch_line("pytest -n auto:*")
