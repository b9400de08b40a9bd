"""Sequential models of small linear layers with FSDP units nested inside, and delays.

[Note: Nested models are wrapped from the inside]
``RECURSIVE`` wraps some inner layers of these models in FSDP while building
them, but not the model itself (except ``AlwaysWrapNestedWrappedModule``, which
applies ``always_wrap_policy`` from the top). The parity harness adds the
top-level wrapper; a test that wants a bare nested model can add its own. Inner
units use the group and the ``fsdp_kwargs`` given to ``init``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdptest.api import FSDP, always_wrap_policy
from fsdptest.interface import (
    DeviceInitMode,
    FSDPInitMode,
    FSDPTestModel,
    ModelFactory,
    to_device_if,
    unwrap_test_model,
)
from harness.collectives import Collective, current, patch_reduce_scatter
from harness.seeding import manual_seed
from models.delays import sleep_ms

_MODEL_SEED = 0


@dataclass(frozen=True)
class LayerFactory:
    """How a nested model builds its layers: on which device, and which FSDP wraps them.

    ``move_to_device`` puts every new layer on the test's device
    (``DeviceInitMode.BEFORE``); ``wrap`` is the identity unless ``wrap_fsdp``;
    ``seed`` only seeds a ``deterministic`` build.
    """

    group: dist.ProcessGroup
    wrap_fsdp: bool
    move_to_device: bool
    deterministic: bool
    fsdp_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def linear(self, in_features: int, out_features: int) -> nn.Module:
        return to_device_if(nn.Linear(in_features, out_features), self.move_to_device)

    def wrap(self, module: nn.Module, group: dist.ProcessGroup | None = None) -> nn.Module:
        if not self.wrap_fsdp:
            return module
        return FSDP(module, group if group is not None else self.group, **self.fsdp_kwargs)

    def seed(self, seed: int) -> None:
        if self.deterministic:
            manual_seed(seed)


class NestedWrappedModule(FSDPTestModel):
    """``Linear(8, 4)``, ``[Linear(4, 16)], Linear(16, 16)``, ``[Linear(16, 4)]``,
    ``Linear(4, 8)`` in sequence, where brackets mark FSDP units under ``RECURSIVE``
    (see [Note: Nested models are wrapped from the inside]). Input: ``rand(4, 8)``
    seeded by rank; loss: the sum of the output."""

    rank: int
    world_size: int
    module: nn.Sequential

    def __init__(
        self,
        group: dist.ProcessGroup,
        wrap_fsdp: bool,
        device_init_mode: DeviceInitMode,
        deterministic: bool,
        **fsdp_kwargs: Any,
    ) -> None:
        super().__init__()
        self.rank = group.rank()
        self.world_size = group.size()
        layers = LayerFactory(
            group, wrap_fsdp, device_init_mode.is_before(), deterministic, fsdp_kwargs
        )
        layers.seed(_MODEL_SEED)
        self.module = self._build(layers)

    def _build(self, layers: LayerFactory) -> nn.Sequential:
        return nn.Sequential(
            layers.linear(8, 4),
            layers.wrap(nn.Sequential(layers.wrap(layers.linear(4, 16)), layers.linear(16, 16))),
            layers.wrap(layers.linear(16, 4)),
            layers.linear(4, 8),
        )

    def get_input(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        manual_seed(1 + self.rank)
        return (torch.rand(4, 8, device=device),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def get_loss(self, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        return output.sum()

    def run_backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    @staticmethod
    def init(
        group: dist.ProcessGroup,
        fsdp_init_mode: FSDPInitMode,
        device_init_mode: DeviceInitMode,
        fsdp_kwargs: Mapping[str, Any] | None = None,
        deterministic: bool = False,
    ) -> nn.Module:
        """``NO_FSDP``: no FSDP unit. ``RECURSIVE``: inner units only, no top-level
        wrapper; ``DeviceInitMode.AFTER`` moves the model after they are built."""
        wrap = fsdp_init_mode is FSDPInitMode.RECURSIVE
        model = NestedWrappedModule(
            group, wrap, device_init_mode, deterministic, **(fsdp_kwargs or {})
        )
        return to_device_if(model, wrap and device_init_mode.is_after())


class AlwaysWrapNestedWrappedModule(NestedWrappedModule):
    """``NestedWrappedModule`` built without inner units and wrapped from the top with
    ``always_wrap_policy`` under ``RECURSIVE``: every submodule is its own unit."""

    @staticmethod
    def init(
        group: dist.ProcessGroup,
        fsdp_init_mode: FSDPInitMode,
        device_init_mode: DeviceInitMode,
        fsdp_kwargs: Mapping[str, Any] | None = None,
        deterministic: bool = False,
    ) -> nn.Module:
        model = NestedWrappedModule.init(
            group, FSDPInitMode.NO_FSDP, device_init_mode, fsdp_kwargs, deterministic
        )
        if fsdp_init_mode is FSDPInitMode.NO_FSDP:
            return model
        fsdp_model = FSDP(model, auto_wrap_policy=always_wrap_policy, **(fsdp_kwargs or {}))
        return to_device_if(fsdp_model, device_init_mode.is_after())


_TRAINABLE = re.compile(r"module\.2.*\.1.*")


class NonUniformReqGradNWM(NestedWrappedModule):
    """``NestedWrappedModule`` whose last two linears form one FSDP unit
    (``[Linear(16, 4), Linear(4, 8)]``), with every parameter frozen except those of
    ``Linear(4, 8)``. Their elements all land on one rank, so the other ranks hold no
    trainable shard: ``ShardedGradScaler`` must cope with that."""

    def _build(self, layers: LayerFactory) -> nn.Sequential:
        return nn.Sequential(
            layers.linear(8, 4),
            layers.wrap(nn.Sequential(layers.wrap(layers.linear(4, 16)), layers.linear(16, 16))),
            layers.wrap(nn.Sequential(layers.linear(16, 4), layers.linear(4, 8))),
        )

    @staticmethod
    def init(
        group: dist.ProcessGroup,
        fsdp_init_mode: FSDPInitMode,
        device_init_mode: DeviceInitMode,
        fsdp_kwargs: Mapping[str, Any] | None = None,
        deterministic: bool = False,
    ) -> nn.Module:
        wrap = fsdp_init_mode is FSDPInitMode.RECURSIVE
        model = NonUniformReqGradNWM(
            group, wrap, device_init_mode, deterministic, **(fsdp_kwargs or {})
        )
        model = to_device_if(model, wrap and device_init_mode.is_after())
        _freeze_all_but(model, _TRAINABLE)
        return model


def _freeze_all_but(model: nn.Module, trainable: re.Pattern[str]) -> None:
    """Freezes every parameter whose name does not match ``trainable`` (the pattern
    matches with and without FSDP's ``_fsdp_wrapped_module.`` infixes)."""
    for name, param in model.named_parameters():
        if not trainable.match(name):
            param.requires_grad_(False)


class ModuleWithDelay(FSDPTestModel):
    """Wraps a test model to delay the device (see ``models.delays``) after computing
    the loss, i.e. before the optimizer step (``delay_after_loss_ms``), and before
    every gradient reduce-scatter of its backward (``delay_before_reduction_ms``)."""

    module: nn.Module
    delay_after_loss_ms: int
    delay_before_reduction_ms: int

    def __init__(
        self, module: nn.Module, delay_after_loss_ms: int, delay_before_reduction_ms: int
    ) -> None:
        super().__init__()
        self.module = module
        self.delay_after_loss_ms = delay_after_loss_ms
        self.delay_before_reduction_ms = delay_before_reduction_ms

    def get_input(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        return unwrap_test_model(self.module).get_input(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def get_loss(self, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        loss = unwrap_test_model(self.module).get_loss(inputs, output)
        sleep_ms(self.delay_after_loss_ms)
        return loss

    def run_backward(self, loss: torch.Tensor) -> None:
        inner = unwrap_test_model(self.module)
        if self.delay_before_reduction_ms <= 0:
            inner.run_backward(loss)
            return
        reduce_scatter = current(Collective.REDUCE_SCATTER)

        def delayed_reduce_scatter(*args: Any, **kwargs: Any) -> Any:
            sleep_ms(self.delay_before_reduction_ms)
            return reduce_scatter(*args, **kwargs)

        with patch_reduce_scatter(delayed_reduce_scatter):
            inner.run_backward(loss)

    @staticmethod
    def init(
        module_class: ModelFactory,
        *model_args: Any,
        delay_after_loss_ms: int,
        delay_before_reduction_ms: int,
        **model_kwargs: Any,
    ) -> nn.Module:
        """``module_class.init(*model_args, **model_kwargs)`` with the delays added."""
        return ModuleWithDelay(
            module_class.init(*model_args, **model_kwargs),
            delay_after_loss_ms,
            delay_before_reduction_ms,
        )


class NestedWrappedModuleWithDelay:
    """Builds a ``NestedWrappedModule`` with delays: ``init`` returns a ``ModuleWithDelay``
    (a factory only, so that its ``init`` can take the signature of the other models')."""

    @staticmethod
    def init(
        group: dist.ProcessGroup,
        fsdp_init_mode: FSDPInitMode,
        device_init_mode: DeviceInitMode = DeviceInitMode.AFTER,
        fsdp_kwargs: Mapping[str, Any] | None = None,
        deterministic: bool = False,
        delay_after_loss_ms: int = 0,
        delay_before_reduction_ms: int = 0,
    ) -> nn.Module:
        return ModuleWithDelay.init(
            NestedWrappedModule,
            group,
            fsdp_init_mode,
            device_init_mode,
            fsdp_kwargs,
            deterministic,
            delay_after_loss_ms=delay_after_loss_ms,
            delay_before_reduction_ms=delay_before_reduction_ms,
        )
