"""Fully Sharded Data Parallel, written on torch.distributed collectives.

The public names mirror ``torch.distributed.fsdp`` so that switching is a
one-line import change.
"""

from fsdp.api import (
    BackwardPrefetch,
    CPUOffload,
    FullStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FullStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictType",
]
