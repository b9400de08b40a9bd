"""Planted cases for tests/harness/test_torchrun.py (run under torchrun, not collected by
default): a failure on rank 1 only, a rank blocked after another failed, a
failing subtest, a test after those, a world size torchrun did not start, and a
test that is not distributed."""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness import DistributedTest


class TestPlanted(DistributedTest):
    def test_a_all_reduce(self) -> None:
        t = torch.ones(2) * (self.rank + 1)
        dist.all_reduce(t)
        assert t.tolist() == [3.0, 3.0]

    def test_b_fails_on_rank_1(self) -> None:
        value = self.rank
        assert value == 0

    def test_c_rank_1_fails_rank_0_blocks(self) -> None:
        if self.rank == 1:
            raise ValueError("rank 1 gives up before the all-reduce")
        dist.all_reduce(torch.ones(1))

    def test_d_subtests(self) -> None:
        def body(x: int) -> None:
            t = torch.ones(1)
            dist.all_reduce(t)
            assert not (x == 2 and self.rank == 1), "planted in subtest x=2 on rank 1"

        self.run_subtests({"x": [1, 2, 3]}, body)

    def test_e_after_the_failures(self) -> None:
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == self.world_size


class TestThreeRanks(DistributedTest):
    world_size = 3

    def test_three(self) -> None:
        raise AssertionError("a 3-rank test cannot run on 2 torchrun ranks")


def test_not_distributed() -> None:
    assert torch.ones(1).item() == 1
