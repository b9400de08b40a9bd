"""A mixture-of-experts model: shared layers sharded over all ranks, an expert per rank.

[Note: Expert parameters are rank-local]
Each rank's expert is its own (seeded with ``42 + rank``); only the other
layers are the same on every rank (seeded with 0). Under ``RECURSIVE`` the
expert is an FSDP unit over a group of one rank (``dist.new_group([rank])``):
FSDP never shards it, and its gradients are never averaged with other ranks'.
A reference cannot use DDP (which would average them); it wraps the model in
``DummyDDP`` and ``run_backward`` all-reduces the gradients of the shared
parameters only, by hand.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

from fsdptest.api import FSDP, SEAMS
from fsdptest.interface import DeviceInitMode, FSDPInitMode, to_device_if
from models.delays import sleep_ms
from models.nested import LayerFactory, NestedWrappedModule

_D_EXPERT = 23
_D_SHARED = 12
_D_INPUT = 8
_SHARED_SEED = 0
_EXPERT_SEED = 42


class MixtureOfExperts(NestedWrappedModule):
    """``Linear(8, 12)``, shared ``[Linear(12, 23)]``, expert ``[Linear(23, 12)]``,
    ``Linear(12, 8)``; brackets mark FSDP units under ``RECURSIVE`` (no top-level
    wrapper). See [Note: Expert parameters are rank-local].

    ``delay_before_free_ms`` delays every reshard (the free of unsharded
    parameters) during forward when the expert is an FSDP unit, by patching the
    implementation's reshard seam (``fsdptest.api.SEAMS.reshard``).
    """

    num_expert_params: int = _D_EXPERT * _D_SHARED + _D_SHARED
    group: dist.ProcessGroup
    wrap_fsdp: bool
    delay_before_free_ms: int

    def __init__(
        self,
        group: dist.ProcessGroup,
        wrap_fsdp: bool,
        device_init_mode: DeviceInitMode,
        delay_before_free_ms: int,
        deterministic: bool,
        **fsdp_kwargs: Any,
    ) -> None:
        super().__init__(group, wrap_fsdp, device_init_mode, deterministic, **fsdp_kwargs)
        self.group = group
        self.wrap_fsdp = wrap_fsdp
        self.delay_before_free_ms = delay_before_free_ms

    def _build(self, layers: LayerFactory) -> nn.Sequential:
        layers.seed(_EXPERT_SEED + self.rank)
        expert = layers.linear(_D_EXPERT, _D_SHARED)
        layers.seed(_SHARED_SEED)
        shared = layers.linear(_D_SHARED, _D_EXPERT)
        if layers.wrap_fsdp:  # a group of one rank: see [Note: Expert parameters are rank-local]
            expert = layers.wrap(expert, dist.new_group([self.rank]))
            shared = layers.wrap(shared)
        return nn.Sequential(
            layers.linear(_D_INPUT, _D_SHARED), shared, expert, layers.linear(_D_SHARED, _D_INPUT)
        )

    def expert_parameters(self) -> Iterator[nn.Parameter]:
        return self.module[2].parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay_before_free_ms <= 0 or not isinstance(self.module[2], FSDP):
            return self.module(x)
        with mock.patch(SEAMS.reshard, self._delayed_reshard()):
            return self.module(x)

    def _delayed_reshard(self) -> Callable[..., Any]:
        reshard = pkgutil.resolve_name(SEAMS.reshard)

        def delayed_reshard(*args: Any, **kwargs: Any) -> Any:
            sleep_ms(self.delay_before_free_ms)
            return reshard(*args, **kwargs)

        return delayed_reshard

    def run_backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if not self.wrap_fsdp:
            self._all_reduce_shared_grads()

    @torch.no_grad()
    def _all_reduce_shared_grads(self) -> None:
        """Averages the gradients of every non-expert parameter over the group, as
        FSDP does for the shared units (DDP's job in other references)."""
        experts = {id(param) for param in self.expert_parameters()}
        for param in self.parameters():
            if id(param) in experts or param.grad is None:
                continue
            param.grad.div_(self.world_size)
            dist.all_reduce(param.grad, group=self.group)

    @staticmethod
    def init(
        group: dist.ProcessGroup,
        fsdp_init_mode: FSDPInitMode,
        device_init_mode: DeviceInitMode,
        fsdp_kwargs: Mapping[str, Any] | None = None,
        deterministic: bool = False,
        delay_before_free_ms: int = 0,
    ) -> nn.Module:
        """``NO_FSDP``: no FSDP unit. ``RECURSIVE``: the shared and the expert unit, no
        top-level wrapper; ``DeviceInitMode.AFTER`` moves the model after wrapping."""
        wrap = fsdp_init_mode is FSDPInitMode.RECURSIVE
        model = MixtureOfExperts(
            group,
            wrap,
            device_init_mode,
            delay_before_free_ms,
            deterministic,
            **(fsdp_kwargs or {}),
        )
        return to_device_if(model, wrap and device_init_mode.is_after())
