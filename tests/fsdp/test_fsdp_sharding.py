"""Sharding is real: each rank holds 1/N of every flat parameter, and the
unsharded storage exists only while it is needed."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from fsdptest import FSDPTest
from fsdptest.api import FSDP, ModuleWrapPolicy, ShardingStrategy


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    # 7*5+7 = 42 and 5*7+5 = 40 and 3*5+3 = 18 elements: not multiples of 4 or 3
    return nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 5), nn.Linear(5, 3)).to(device)


def _flat_reference(layer: nn.Linear) -> torch.Tensor:
    return torch.cat([layer.weight.detach().reshape(-1), layer.bias.detach().reshape(-1)])


def _units(model: nn.Module) -> list[nn.Module]:
    return [m for m in FSDP.fsdp_modules(model) if m is not model]


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().size()


class TestShardingIsReal(FSDPTest):
    def _wrap(self, strategy: ShardingStrategy) -> tuple[nn.Module, list[nn.Linear]]:
        reference = _model(self.device)
        layers = [layer for layer in reference if isinstance(layer, nn.Linear)]
        flats = [_flat_reference(layer) for layer in layers]
        model = FSDP(
            _model(self.device),
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            sharding_strategy=strategy,
        )
        return model, flats

    def test_each_rank_holds_one_padded_nth(self):
        model, flats = self._wrap(ShardingStrategy.FULL_SHARD)
        for unit, flat in zip(_units(model), flats):
            shard = unit._flat_param.detach()
            self.assertEqual(shard.numel(), math.ceil(flat.numel() / self.world_size))
            gathered = [torch.empty_like(shard) for _ in range(self.world_size)]
            dist.all_gather(gathered, shard)
            padded = torch.cat(gathered)
            # the shards are different parts of one parameter, not copies
            self.assertEqual(padded[: flat.numel()], flat)
            self.assertEqual(padded[flat.numel() :], torch.zeros_like(padded[flat.numel() :]))

    def test_full_shard_frees_after_forward_and_backward(self):
        model, _ = self._wrap(ShardingStrategy.FULL_SHARD)
        out = model(torch.randn(2, 5, device=self.device))
        for unit in _units(model):
            flat = unit._flat_param
            self.assertEqual(_storage(flat._full_param_padded), 0)
            self.assertEqual(flat.data_ptr(), flat._local_shard.data_ptr())
        out.sum().backward()
        for unit in _units(model):
            self.assertEqual(_storage(unit._flat_param._full_param_padded), 0)

    def test_shard_grad_op_frees_after_backward_only(self):
        model, _ = self._wrap(ShardingStrategy.SHARD_GRAD_OP)
        out = model(torch.randn(2, 5, device=self.device))
        for unit in _units(model):
            flat = unit._flat_param
            padded = math.ceil(flat._local_shard.numel() * self.world_size)
            self.assertEqual(_storage(flat._full_param_padded), padded * flat.element_size())
        out.sum().backward()
        for unit in _units(model):
            self.assertEqual(_storage(unit._flat_param._full_param_padded), 0)

    def test_every_rank_shard_changes_after_a_step(self):
        """Each rank updates its own shard (a rank whose shard never changes
        means its gradients never arrived)."""
        model, _ = self._wrap(ShardingStrategy.FULL_SHARD)
        before = [u._flat_param.detach().clone() for u in _units(model)]
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(self.rank)
        model(torch.randn(4, 5, device=self.device)).sum().backward()
        optim.step()
        for unit, old in zip(_units(model), before):
            real = unit._flat_param.detach()
            self.assertNotEqual(real, old)
