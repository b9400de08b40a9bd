"""What the ``fully_shard`` tests share: the two implementations side by side
(ours and torch's, the oracle), a small model with uneven shards, and training
both in lockstep with exact comparison.

Ours and torch's run the same arithmetic (the same all-gather and
reduce-scatter layouts, the same division), so on the same seed their
losses, parameters and gradients agree bit for bit: comparisons are exact."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.tensor import DTensor

import fsdp
from harness import DistributedTest

OURS = SimpleNamespace(
    name="ours",
    fully_shard=fsdp.fully_shard,
    FSDPModule=fsdp.FSDPModule,
    MixedPrecisionPolicy=fsdp.MixedPrecisionPolicy,
    OffloadPolicy=fsdp.OffloadPolicy,
    CPUOffloadPolicy=fsdp.CPUOffloadPolicy,
    UnshardHandle=fsdp.UnshardHandle,
    register_fsdp_forward_method=fsdp.register_fsdp_forward_method,
)
TORCH = SimpleNamespace(
    name="torch",
    fully_shard=torch_fsdp.fully_shard,
    FSDPModule=torch_fsdp.FSDPModule,
    MixedPrecisionPolicy=torch_fsdp.MixedPrecisionPolicy,
    OffloadPolicy=torch_fsdp.OffloadPolicy,
    CPUOffloadPolicy=torch_fsdp.CPUOffloadPolicy,
    UnshardHandle=torch_fsdp.UnshardHandle,
    register_fsdp_forward_method=torch_fsdp.register_fsdp_forward_method,
)
IMPLEMENTATIONS = (OURS, TORCH)

PRECISIONS: dict[str, dict[str, torch.dtype]] = {
    "fp32": {},
    "bf16": {"param_dtype": torch.bfloat16},
    "fp16-reduce-fp32": {"param_dtype": torch.float16, "reduce_dtype": torch.float32},
}


def model(device: torch.device) -> nn.Sequential:
    """Three linear layers of 7, 3 and 11 rows: uneven shards at 2, 3 and 4 ranks,
    and an empty one at 4."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3), nn.Linear(3, 11)).to(device)


def shard_layers(module: nn.Sequential, api: SimpleNamespace, **kwargs: Any) -> nn.Sequential:
    """``fully_shard`` on each linear layer, then on the whole (bottom-up)."""
    for layer in module:
        if isinstance(layer, nn.Linear):
            api.fully_shard(layer, **kwargs)
    api.fully_shard(module, **kwargs)
    return module


def batch(step: int, world_size: int, device: torch.device, features: int = 5) -> torch.Tensor:
    """The global batch of one step (4 rows per rank), the same on every rank."""
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(4 * world_size, features, generator=generator).to(device)


def local_batch(test: DistributedTest, step: int, features: int = 5) -> torch.Tensor:
    x = batch(step, test.world_size, test.device, features)
    return x[4 * test.rank : 4 * test.rank + 4]


def loss_of(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x).float().pow(2).sum()


def twins(build: Callable[[SimpleNamespace], nn.Module]) -> list[nn.Module]:
    """``build(api)`` for ours, then for torch's."""
    return [build(api) for api in IMPLEMENTATIONS]


def assert_same_params(
    test: DistributedTest, ours: nn.Module, theirs: nn.Module, grads: bool = True
) -> None:
    """The same parameters (local shards, placements) and gradients, exactly."""
    pairs = list(zip(ours.named_parameters(), theirs.named_parameters()))
    test.assertEqual(len(pairs), len(list(theirs.parameters())))
    for (name, mine), (their_name, their) in pairs:
        test.assertEqual(name, their_name)
        test.assertEqual(type(mine), type(their))
        test.assertEqual(_local(mine), _local(their), atol=0, rtol=0)
        if isinstance(mine, DTensor):
            test.assertEqual(mine.placements, their.placements)
        if grads:
            if their.grad is None:
                test.assertEqual(mine.grad, None)
            else:
                test.assertEqual(_local(mine.grad), _local(their.grad), atol=0, rtol=0)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def lockstep(
    test: DistributedTest,
    models: list[nn.Module],
    steps: int = 3,
    inputs: Callable[[int], torch.Tensor] | None = None,
) -> None:
    """Trains ``models`` (ours, torch's) with SGD in lockstep, comparing losses,
    parameters and gradients exactly after every backward; zero_grad alternates
    between ``set_to_none`` True and False."""
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for step in range(steps):
        x = inputs(step) if inputs is not None else local_batch(test, step)
        losses = [loss_of(m, x) for m in models]
        for loss in losses:
            loss.backward()
        test.assertEqual(losses[0], losses[1], atol=0, rtol=0)
        assert_same_params(test, models[0], models[1])
        for optim in optims:
            optim.step()
            optim.zero_grad(set_to_none=step % 2 == 0)


def dtensor_params(module: nn.Module) -> Iterator[DTensor]:
    for param in module.parameters():
        assert isinstance(param, DTensor)
        yield param
