"""Faults that used to cost a full timeout or blame the harness: a skip on one rank,
a mismatched collective, a pool start slower than the test's limit; and
``--subtest`` lines that must paste back whatever the values print like."""

from __future__ import annotations

import re
import textwrap
import time
from pathlib import Path

import pytest

from harness.expect import assert_expected_inline

HEADER = textwrap.dedent(
    """
    import dataclasses, functools, os
    import pytest, torch
    import torch.distributed as dist
    from harness import DistributedTest
    """
)

SKIPS = HEADER + textwrap.dedent(
    """
    class TestSkips(DistributedTest):
        @pytest.mark.dist_timeout(300)
        def test_skip_on_rank0_only(self):
            if self.rank == 0:
                pytest.skip("only rank 1 runs this")
            dist.all_reduce(torch.ones(1, device=self.device))

        @pytest.mark.dist_timeout(300)
        def test_subtest_skipped_on_rank0_only(self):
            def body(n):
                if n == 1 and self.rank == 0:
                    pytest.skip("rank 0 sits this one out")
                dist.all_reduce(torch.ones(1, device=self.device))

            self.run_subtests({"n": [0, 1, 2]}, body)

        def test_everyone_skips(self):
            pytest.skip("nobody runs this")
    """
)


def test_skip_on_one_rank_is_an_inconsistent_skip_within_the_grace(inner):
    """A skip on rank 0 while rank 1 waits in a collective ends at the fail-grace
    (not the 300 s deadline), names the ranks and shows where rank 1 was blocked;
    a subtest skipped on one rank does the same and the next subtests still run."""
    started = time.monotonic()
    run = inner(SKIPS, "--fail-grace", "2")
    assert time.monotonic() - started < 120, "waited for the deadline"
    run.result.assert_outcomes(failed=2, skipped=1)
    assert "in all_reduce" in run.section("test_skip_on_rank0_only")
    assert_expected_inline(
        run.report("test_skip_on_rank0_only"),
        """\
inconsistent skip: rank 0 skipped (only rank 1 runs this) but rank 1 did not (world_size=2, device=<device>, backend=<backend>)

=== rank 1: stopped after another rank skipped; it was blocked here ===
Current thread 0xADDR (most recent call first):
  (frames elsewhere)
  File "<tmp>/test_inner.py", line 11 in test_skip_on_rank0_only
""",
    )
    if "backend=nccl" in run.section("test_skip_on_rank0_only"):
        _assert_subtest_skip_on_nccl(run)
        return
    assert "in all_reduce" in run.subtest_section("test_subtest_skipped_on_rank0_only", "n=1")
    assert_expected_inline(
        run.report("test_subtest_skipped_on_rank0_only"),
        """\
1 of 3 subtests failed (3 ran, 1 failed, 0 skipped, 0 deselected)

subtest 1 [n=1] failed on no rank (inconsistent skip); re-run it alone with: --subtest "n=1"
""",
    )
    assert_expected_inline(
        run.subtest_report("test_subtest_skipped_on_rank0_only", "n=1"),
        """\
=== subtest 1 [n=1]: failed on no rank (inconsistent skip) ===
re-run it alone with: --subtest "n=1"
rank 1 was stopped after another rank skipped this subtest; it was blocked here:
Current thread 0xADDR (most recent call first):
  (frames elsewhere)
  File "<tmp>/test_inner.py", line 18 in body
  File "<tmp>/test_inner.py", line 20 in test_subtest_skipped_on_rank0_only
""",
    )


def _assert_subtest_skip_on_nccl(run) -> None:
    """On NCCL, rank 1's all_reduce of an initialised communicator returns before it
    completes, so rank 1 is not blocked when rank 0 skips: the subtest is still an
    inconsistent skip, and the test's report names the device work rank 1 left queued."""
    section = run.subtest_section("test_subtest_skipped_on_rank0_only", "n=1")
    assert "inconsistent skip: skipped on rank 0 (rank 0 sits this one out) but run on rank 1" in (
        section
    )
    report = run.report("test_subtest_skipped_on_rank0_only")
    assert report.startswith("1 of 3 subtests failed (3 ran, 1 failed, 0 skipped, 0 deselected)")
    assert "queued device work was still unfinished when another rank failed" in report


MISMATCH = HEADER + textwrap.dedent(
    """
    class TestMismatch(DistributedTest):
        @pytest.mark.check_collectives
        @pytest.mark.dist_timeout(300)
        def test_mismatched_collectives(self):
            if self.rank == 0:
                dist.all_reduce(torch.ones(4, device=self.device))
            else:
                dist.broadcast(torch.ones(7, device=self.device), src=0)
    """
)


def test_mismatched_collective_fails_at_once_in_the_checking_mode(inner):
    """With the check_collectives marker the mismatch is reported at once, on every
    rank, naming each rank's collective, shape and dtype (not at the 300 s deadline)."""
    started = time.monotonic()
    run = inner(MISMATCH)
    assert time.monotonic() - started < 120, "waited for the deadline"
    run.result.assert_outcomes(failed=1)
    report = run.section("test_mismatched_collectives")
    assert "2 of 2 ranks failed: rank 0, rank 1" in report
    assert "Detected mismatch between collectives on ranks" in report
    assert "OpType=ALLREDUCE, TensorShape=[4]" in report
    assert "OpType=BROADCAST, TensorShape=[7]" in report


SLOW_START = HEADER + textwrap.dedent(
    """
    class TestShortLimit(DistributedTest):
        @pytest.mark.timeout(8)
        def test_limit_shorter_than_the_pool_start(self):
            t = torch.ones(1, device=self.device)
            dist.all_reduce(t)
            assert t.item() == 2
    """
)

# Every rank process (started with --multiprocessing-fork) sleeps before it even
# imports torch: a pool start slower than the test's 8 s limit, as on a loaded machine.
SLOW_SITE = textwrap.dedent(
    """
    import sys, time
    if "--multiprocessing-fork" in sys.argv:
        time.sleep(12)
    """
)


def test_a_pool_start_does_not_spend_the_tests_timeout(
    inner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """pytest-timeout's limit of a distributed test starts when its pool is ready: a
    pool start longer than the limit neither fails the test nor shows up as a
    timeout inside the harness."""
    site = tmp_path / "slow_site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_SITE)
    monkeypatch.setenv("PYTHONPATH", f"{site}:{__import__('os').environ['PYTHONPATH']}")
    run = inner(SLOW_START)
    run.result.assert_outcomes(passed=1)
    assert "Timeout" not in run.text
    assert "Traceback" not in run.text, "a rank printed a traceback when the pool stopped"


FILTERS = HEADER + textwrap.dedent(
    """
    @dataclasses.dataclass(frozen=True)
    class Precision:
        param: str
        reduce: str | None

    class Opaque:
        pass

    OPAQUE = Opaque()

    def scaled(x, factor=1.0):
        return x * factor

    class TestFilters(DistributedTest):
        def test_values_that_print_with_commas(self):
            def body(mp, fn, obj):
                with open(os.environ["PIDS_FILE"] + ".combos", "a") as f:
                    f.write(f"{mp.param},{mp.reduce},{getattr(fn, 'keywords', {})}\\n")
                assert not (mp.reduce is None and isinstance(fn, functools.partial)), "fails"

            self.run_subtests(
                {
                    "mp": [Precision("fp16", "fp32"), Precision("bf16", None)],
                    "fn": [functools.partial(scaled, factor=2.0), scaled],
                    "obj": [OPAQUE],
                },
                body,
            )
    """
)


def test_rerun_line_selects_the_failing_subtest_for_any_value(inner):
    """The printed re-run line works when values print with commas (a dataclass, a
    partial) or with a memory address; a malformed --subtest is a usage error."""
    run = inner(FILTERS)
    run.result.assert_outcomes(failed=1)
    line = re.search(r're-run it alone with: --subtest "(.*)"', run.text)
    assert line, run.text
    assert "0x" not in line.group(1)
    combos = run.path / "pids.txt.combos"
    combos.unlink()
    rerun = inner(FILTERS, "--subtest", line.group(1))
    rerun.result.assert_outcomes(failed=1)
    assert "test_values_that_print_with_commas" in rerun.text
    assert combos.read_text().splitlines() == ["bf16,None,{'factor': 2.0}"] * 2  # both ranks
    assert "1 subtests ran, 1 failed, 0 skipped, 3 deselected" in rerun.text
    bad = inner(FILTERS, "--subtest", "mp")
    assert bad.result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--subtest expects key=value pairs" in bad.result.stderr.str()
    assert "INTERNALERROR" not in bad.text + bad.result.stderr.str()
