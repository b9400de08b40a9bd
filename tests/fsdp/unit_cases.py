"""One FSDP unit (``FlatParamHandle``) built in this process on the fake process
group of tests/fsdp/conftest.py."""

from __future__ import annotations

import torch
from torch import nn

from fsdp._common import HandleShardingStrategy
from fsdp._flat_param import FlatParamHandle
from fsdp._streams import CommStreams


def make_unit(
    group: object,
    module: nn.Module,
    strategy: HandleShardingStrategy = HandleShardingStrategy.FULL_SHARD,
    use_orig_params: bool = True,
) -> FlatParamHandle:
    """A unit of ``module``'s parameters, sharded and lazily initialised."""
    unit = FlatParamHandle(
        list(module.parameters()),
        module,
        torch.device("cpu"),
        strategy,
        offload_params=False,
        mp_param_dtype=None,
        mp_reduce_dtype=None,
        keep_low_precision_grads=False,
        process_group=group,
        use_orig_params=use_orig_params,
    )
    unit.shard_in_place()
    unit.lazy_init(CommStreams(torch.device("cpu"), limit_all_gathers=False))
    return unit
