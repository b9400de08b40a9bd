"""FSDP2: ``fully_shard``, written on torch.distributed collectives and DTensor.

Each ``fully_shard(module)`` call shards the parameters it manages as DTensors
over a device mesh and gives them one parameter group (``ParamGroup``), which
all-gathers them in one collective before forward and backward and reduces
their gradients in one reduce-scatter. Layers, each importing only the ones
before it: ``_api`` (policies) -> ``_mesh`` -> ``_lifecycle`` -> ``_param``
(one parameter) -> ``_collectives`` -> ``_param_group`` -> ``_state`` (hooks,
tree) -> ``_module`` (``FSDPModule``) -> ``_apply`` (``fully_shard``).

``SEAMS`` names, by dotted path, what the test layer patches: the collectives
(``fsdp._comm``'s, looked up when called, so a patch takes effect), the group's
``unshard`` / ``reshard`` / ``post_backward``, and the backward of the autograd
function that runs the post-backward.
"""

from __future__ import annotations

from fsdp._fully_shard._api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from fsdp._fully_shard._apply import fully_shard
from fsdp._fully_shard._module import (
    FSDPModule,
    UnshardHandle,
    register_fsdp_forward_method,
    share_comm_ctx,
)

SEAMS: dict[str, str] = {
    "all_gather": "fsdp._comm.all_gather",
    "reduce_scatter": "fsdp._comm.reduce_scatter",
    "all_reduce": "fsdp._comm.all_reduce",
    "unshard": "fsdp._fully_shard._param_group.ParamGroup.unshard",
    "reshard": "fsdp._fully_shard._param_group.ParamGroup.reshard",
    "post_backward": "fsdp._fully_shard._param_group.ParamGroup.post_backward",
    "register_post_backward_hook_backward": (
        "fsdp._fully_shard._param_group.RegisterPostBackwardFunction.backward"
    ),
}

__all__ = [
    "SEAMS",
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
