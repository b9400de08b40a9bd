"""``rank_calls``: tests that stay in the pytest process and send calls to pooled
ranks (black-box, with inner sessions), hypothesis driving them included."""

from __future__ import annotations

import re
import textwrap
from typing import Any

HEADER = textwrap.dedent(
    """
    import os, time
    import pytest, torch
    import torch.distributed as dist
    from hypothesis import given, settings, strategies as st
    from harness import DistributedTest

    class Ranks(DistributedTest):
        def total(self, value):
            t = torch.full((1,), float(value + self.rank), device=self.device)
            dist.all_reduce(t)
            assert t.item() == 2 * value + 1, t

        def fails_on_rank1(self):
            assert self.rank == 0, "rank 1 says no"

        def breaks_from(self, x, mode):
            if x >= 5 and self.rank == 1:
                if mode == "hang":
                    while True:
                        time.sleep(0.05)
                os._exit(3)
            dist.barrier()

    ONE_SHOT = settings(derandomize=True, database=None, deadline=None, max_examples=30)
    """
)


def src(body: str) -> str:
    return HEADER + textwrap.dedent(body)


CALLS = src(
    """
    def test_outcomes(rank_calls):
        assert rank_calls.device_type(2) in ("cpu", "cuda")
        assert rank_calls.run(Ranks, "total", 2, value=4).passed
        failed = rank_calls.run(Ranks, "fails_on_rank1", 2)
        assert failed.failed and "rank 1 says no" in failed.report
        assert "1 of 2 ranks failed: rank 1" in failed.report

    class Later(Ranks):
        def total(self, value):
            assert value == -1, "the subclass's method runs"

    def test_subclass_and_misuse(rank_calls):
        assert "the subclass's method runs" in rank_calls.run(Later, "total", 2, value=4).report
        with pytest.raises(TypeError, match="not a DistributedTest subclass"):
            rank_calls.run(pytest.Pytester, "makepyfile", 2)
        with pytest.raises(TypeError, match="has no method 'nothing'"):
            rank_calls.run(Ranks, "nothing", 2)
    """
)


def test_calls_return_the_ranks_verdict(inner: Any) -> None:
    run = inner(CALLS)
    run.result.assert_outcomes(passed=2)
    assert re.search(r"rank pools: 1 started, 3 distributed tests ran", run.text)


SEARCHES = src(
    """
    @ONE_SHOT
    @given(x=st.integers(0, 9))
    def test_death_is_shrunk(rank_calls, x):
        outcome = rank_calls.run(Ranks, "breaks_from", 2, timeout_s=30, x=x, mode="exit")
        assert outcome.passed, outcome.report

    @ONE_SHOT
    @given(x=st.integers(0, 9))
    def test_hang_is_shrunk(rank_calls, x):
        outcome = rank_calls.run(Ranks, "breaks_from", 2, timeout_s=2, x=x, mode="hang")
        assert outcome.passed, outcome.report
    """
)


def test_hypothesis_shrinks_through_dead_and_hung_ranks(inner: Any) -> None:
    """Every failing example breaks the pool (a rank dies, or hangs until its
    call's deadline); each next call gets a fresh one, and hypothesis still
    shrinks to the smallest failing value."""
    run = inner(SEARCHES)
    run.result.assert_outcomes(failed=2)
    death = run.section("test_death_is_shrunk")
    assert "x=5" in death and "rank 1 exited with exit code 3" in death
    hang = run.section("test_hang_is_shrunk")
    assert "x=5" in hang and "timed out after 2 s" in hang
    assert "in breaks_from" in hang  # the hung rank's stack
    started = int(re.search(r"rank pools: (\d+) started", run.text).group(1))  # type: ignore[union-attr]
    assert started >= 4, "each failing call replaces the pool"
