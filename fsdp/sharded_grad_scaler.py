"""ShardedGradScaler: gradient scaling where each rank holds only a shard of the gradients."""

from __future__ import annotations

from torch.amp import GradScaler


class ShardedGradScaler(GradScaler):
    """Placeholder until the sharded scaler lands: behaves as ``GradScaler``."""
