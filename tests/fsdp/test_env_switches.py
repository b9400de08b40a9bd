"""torch's profiling switches that this FSDP does not implement
(``FSDP_USE_FAKE_ALL_GATHER``, ``FSDP_USE_FAKE_REDUCE``; see [Note: Environment
switches] in fsdp._common): set, they are named in a warning, and the
collectives still run, so training stays right."""

from __future__ import annotations

import copy
import os
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP
from fsdp import ShardingStrategy
from fsdptest import FSDPTest
from harness import current_device

SWITCHES = ("FSDP_USE_FAKE_ALL_GATHER", "FSDP_USE_FAKE_REDUCE")


class TestProfilingSwitches(FSDPTest):
    @property
    def world_size(self) -> int:
        return 2

    def test_fake_collectives(self) -> None:
        """Each switch, each sharded strategy: a warning naming the switch, then
        the same gradient as the mean over ranks of an unwrapped copy's."""
        self.run_subtests(
            {
                "switch": list(SWITCHES),
                "strategy": [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP],
            },
            self._check_switch,
        )

    def _check_switch(self, switch: str, strategy: ShardingStrategy) -> None:
        device = current_device()
        torch.manual_seed(0)
        plain = nn.Linear(6, 5).to(device)
        with mock.patch.dict(os.environ, {switch: "1"}):
            with pytest.warns(UserWarning, match=f"{switch}=1 .* does not implement"):
                model = FSDP(copy.deepcopy(plain), sharding_strategy=strategy, use_orig_params=True)
        x = torch.randn(3, 6, device=device) + self.rank
        model(x).sum().backward()
        plain(x).sum().backward()
        for p in plain.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= self.world_size
        with FSDP.summon_full_params(model, with_grads=True):
            for name, p in model.module.named_parameters():
                expected = dict(plain.named_parameters())[name].grad
                torch.testing.assert_close(p.grad, expected, msg=lambda m, n=name: f"{n}: {m}")

    def test_unset_switches_warn_nothing(self) -> None:
        with mock.patch.dict(os.environ, {s: "0" for s in SWITCHES}):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                FSDP(nn.Linear(4, 4).to(current_device()))
