"""One FSDP implementation's public API, by its module (rank side).

The conformance search runs every scenario twice in the same ranks, once per
implementation, so it cannot use ``fsdptest.api`` (one implementation per
session, chosen when first imported). ``FsdpApi`` takes the public FSDP1 names
from the module a name resolves to (``fsdptest.implementations``), with the same
lookup ``fsdptest.api`` uses, and turns a scenario's plain data into that
implementation's objects (enums, configs, wrap policies). Nothing here branches
on which implementation it is.
"""

from __future__ import annotations

import enum
import functools
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from fsdptest.api import PublicAPI
from fsdptest.conformance.nets import NetBlock
from fsdptest.conformance.scenario import Settings, StateDictKind
from fsdptest.implementations import Implementation, resolve
from fsdptest.properties.examples import Precision, Prefetch, Wrap
from fsdptest.properties.modules import Head, TiedLinear, TiedLinears
from fsdptest.properties.reference import dtype_of

NEEDED = (
    "FullyShardedDataParallel",
    "ShardingStrategy",
    "MixedPrecision",
    "CPUOffload",
    "BackwardPrefetch",
    "StateDictType",
    "FullStateDictConfig",
    "ShardedStateDictConfig",
    "LocalStateDictConfig",
    "FullOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "LocalOptimStateDictConfig",
    "OptimStateKeyType",
    "ModuleWrapPolicy",
    "size_based_auto_wrap_policy",
)


# [Note: Calls as a user writes them]
# A user leaves out an argument at its documented default, so the search does
# too: an argument whose value is torch's documented default (``DEFAULTS``, the
# defaults of torch's signatures, asserted by tests/conformance/test_conformance_search.py)
# is not passed. For a correct implementation nothing changes (a plain
# parameter gets the same value either way); an implementation whose own
# default differs from the documented one is then observed, which passing
# every argument explicitly never showed. Enum values compare by member name.
DEFAULTS: dict[str, dict[str, Any]] = {
    "FullyShardedDataParallel": {
        "sharding_strategy": "FULL_SHARD",  # torch: None, documented as FULL_SHARD
        "auto_wrap_policy": None,
        "backward_prefetch": "BACKWARD_PRE",
        "mixed_precision": None,
        "param_init_fn": None,
        "sync_module_states": False,
        "forward_prefetch": False,
        "limit_all_gathers": True,
        "use_orig_params": False,
    },
    "summon_full_params": {
        "recurse": True,
        "writeback": True,
        "rank0_only": False,
        "offload_to_cpu": False,
        "with_grads": False,
    },
    "clip_grad_norm_": {"norm_type": 2.0},
    "fsdp_modules": {"root_only": False},
    "MixedPrecision": {
        "param_dtype": None,
        "reduce_dtype": None,
        "buffer_dtype": None,
        "keep_low_precision_grads": False,
        "cast_forward_inputs": False,
        "cast_root_forward_inputs": True,
    },
    "FullStateDictConfig": {"offload_to_cpu": False, "rank0_only": False},
    "ShardedStateDictConfig": {"offload_to_cpu": False, "_use_dtensor": False},
    "LocalStateDictConfig": {"offload_to_cpu": False},
    "FullOptimStateDictConfig": {"offload_to_cpu": True, "rank0_only": False},
    "ShardedOptimStateDictConfig": {"offload_to_cpu": True, "_use_dtensor": False},
    "LocalOptimStateDictConfig": {"offload_to_cpu": False},
}


def _plain_default(value: Any) -> Any:
    return value.name if isinstance(value, enum.Enum) else value


def as_a_user_writes(callee: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` less those at ``callee``'s documented default (see [Note: Calls as a
    user writes them])."""
    defaults = DEFAULTS[callee]
    return {
        k: v
        for k, v in kwargs.items()
        if k not in defaults
        or type(_plain_default(v)) is not type(defaults[k])
        or _plain_default(v) != defaults[k]
    }


class FsdpApi:
    """The public names of one implementation (see the module docstring)."""

    implementation: Implementation
    names: dict[str, Any]

    def __init__(self, name: str) -> None:
        self.implementation = resolve(name)
        public = PublicAPI(self.implementation)
        public.require(NEEDED)
        self.names = public.found

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["names"][name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def FSDP(self) -> Any:
        return self.names["FullyShardedDataParallel"]

    def describe(self) -> str:
        return self.implementation.describe()

    def mixed_precision(self, precision: Precision | None) -> Any:
        if precision is None:
            return None
        extra: dict[str, Any] = {}
        if precision.norms_in_full_precision:
            extra["_module_classes_to_ignore"] = (_BatchNorm, nn.LayerNorm)
        kwargs = {
            "param_dtype": dtype_of(precision.param_dtype),
            "reduce_dtype": dtype_of(precision.reduce_dtype),
            "buffer_dtype": dtype_of(precision.buffer_dtype),
            "keep_low_precision_grads": precision.keep_low_precision_grads,
            "cast_forward_inputs": precision.cast_forward_inputs,
            "cast_root_forward_inputs": precision.cast_root_forward_inputs,
        }
        return self.MixedPrecision(**as_a_user_writes("MixedPrecision", kwargs), **extra)

    def prefetch(self, prefetch: Prefetch) -> Any:
        return None if prefetch is Prefetch.NONE else self.BackwardPrefetch[prefetch.value]

    def policy(self, wrap: Wrap, min_num_params: int) -> Any:
        """See [Note: What keeps a drawn model wrappable] in fsdptest.properties.modules."""
        if wrap is Wrap.BLOCKS:
            return self.ModuleWrapPolicy({NetBlock})
        if wrap is Wrap.SIZE:
            return functools.partial(
                self.size_based_auto_wrap_policy,
                min_num_params=min_num_params,
                force_leaf_modules={TiedLinears},
                exclude_wrap_modules={nn.ModuleList, nn.ModuleDict, nn.Embedding, Head, TiedLinear},
            )
        return None

    def state_dict_type(self, settings: Settings) -> Any:
        return self.StateDictType[settings.kind.value]

    def configs(self, settings: Settings) -> tuple[Any, Any]:
        """(state_dict_config, optim_state_dict_config); (None, None) for the defaults."""
        if not settings.configs:
            return None, None
        offload, optim_offload = settings.offload_to_cpu, settings.optim_offload
        if settings.kind is StateDictKind.FULL:
            return (
                self._config("FullStateDictConfig", offload_to_cpu=offload, rank0_only=settings.rank0_only),
                self._config("FullOptimStateDictConfig", offload_to_cpu=optim_offload, rank0_only=settings.optim_rank0_only),
            )  # fmt: skip
        if settings.kind is StateDictKind.SHARDED:
            return (
                self._config("ShardedStateDictConfig", offload_to_cpu=offload, _use_dtensor=settings.dtensor),
                self._config("ShardedOptimStateDictConfig", offload_to_cpu=optim_offload, _use_dtensor=settings.dtensor),
            )  # fmt: skip
        return (
            self._config("LocalStateDictConfig", offload_to_cpu=offload),
            self._config("LocalOptimStateDictConfig", offload_to_cpu=optim_offload),
        )

    def _config(self, name: str, **kwargs: Any) -> Any:
        return self.names[name](**as_a_user_writes(name, kwargs))

    def is_fsdp(self, module: nn.Module) -> bool:
        return isinstance(module, self.FSDP)


def low_dtypes(precision: Precision | None) -> list[torch.dtype]:
    if precision is None:
        return []
    fields = (precision.param_dtype, precision.reduce_dtype, precision.buffer_dtype)
    return [d for d in map(dtype_of, fields) if d is not None]
