"""``fully_shard``: FSDP applied to a module in place, without a wrapper.

[Note: The composable form]
``fully_shard(module)`` builds the same unit a wrapper would (the same
``FSDPState`` and flat parameter) and runs its forward logic from forward
hooks on the module itself, so the module keeps its type and its parameter
names. As in torch's composable FSDP, the original parameters are always kept
(``use_orig_params=True``). ``policy`` applies ``fully_shard`` to submodules the
same way ``auto_wrap_policy`` wraps them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from fsdp._ignored import Ignored
from fsdp._init import UnitArgs, build_unit, resolve_groups
from fsdp._runtime import FSDPState
from fsdp._state_dict import StateDictHooks
from fsdp.api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from fsdp.wrap import _auto_wrap


def fully_shard(
    module: nn.Module,
    *,
    process_group: Any = None,
    policy: Any = None,
    strategy: ShardingStrategy | None = None,
    mixed_precision: MixedPrecision | None = None,
    cpu_offload: CPUOffload | None = None,
    ignored_modules: Iterable[nn.Module] | None = None,
    device_id: int | torch.device | None = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    sync_module_states: bool = False,
    forward_prefetch: bool = False,
) -> nn.Module:
    """Shards ``module``'s parameters in place; returns ``module``."""
    ignored = Ignored.resolve(module, ignored_modules, None)
    strategy = strategy or ShardingStrategy.FULL_SHARD
    groups = resolve_groups(process_group, None, strategy, policy is not None)
    args = UnitArgs(
        sharding_strategy=strategy,
        cpu_offload=cpu_offload,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        mixed_precision=mixed_precision,
        param_init_fn=param_init_fn,
        device_id=device_id,
        sync_module_states=sync_module_states,
        forward_prefetch=forward_prefetch,
        limit_all_gathers=True,
        use_orig_params=True,
    )
    if policy is not None:
        kwargs = {
            "process_group": groups.as_argument(),
            "strategy": strategy,
            "mixed_precision": mixed_precision,
            "cpu_offload": cpu_offload,
            "ignored_modules": ignored.modules,
            "device_id": device_id,
            "param_init_fn": param_init_fn,
            "sync_module_states": sync_module_states,
            "forward_prefetch": forward_prefetch,
        }
        _auto_wrap(module, policy, ignored.modules, ignored.params, kwargs, fully_shard)
    state = build_unit(module, module, args, ignored, groups)
    _install_hooks(module, state)
    StateDictHooks(state).register(module)
    return module


def _install_hooks(module: nn.Module, state: FSDPState) -> None:
    def pre_forward(
        _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args, kwargs = state.root_pre_forward(args, kwargs)
        return state.pre_forward(args, kwargs)

    def post_forward(
        _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        return state.post_forward(output)

    module.register_forward_pre_hook(pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(post_forward, with_kwargs=True)
