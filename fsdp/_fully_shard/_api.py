"""The user's configuration of ``fully_shard``: mixed precision and offloading.

Frozen dataclasses with torch's fields and defaults (``torch.distributed.fsdp``'s
``MixedPrecisionPolicy``, ``OffloadPolicy``, ``CPUOffloadPolicy``), so that a
policy written for torch's ``fully_shard`` works unchanged with ours.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Mixed precision at module granularity: parameters are all-gathered and
    computed with in ``param_dtype``, gradients reduced in ``reduce_dtype``, while
    the sharded parameters (what the optimizer steps) keep their own dtype.

    - ``param_dtype``: dtype of the unsharded parameters and of the all-gather;
      ``None`` keeps each parameter's dtype.
    - ``reduce_dtype``: dtype of the gradient reduction; ``None`` reduces in the
      gradient's dtype (``param_dtype`` when that is set). Without gradient sync
      (``set_requires_gradient_sync(False)``) gradients accumulate in it.
    - ``output_dtype``: floating-point forward outputs are cast to it; ``None``
      leaves them as computed.
    - ``cast_forward_inputs``: floating-point forward inputs are cast to
      ``param_dtype`` (when set).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: the sharded parameters, gradients and optimizer states stay
    on the mesh's device. The default of ``fully_shard``'s ``offload_policy``."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded parameters and gradients live on the CPU (the optimizer steps
    there): each all-gather copies the shards to the device first, each gradient
    reduction copies the reduced shard back.

    - ``pin_memory``: pin the CPU shards and gradients, so the copies can overlap
      computation. Ignored where the mesh's device is the CPU (nothing is copied).
    """

    pin_memory: bool = True
