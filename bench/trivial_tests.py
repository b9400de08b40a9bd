"""50 trivial 2-rank tests: what the harness costs per test when the test does nothing."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness import DistributedTest


class TestTrivial(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("i", range(50))
    def test_trivial(self, i: int) -> None:
        t = torch.ones(1, device=self.device)
        dist.all_reduce(t)
        assert t.item() == 2
