"""Small models of upstream's FSDP tests that are not parity test models.

``MLP``/``MLPStack``/``DoubleLinear`` are generic building blocks; ``SkipModule``,
``NestedLinear`` and ``SkipModel`` are the wrapping tests' models, wrapped with
``wrap()`` inside an ``enable_wrap`` context; ``DeterministicModel`` is the
two-layer model of the older summon-full-params tests. "The device" is the
test's (``fsdptest.api.current_device``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from fsdptest.api import FSDP, CPUOffload, current_device, fully_shard, wrap
from harness.seeding import manual_seed

_DETERMINISTIC_SEED = 0


class MLP(nn.Module):
    """``in_proj: Linear(dim, m * dim)``, ReLU, ``out_proj: Linear(m * dim, dim)``, ReLU,
    plus an optional ``buffer`` (``randn(dim)``, else ``None``) added to the output;
    built on ``device`` (``None``: torch's default)."""

    in_proj: nn.Linear
    out_proj: nn.Linear
    buffer: torch.Tensor | None

    def __init__(
        self,
        dim: int,
        device: torch.device | None = None,
        *,
        bias: bool = True,
        with_buffer: bool = False,
        dim_multiplier: int = 4,
    ) -> None:
        super().__init__()
        hidden = dim_multiplier * dim
        self.in_proj = nn.Linear(dim, hidden, device=device, bias=bias)
        self.out_proj = nn.Linear(hidden, dim, device=device, bias=bias)
        if with_buffer:
            self.register_buffer("buffer", torch.randn((dim,), device=device))
        else:
            self.buffer = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = F.relu(self.out_proj(F.relu(self.in_proj(x))))
        return z if self.buffer is None else z + self.buffer

    def reset_parameters(self) -> None:
        """Re-draws the buffer only (the linears keep their parameters)."""
        if self.buffer is not None:
            nn.init.normal_(self.buffer)


class MLPStack(nn.Sequential):
    """``MLP(d, dim_multiplier=3)``, ``MLP(d)``, ``MLP(d, dim_multiplier=3)`` (uneven
    hidden sizes), then a bias-free ``LayerNorm(d)`` when ``with_seq_parallel``.
    ``parallelize`` applies tensor parallelism over a TP mesh, then the FSDP2
    ``fully_shard`` of the implementation under test over a data-parallel mesh."""

    with_seq_parallel: bool

    def __init__(self, mlp_dim: int, *, with_seq_parallel: bool = False) -> None:
        layers: list[nn.Module] = [
            MLP(mlp_dim, dim_multiplier=3),
            MLP(mlp_dim),
            MLP(mlp_dim, dim_multiplier=3),
        ]
        if with_seq_parallel:
            layers.append(nn.LayerNorm(mlp_dim, bias=False))
        super().__init__(*layers)
        self.with_seq_parallel = with_seq_parallel

    def parallelize(
        self,
        tp_mesh: DeviceMesh,
        dp_mesh: DeviceMesh,
        use_activation_checkpointing: bool,
        **fsdp_kwargs: Any,
    ) -> MLPStack:
        """Upstream's plan: each MLP's ``in_proj`` column-wise and ``out_proj`` row-wise
        over ``tp_mesh`` (activations kept as DTensors between them; the last output
        sharded on dim 1 with sequence parallelism, whose ``LayerNorm`` is then
        sequence-parallel), optional activation checkpointing per MLP, and
        ``fully_shard`` over ``dp_mesh`` on each MLP and on the stack."""
        parallelize_module(self, device_mesh=tp_mesh, parallelize_plan=self._tp_plan())
        for module in self:
            if isinstance(module, nn.LayerNorm):
                continue
            if use_activation_checkpointing:
                checkpoint(module)
            fully_shard(module, mesh=dp_mesh, **fsdp_kwargs)
        fully_shard(self, mesh=dp_mesh, **fsdp_kwargs)
        return self

    def _tp_plan(self) -> dict[str, ParallelStyle]:
        last_out = (
            RowwiseParallel(output_layouts=Shard(1))
            if self.with_seq_parallel
            else RowwiseParallel()
        )
        plan: dict[str, ParallelStyle] = {}
        for index in range(3):
            plan[f"{index}.in_proj"] = ColwiseParallel(use_local_output=False)
            plan[f"{index}.out_proj"] = RowwiseParallel(use_local_output=False)
        plan["2.out_proj"] = last_out
        if self.with_seq_parallel:
            plan["3"] = SequenceParallel(sequence_dim=1)
        return plan


class DoubleLinear(nn.Module):
    """Two ``Linear(dim, dim)`` with ReLU: returns both outputs, or, without
    ``use_second_linear``, only the first (``lin2`` is then an unused module)."""

    lin1: nn.Linear
    lin2: nn.Linear
    relu: nn.ReLU
    use_second_linear: bool

    def __init__(self, dim: int, use_second_linear: bool = True) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)
        self.relu = nn.ReLU()
        self.use_second_linear = use_second_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        first = self.relu(self.lin1(x))
        return (first, self.relu(self.lin2(x))) if self.use_second_linear else first


class SkipModule(nn.Module):
    """A bias-free ``Linear(10, 10)`` named ``lin``."""

    lin: nn.Linear

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(10, 10, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class NestedLinear(nn.Module):
    """A bias-free ``Linear(10, 10)`` on the device, passed through ``wrap()`` when
    ``fsdp_wrap`` (an FSDP unit only inside ``enable_wrap``)."""

    nested_linear: nn.Module

    def __init__(self, fsdp_wrap: bool) -> None:
        super().__init__()
        linear = nn.Linear(10, 10, bias=False).to(current_device())
        self.nested_linear = wrap(linear) if fsdp_wrap else linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.nested_linear(x)


class SkipModel(nn.Module):
    """``linear`` (bias-free 10x10), ``linear_skip`` (a ``SkipModule``) and
    ``nested_linear`` (a ``NestedLinear``, itself wrapped when ``double_nest``),
    the last passed through ``wrap(..., device_id=<the device>)``."""

    linear: nn.Linear
    linear_skip: SkipModule
    nested_linear: nn.Module

    def __init__(self, double_nest: bool) -> None:
        super().__init__()
        device = current_device()
        self.linear = nn.Linear(10, 10, bias=False).to(device)
        self.linear_skip = SkipModule().to(device)
        self.nested_linear = wrap(NestedLinear(fsdp_wrap=double_nest), device_id=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.nested_linear(self.linear_skip(self.linear(x)))


class DeterministicModel(nn.Module):
    """``outer(inner(x))`` with two ``Linear(2, 2)`` built from seed 0 on the device;
    ``inner`` is an FSDP unit (with ``cpu_offload``) when ``wrap_fsdp``."""

    inner: nn.Module
    outer: nn.Linear

    def __init__(self, wrap_fsdp: bool, cpu_offload: CPUOffload | None = None) -> None:
        super().__init__()
        manual_seed(_DETERMINISTIC_SEED)
        device = current_device()
        inner = nn.Linear(2, 2).to(device)
        offload = cpu_offload if cpu_offload is not None else CPUOffload(offload_params=False)
        self.inner = FSDP(inner, cpu_offload=offload) if wrap_fsdp else inner
        self.outer = nn.Linear(2, 2).to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.inner(x))
