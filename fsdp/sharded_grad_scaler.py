"""ShardedGradScaler: loss scaling when every rank holds only a shard of the gradients.

[Note: Agreeing on inf/nan]
A plain GradScaler looks for inf/nan in the gradients it sees. With FSDP each
rank sees only its shard, so an overflow in rank 1's shard would make rank 1
skip the optimizer step while rank 0 steps: the replicas drift apart. Here the
per-device "found inf" flags are summed into one value, all-reduced over the
process group (one collective per call on every rank, also on a rank that has
no gradient at all), and written back, so every rank skips the step and backs
off the scale together. Gradients may live on the CPU (parameter offloading)
and may be fp16 (low-precision gradients).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.amp import GradScaler

from fsdp import _comm


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class ShardedGradScaler(GradScaler):
    """``torch.amp.GradScaler`` whose inf/nan check spans every rank's shard."""

    process_group: Any

    def __init__(
        self,
        device: str | None = None,
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: Any = None,
    ) -> None:
        super().__init__(
            device or _default_device(),
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.process_group = process_group

    def scale(self, outputs: Any) -> Any:  # type: ignore[override]
        """Scales like GradScaler, keeping each output's dtype (an fp16 loss
        stays fp16, as parameters under mixed precision compute in fp16)."""
        scaled = super().scale(outputs)
        if isinstance(outputs, torch.Tensor):
            return scaled.to(outputs.dtype)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(s.to(o.dtype) for s, o in zip(scaled, outputs))
        return scaled

    def _unscale_grads_(  # type: ignore[override]
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, True)
        if not per_device:
            per_device = {found_inf.device: found_inf}
        self._agree(per_device)
        return per_device

    def _agree(self, per_device: dict[torch.device, torch.Tensor]) -> None:
        """Every rank ends with the same, global count of ranks that found inf/nan."""
        comm_device = self._comm_device()
        total = torch.zeros((), device=comm_device)
        for flag in per_device.values():
            total += flag.to(comm_device, torch.float32)
        _comm.all_reduce(total, self.process_group)
        for flag in per_device.values():
            flag.copy_(total.to(flag.device, flag.dtype))

    def _comm_device(self) -> torch.device:
        group = self.process_group or _comm.world()
        if torch.distributed.get_backend(group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
