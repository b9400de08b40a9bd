"""Names, lifecycles and small helpers shared by every layer of the package.

[Note: Environment switches]
Three environment variables change behaviour, all read once when a
FullyShardedDataParallel instance is built (``EnvSwitches.read``), never deep
inside the runtime:

- ``FSDP_USE_FULL_PREC_IN_EVAL=1``: in ``eval()`` mode, compute, reduce and keep
  buffers in full precision even when mixed precision is configured.
- ``FSDP_SKIP_WRITEBACK_CHECK=1``: with ``use_orig_params=True``, do not check
  before each unshard whether the user replaced or resized an original
  parameter or its gradient (saves the check; changes are then not written back).
- ``FSDP_USE_UNSAFE_SETATTR=1``: set the original parameter names directly in
  the module's dicts, bypassing ``__setattr__`` overrides of its class (by
  default ``delattr`` and ``setattr`` go through them, as ``nn.Module`` checks do).
- ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (read through ``dist.get_debug_level()``,
  which ``dist.set_debug_level`` also sets): check the forward order across
  ranks (see [Note: Checking the forward order across ranks] in fsdp._exec_order).

torch's FSDP also reads two profiling switches, ``FSDP_USE_FAKE_ALL_GATHER=1``
and ``FSDP_USE_FAKE_REDUCE=1``, which skip its all-gathers or reductions (its
training is then wrong by design). This FSDP does not implement them: with
either set, it warns that its collectives run as usual.
"""

from __future__ import annotations

import contextlib
import enum
import os
import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torch.distributed import ProcessGroup

from fsdp.api import ShardingStrategy

FSDP_WRAPPED_MODULE = "_fsdp_wrapped_module"
FSDP_PREFIX = FSDP_WRAPPED_MODULE + "."
FLAT_PARAM = "_flat_param"
_CHECKPOINT_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")

_FSDP_USE_FULL_PREC_IN_EVAL = "FSDP_USE_FULL_PREC_IN_EVAL"
_FSDP_SKIP_WRITEBACK_CHECK = "FSDP_SKIP_WRITEBACK_CHECK"
_FSDP_USE_UNSAFE_SETATTR = "FSDP_USE_UNSAFE_SETATTR"
_UNIMPLEMENTED_SWITCHES = ("FSDP_USE_FAKE_ALL_GATHER", "FSDP_USE_FAKE_REDUCE")

# Strategies that keep the unsharded parameter from forward to backward (torch's name).
NO_RESHARD_AFTER_FORWARD_STRATEGIES = (
    ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy._HYBRID_SHARD_ZERO2,
)
HYBRID_SHARDING_STRATEGIES = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


class ProcessGroups(NamedTuple):
    """A unit's sharding group, and its replicate group under hybrid sharding."""

    shard: ProcessGroup
    replicate: ProcessGroup | None

    def as_argument(self) -> ProcessGroup | tuple[ProcessGroup, ProcessGroup]:
        """What children of an auto-wrap get as ``process_group``: the same groups."""
        return self.shard if self.replicate is None else (self.shard, self.replicate)


class EnvSwitches(NamedTuple):
    use_full_prec_in_eval: bool
    skip_writeback_check: bool
    use_unsafe_setattr: bool
    check_exec_order: bool

    @classmethod
    def read(cls) -> EnvSwitches:
        for name in _UNIMPLEMENTED_SWITCHES:
            if os.environ.get(name) == "1":
                warnings.warn(
                    f"{name}=1 is a profiling switch of torch's FSDP that this FSDP does "
                    "not implement: its collectives run as usual",
                    stacklevel=3,
                )
        return cls(
            os.environ.get(_FSDP_USE_FULL_PREC_IN_EVAL) == "1",
            os.environ.get(_FSDP_SKIP_WRITEBACK_CHECK) == "1",
            os.environ.get(_FSDP_USE_UNSAFE_SETATTR) == "1",
            dist.get_debug_level() == dist.DebugLevel.DETAIL,
        )


class TrainingState(enum.Enum):
    """Lifecycle of one FSDP unit."""

    IDLE = enum.auto()
    FORWARD_BACKWARD = enum.auto()
    SUMMON_FULL_PARAMS = enum.auto()

    __hash__ = object.__hash__  # singletons: identity hashing, in C (checked on every hook)


class HandleShardingStrategy(enum.Enum):
    """A unit's sharding strategy (torch's name; ``FULL_SHARD``'s and
    ``HYBRID_SHARD``'s units shard alike, the hybrid ones over a shard group)."""

    FULL_SHARD = enum.auto()
    SHARD_GRAD_OP = enum.auto()
    NO_SHARD = enum.auto()
    HYBRID_SHARD = enum.auto()
    _HYBRID_SHARD_ZERO2 = enum.auto()

    def is_sharded(self) -> bool:
        return self is not HandleShardingStrategy.NO_SHARD


class HandleTrainingState(enum.Enum):
    """Lifecycle of one flat parameter within an iteration."""

    IDLE = enum.auto()
    FORWARD = enum.auto()
    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()
    SUMMON_FULL_PARAMS = enum.auto()

    def in_backward(self) -> bool:
        return self in (HandleTrainingState.BACKWARD_PRE, HandleTrainingState.BACKWARD_POST)


def clean_tensor_name(tensor_name: str) -> str:
    """Strips the wrapper prefixes (``_fsdp_wrapped_module.`` and activation
    checkpointing's) from a parameter or buffer name."""
    for prefix in (FSDP_PREFIX, *_CHECKPOINT_PREFIXES):
        tensor_name = tensor_name.replace(prefix, "")
    return tensor_name


def profiler_label(name: str) -> contextlib.AbstractContextManager[object]:
    """``record_function(name)`` while a profiler records, else nothing: entering
    a ``record_function`` costs microseconds on every hook of every unit."""
    if torch._C._autograd._profiler_enabled():
        return record_function(name)
    return _NO_LABEL


_NO_LABEL = contextlib.nullcontext()  # reusable: it holds no state
