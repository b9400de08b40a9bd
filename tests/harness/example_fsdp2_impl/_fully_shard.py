"""The seams of the example FSDP2-only implementation: torch's parts (its FSDP2 is
what this example runs), declared as a foreign implementation declares its own."""

from __future__ import annotations

import torch.distributed as dist

_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group"
_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
_SCATTER = (
    "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
)

SEAMS: dict[str, str] = {
    "all_gather": f"torch.distributed.{_GATHER}",
    "reduce_scatter": f"torch.distributed.{_SCATTER}",
    "all_reduce": "torch.distributed.all_reduce",
    "unshard": f"{_GROUP}.FSDPParamGroup.unshard",
    "reshard": f"{_GROUP}.FSDPParamGroup.reshard",
    "post_backward": f"{_GROUP}.FSDPParamGroup.post_backward",
}
"""No ``register_post_backward_hook_backward``: a test patching it skips, naming it."""
