"""Public configuration of FullyShardedDataParallel: enums and frozen dataclasses."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn.modules.batchnorm import _BatchNorm


class ShardingStrategy(enum.Enum):
    """How parameters, gradients and optimizer state are sharded.

    - ``FULL_SHARD``: parameters are sharded and all-gathered before forward and
      again before backward; gradients are reduce-scattered.
    - ``SHARD_GRAD_OP``: like ``FULL_SHARD`` but the unsharded parameters are
      kept from forward until the end of backward (no second all-gather).
    - ``NO_SHARD``: parameters are replicated; gradients are all-reduced (DDP).
    - ``HYBRID_SHARD``: ``FULL_SHARD`` inside a shard group, replicated across
      groups; gradients are reduce-scattered, then all-reduced across groups.
    - ``_HYBRID_SHARD_ZERO2``: ``SHARD_GRAD_OP`` inside a shard group, replicated
      across groups.
    """

    FULL_SHARD = enum.auto()
    SHARD_GRAD_OP = enum.auto()
    NO_SHARD = enum.auto()
    HYBRID_SHARD = enum.auto()
    _HYBRID_SHARD_ZERO2 = enum.auto()


class BackwardPrefetch(enum.Enum):
    """When the next all-gather of the backward pass is issued.

    - ``BACKWARD_PRE``: before the current unit's gradient computation.
    - ``BACKWARD_POST``: after the current unit's gradient computation.
    ``None`` (the argument) means no backward prefetch.
    """

    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()


class StateDictType(enum.Enum):
    FULL_STATE_DICT = enum.auto()
    LOCAL_STATE_DICT = enum.auto()
    SHARDED_STATE_DICT = enum.auto()


@dataclass(frozen=True)
class CPUOffload:
    """``offload_params=True`` keeps sharded parameters and their gradients on the
    CPU between uses; the optimizer steps on the CPU."""

    offload_params: bool = False


@dataclass(frozen=True)
class MixedPrecision:
    """Low-precision dtypes for parameters, gradient reduction and buffers.

    ``None`` for a dtype means "keep the full-precision dtype" for that role.
    ``reduce_dtype=None`` reduces gradients in ``param_dtype`` when that is set.
    ``keep_low_precision_grads`` leaves gradients in ``param_dtype`` after
    backward instead of upcasting them. ``cast_forward_inputs`` casts floating
    point inputs of every FSDP unit to its ``param_dtype``;
    ``cast_root_forward_inputs`` does so for the root unit only. Modules of the
    classes in ``_module_classes_to_ignore`` are wrapped as separate units
    without mixed precision when an auto-wrap policy is given.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[type[torch.nn.Module]] = (_BatchNorm,)


@dataclass(frozen=True)
class StateDictConfig:
    """How ``state_dict()`` / ``load_state_dict()`` treat this unit's tensors:
    ``offload_to_cpu`` returns CPU tensors."""

    offload_to_cpu: bool = False


@dataclass(frozen=True)
class FullStateDictConfig(StateDictConfig):
    """``rank0_only`` returns the state dict on rank 0 only (other ranks get
    an empty dict)."""

    rank0_only: bool = False


@dataclass(frozen=True)
class LocalStateDictConfig(StateDictConfig):
    pass


@dataclass(frozen=True)
class ShardedStateDictConfig(StateDictConfig):
    """``_use_dtensor`` is torch's private switch between ``DTensor`` and
    ``ShardedTensor`` values; FSDP sets it when the unit has a device mesh (see
    [Note: _use_dtensor follows the device mesh] in fsdp._state_dict.settings)."""

    _use_dtensor: bool = False


@dataclass(frozen=True)
class OptimStateDictConfig:
    """How optimizer state dicts treat tensors: ``offload_to_cpu`` (default True)."""

    offload_to_cpu: bool = True


@dataclass(frozen=True)
class FullOptimStateDictConfig(OptimStateDictConfig):
    rank0_only: bool = False


@dataclass(frozen=True)
class LocalOptimStateDictConfig(OptimStateDictConfig):
    offload_to_cpu: bool = False


@dataclass(frozen=True)
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    _use_dtensor: bool = False


@dataclass(frozen=True)
class StateDictSettings:
    """A state-dict type with its configs. ``set_state_dict_type`` on a module
    without FSDP units returns one whose fields are all None (as torch's)."""

    state_dict_type: StateDictType | None
    state_dict_config: StateDictConfig | None
    optim_state_dict_config: OptimStateDictConfig | None


class OptimStateKeyType(enum.Enum):
    """How an optimizer state dict is keyed: by parameter name or by ID."""

    PARAM_NAME = enum.auto()
    PARAM_ID = enum.auto()


STATE_DICT_CONFIGS: dict[
    StateDictType, tuple[type[StateDictConfig], type[OptimStateDictConfig]]
] = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
}
