"""Black-box tests of the harness: inner pytest sessions and the reports they print."""

from __future__ import annotations

import textwrap

from harness.expect import assert_expected_inline
from tests.conftest import alive, inner_gpus

ON_GPU = inner_gpus() >= 2  # the inner tests here have two ranks

HEADER = textwrap.dedent(
    """
    import ctypes, os, signal, threading, time
    import pytest, torch
    import torch.distributed as dist
    from harness import DistributedTest

    def record(name):
        with open(os.environ["PIDS_FILE"], "a") as f:
            f.write(f"{name} {os.getpid()}\\n")
    """
)


def src(body: str) -> str:
    return HEADER + textwrap.dedent(body)


FAILURES = src(
    """
    class Unpicklable(Exception):
        def __init__(self):
            super().__init__("cannot travel by pickle")
            self.lock = threading.Lock()

    class TestFailures(DistributedTest):
        def test_assert_on_rank1(self):
            value = self.rank
            assert value == 0

        def test_every_rank_raises(self):
            raise ValueError(f"boom on rank {self.rank}")

        def test_exit_code(self):
            if self.rank == 1:
                os._exit(3)
            dist.barrier()

        def test_sigsegv(self):
            if self.rank == 0:
                ctypes.string_at(0)
            dist.barrier()

        def test_unpicklable(self):
            if self.rank == 0:
                raise Unpicklable()

        def test_skip_in_ranks(self):
            self.skipTest("not on this machine")

        def test_passes_after_all_that(self):
            record("after")
            t = torch.ones(1, device=self.device)
            dist.all_reduce(t)
    """
)


def test_failure_reports_name_the_right_rank(inner):
    run = inner(FAILURES, "-rs")
    run.result.assert_outcomes(failed=5, passed=1, skipped=1)

    assert_expected_inline(
        run.report("test_assert_on_rank1"),
        """\
1 of 2 ranks failed: rank 1 (world_size=2, device=<device>, backend=<backend>)

=== rank 1: AssertionError ===
Traceback (most recent call last):
  File "<tmp>/test_inner.py", line 18, in test_assert_on_rank1
    assert value == 0
AssertionError: assert 1 == 0
""",
    )
    assert ("backend=nccl" if ON_GPU else "backend=gloo") in run.section("test_assert_on_rank1")
    assert_expected_inline(
        run.report("test_every_rank_raises"),
        """\
2 of 2 ranks failed: rank 0, rank 1 (world_size=2, device=<device>, backend=<backend>)

=== rank 0: ValueError ===
Traceback (most recent call last):
  File "<tmp>/test_inner.py", line 21, in test_every_rank_raises
    raise ValueError(f"boom on rank {self.rank}")
ValueError: boom on rank 0

=== rank 1: ValueError ===
Traceback (most recent call last):
  File "<tmp>/test_inner.py", line 21, in test_every_rank_raises
    raise ValueError(f"boom on rank {self.rank}")
ValueError: boom on rank 1
""",
    )
    _assert_dying_ranks_reported(run)
    assert "SKIPPED [1] test_inner.py" in run.text and "not on this machine" in run.text
    for pid in run.pids()["after"]:
        assert not alive(pid), "a rank outlived the session"


def _assert_dying_ranks_reported(run):
    """A rank that exits or crashes is named with its exit code or signal."""
    # The surviving rank either fails in the barrier (gloo's words) or, where the
    # backend does not notice (NCCL), is stopped there and shows where it waited.
    exit_code, survivor = run.report("test_exit_code").split("=== rank 0:")
    placement = "(world_size=2, device=<device>, backend=<backend>)"
    if "failed afterwards" in exit_code:
        header = (
            f"rank 1 exited with exit code 3\n1 of 2 ranks failed afterwards: rank 0 {placement}\n"
        )
    else:
        header = f"rank 1 exited with exit code 3 {placement}\n"
        assert survivor.startswith(" stopped after another rank failed; it was blocked here")
    assert exit_code.startswith(header), exit_code
    assert_expected_inline(
        exit_code[len(header) :],
        """\

=== rank 1: exited with exit code 3 ===
last output of the rank:


""",
    )
    assert "in test_exit_code" in survivor

    report = run.section("test_sigsegv")
    assert report.splitlines()[0].startswith("rank 0 killed by signal SIGSEGV (11)")
    assert "Fatal Python error: Segmentation fault" in report
    assert "in test_sigsegv" in report

    report = run.section("test_unpicklable")
    assert "Unpicklable: cannot travel by pickle" in report


HANGS = src(
    """
    class TestHangs(DistributedTest):
        @pytest.mark.dist_timeout(3)
        def test_hang(self):
            record("hang")
            if self.rank == 0:
                dist.barrier()  # waits for rank 1 forever
            else:
                while True:
                    time.sleep(0.05)

        @pytest.mark.dist_timeout(3)
        def test_signal_taken_over(self):
            # As a library may do: the stack signal no longer reaches faulthandler.
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
            if self.rank == 0:
                dist.barrier()
            else:
                while True:
                    time.sleep(0.05)

        @pytest.mark.dist_timeout(3)
        def test_queued_collective(self):
            dist.barrier()  # the communicator is up: the first collective may block
            if self.rank == 0:
                dist.all_reduce(torch.ones(1, device=self.device))  # NCCL: queued
            else:
                while True:
                    time.sleep(0.05)

        @pytest.mark.timeout(6)
        def test_pytest_timeout_marker(self):
            if self.rank == 1:
                while True:
                    time.sleep(0.05)

        def test_next_test_gets_a_fresh_pool(self):
            record("next")
    """
)


def test_hang_reports_every_rank_stack_and_recovers(inner):
    run = inner(HANGS)
    run.result.assert_outcomes(failed=4, passed=1)

    report = run.section("test_hang")
    rank0 = report.split("=== rank 0:")[1].split("=== rank 1:")[0]
    assert "in barrier" in rank0
    assert_expected_inline(
        run.report("test_hang"),
        """\
timed out after 3 s (world_size=2, device=<device>, backend=<backend>); stacks of every rank below

=== rank 0: still running at the deadline ===
Current thread 0xADDR (most recent call first):
  (frames elsewhere)
  File "<tmp>/test_inner.py", line 15 in test_hang

=== rank 1: still running at the deadline ===
Current thread 0xADDR (most recent call first):
  File "<tmp>/test_inner.py", line 18 in test_hang
""",
    )

    # the rank's stack thread answers where the signal does not
    report = run.section("test_signal_taken_over")
    rank0 = report.split("=== rank 0:")[1].split("=== rank 1:")[0]
    assert "in barrier" in rank0 and "in test_signal_taken_over" in rank0
    assert "in test_signal_taken_over" in report.split("=== rank 1:")[1]

    # an NCCL all_reduce returns to Python with its kernel queued; gloo's blocks
    report = run.section("test_queued_collective")
    rank0 = report.split("=== rank 0:")[1].split("=== rank 1:")[0]
    if ON_GPU:
        assert "the test body returned (passed), but its queued device work" in rank0
    else:
        assert "in all_reduce" in rank0 and "in test_queued_collective" in rank0

    # pytest-timeout's marker is honoured, with our report arriving first
    report = run.section("test_pytest_timeout_marker")
    assert report.startswith("timed out after 4.8 s")
    assert "in test_pytest_timeout_marker" in report

    pids = run.pids()
    assert set(pids["hang"]).isdisjoint(pids["next"])
    for pid in pids["hang"] + pids["next"]:
        assert not alive(pid)


SUBTESTS = src(
    """
    class TestSubtests(DistributedTest):
        def test_one_bad_combination(self):
            def body(x, flag):
                with open(os.environ["PIDS_FILE"] + ".combos", "a") as f:
                    f.write(f"{self.rank} {x} {flag}\\n")
                assert not (x == 1 and flag), f"x={x} flag={flag} is wrong on rank {self.rank}"
                dist.barrier()
            self.run_subtests({"x": [0, 1, 2], "flag": [False, True]}, body)

        def test_peer_blocked_in_a_collective(self):
            def body(step):
                if step == 1 and self.rank == 1:
                    raise RuntimeError("rank 1 gave up on step 1")
                dist.barrier()
            self.run_subtests({"step": [0, 1, 2, 3]}, body)

        def test_skipped_combination(self):
            def body(n):
                if n == 0:
                    pytest.skip("n=0 does not apply")
            self.run_subtests({"n": [0, 1]}, body)

        def test_every_combination_skipped(self):
            def body(n):
                pytest.skip(f"n={n} does not apply here")
            self.run_subtests({"n": [0, 1]}, body)
    """
)


def test_subtests_continue_past_failures_and_report_each(inner):
    run = inner(SUBTESTS, "-v", "-rs")
    run.result.assert_outcomes(failed=2, passed=1, skipped=1)

    report = run.section("test_one_bad_combination")
    assert report.splitlines()[0] == (
        "1 of 6 subtests failed (6 ran, 1 failed, 0 skipped, 0 deselected)"
    )
    assert 're-run it alone with: --subtest "x=1, flag=True"' in report
    report = run.subtest_section("test_one_bad_combination", "x=1, flag=True")
    assert "=== subtest 3 [x=1, flag=True]: failed on rank 0, rank 1 ===" in report
    assert "x=1 flag=True is wrong on rank 0" in report
    assert "x=1 flag=True is wrong on rank 1" in report
    assert 're-run it alone with: --subtest "x=1, flag=True"' in report
    combos = (run.path / "pids.txt.combos").read_text().split("\n")
    assert "0 2 True" in combos and "1 2 True" in combos  # ran after the failure

    assert "1 of 4 subtests failed (4 ran, 1 failed" in run.section(
        "test_peer_blocked_in_a_collective"
    )
    report = run.subtest_section("test_peer_blocked_in_a_collective", "step=1")
    assert "=== subtest 1 [step=1]: failed on rank 1 ===" in report
    assert "rank 0 was stopped after another rank failed this subtest" in report
    assert "in body" in report.split("rank 0 was stopped")[1]

    assert "test_skipped_combination: 1 ran, 0 failed, 1 skipped, 0 deselected" in run.text
    # a test that checked nothing is not counted as passed
    assert "every subtest skipped; subtest 0: n=0 does not apply here" in run.text
    assert "4 tests with subtests: 11 subtests ran, 2 failed, 3 skipped" in run.text


def test_subtest_option_selects_one_combination(inner):
    run = inner(SUBTESTS, "-v", "-k", "one_bad", "--subtest", "x=2, flag=True")
    run.result.assert_outcomes(passed=1)
    combos = (run.path / "pids.txt.combos").read_text().split()
    assert sorted(combos) == sorted(["0", "2", "True", "1", "2", "True"])
    assert "test_one_bad_combination: 1 ran, 0 failed, 0 skipped, 5 deselected" in run.text


POOLS = src(
    """
    class TestPools(DistributedTest):
        def test_a(self):
            record("a")
            os.environ["LEAKED_VAR"] = "1"
            torch.set_default_dtype(torch.float64)
            dist.all_reduce = None  # a monkeypatch nobody reverts

        def test_b(self):
            record("b")
            assert "LEAKED_VAR" not in os.environ
            assert torch.get_default_dtype() == torch.float32
            t = torch.ones(1, device=self.device)
            dist.all_reduce(t)
            assert t.item() == 2

        def test_c_fails(self):
            record("c")
            assert self.rank == 5

        def test_d(self):
            record("d")

        def test_d1_dies(self):
            record("d1")
            if self.rank == 1:
                os._exit(3)

        def test_d2(self):
            record("d2")

        @pytest.mark.fresh_pool
        def test_e_fresh(self):
            record("e")

    class TestOneRank(DistributedTest):
        world_size = 1

        def test_one(self):
            record("one")
            assert self.world_size == 1 and dist.get_world_size() == 1

    class TestThreeRanks(DistributedTest):
        @property
        def world_size(self):
            return 3

        def test_three(self):
            record("three")
            assert dist.get_world_size() == 3
    """
)


def test_pools_are_reused_isolated_and_replaced_after_failure(inner):
    run = inner(POOLS)
    run.result.assert_outcomes(passed=7, failed=2)
    pids = run.pids()
    assert len(set(pids["a"])) == 2
    assert set(pids["a"]) == set(pids["b"]) == set(pids["c"])  # reused while passing
    assert set(pids["d"]) == set(pids["c"])  # kept after a clean failure (probe passed)
    assert set(pids["d2"]).isdisjoint(pids["d"])  # replaced after a rank died
    assert set(pids["e"]).isdisjoint(pids["d2"])  # fresh_pool marker
    assert len(pids["one"]) == 1 and len(pids["three"]) == 3
    for group in pids.values():
        for pid in group:
            assert not alive(pid), "a rank outlived the session"


def test_world_size_option_applies_to_unpinned_classes(inner):
    run = inner(POOLS, "--world-size", "3", "-k", "test_a or test_one")
    run.result.assert_outcomes(passed=2)
    pids = run.pids()
    assert len(pids["a"]) == 3 and len(pids["one"]) == 1


PARENT_SKIPS = src(
    """
    class TestParentSkips(DistributedTest):
        @pytest.mark.requires_gpu("SyncBatchNorm forward needs CUDA")
        def test_needs_gpu(self):
            record("gpu")

        @pytest.mark.requires_module("module_that_does_not_exist")
        def test_needs_module(self):
            record("module")
    """
)


def test_skips_are_decided_before_any_rank_starts(inner):
    run = inner(PARENT_SKIPS, "-rs", "--device", "cpu")
    run.result.assert_outcomes(skipped=2)
    assert "SyncBatchNorm forward needs CUDA (ranks run on cpu)" in run.text
    assert "import module_that_does_not_exist failed" in run.text
    assert "rank pools: 0 started" in run.text
    assert run.pids() == {}


XDIST = src(
    """
    class TestSpread(DistributedTest):
        @pytest.mark.parametrize("i", range(6))
        def test_spread(self, i):
            with open(os.environ["PIDS_FILE"], "a") as f:
                f.write(f"{os.environ['PYTEST_XDIST_WORKER']} {os.getpid()}\\n")
            t = torch.ones(1, device=self.device)
            dist.all_reduce(t)
            assert t.item() == 2
    """
)


def test_two_xdist_workers_own_separate_pools(inner):
    run = inner(XDIST, "-n", "2")
    run.result.assert_outcomes(passed=6)
    pids = run.pids()
    assert set(pids) == {"gw0", "gw1"}
    assert set(pids["gw0"]).isdisjoint(pids["gw1"])
    for group in pids.values():
        assert len(set(group)) == 2  # one pool of two ranks per worker, reused
        for pid in group:
            assert not alive(pid)
