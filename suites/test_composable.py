"""``fully_shard``: the composable form of FSDP1 is ``FullyShardedDataParallel(
module, use_orig_params=True)`` without the wrapper.

Torch 2.13 no longer has FSDP1's composable ``fully_shard(module, policy=...)``
(``torch.distributed._composable.fully_shard`` is FSDP2), so the oracle is torch's
wrapper itself: the same module, built the same way on each rank, through an
implementation's ``fully_shard`` with every argument at its default and through
torch's ``FullyShardedDataParallel`` with ``use_orig_params=True`` (also at its
defaults) must hold the same full parameters after construction, give the same
losses and hold the same full parameters after training. Each rank builds its module
from its own seed, so a default that synchronised module states, or sharded
another way, shows. Under an implementation without ``fully_shard`` (torch's)
the suite is skipped, visibly.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdptest import FSDPTest
from fsdptest.api import (
    COMPOSABLE_FULLY_SHARD_MISSING,
    FSDP,
    ModuleWrapPolicy,
    composable_fully_shard,
)
from harness import current_device


class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        self.norm = nn.LayerNorm(d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(self.lin(x)))


def _module(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(Block(5, 7), Block(7, 3), nn.Linear(3, 1)).to(current_device())


def _full_params(model: nn.Module, fsdp: type) -> dict[str, torch.Tensor]:
    with fsdp.summon_full_params(model):
        return {k: v.detach().clone() for k, v in model.named_parameters()}


class TestFullyShardIsTheWrapperWithOrigParams(FSDPTest):
    world_size = 2

    def setUp(self) -> None:
        super().setUp()
        if composable_fully_shard is None:
            pytest.skip(COMPOSABLE_FULLY_SHARD_MISSING)

    def test_defaults_train_as_torchs_wrapper(self) -> None:
        import torch.distributed.fsdp as torch_fsdp
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy

        ours = composable_fully_shard(_module(self.rank), policy=ModuleWrapPolicy({Block}))
        reference = torch_fsdp.FullyShardedDataParallel(
            _module(self.rank),
            auto_wrap_policy=TorchModuleWrapPolicy({Block}),
            use_orig_params=True,
            device_id=current_device(),
        )
        self._assert_same(ours, reference, "after construction")
        optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, reference)]
        for step in range(2):
            x = torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * step + self.rank))
            losses = []
            for model, optim in zip((ours, reference), optims):
                optim.zero_grad()
                loss = model(x.to(current_device())).square().mean()
                loss.backward()
                optim.step()
                losses.append(loss.detach())
            self.assertEqual(losses[0], losses[1], f"loss of step {step}")
        self._assert_same(ours, reference, "after two steps")

    def _assert_same(self, ours: nn.Module, reference: nn.Module, when: str) -> None:
        import torch.distributed.fsdp as torch_fsdp

        mine = _full_params(ours, FSDP)
        theirs = {
            k.replace("_fsdp_wrapped_module.", ""): v
            for k, v in _full_params(reference, torch_fsdp.FullyShardedDataParallel).items()
        }
        self.assertEqual(sorted(mine), sorted(theirs), when)
        for name in mine:
            self.assertEqual(mine[name], theirs[name], f"{name} {when}")
