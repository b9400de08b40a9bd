"""An FSDP2-only implementation, for ``--fsdp-impl tests.harness.example_fsdp2_impl``.

It is torch's ``fully_shard`` seen through the FSDP2 public API alone (no
``FullyShardedDataParallel``), as a foreign package offering only FSDP2 would be,
and it declares its seams in ``_fully_shard.SEAMS`` as such a package does
([Note: FSDP2 seams] in ``fsdptest.fsdp2``).
"""

from __future__ import annotations

from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
)

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
]
