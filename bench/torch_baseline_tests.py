"""The same 50 trivial 2-rank tests on torch's spawn-per-test base class (for comparison)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase
from torch.testing._internal.common_utils import run_tests


class TrivialTorch(MultiProcessTestCase):
    @property
    def world_size(self) -> int:
        return 2

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()

    def _body(self) -> None:
        dist.init_process_group(
            "gloo", init_method=f"file://{self.file_name}", rank=self.rank, world_size=2
        )
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2
        dist.destroy_process_group()


for _i in range(50):
    setattr(TrivialTorch, f"test_trivial_{_i}", TrivialTorch._body)

if __name__ == "__main__":
    run_tests()
