"""ShardedGradScaler: loss scaling when every rank holds only a shard of the gradients.

[Note: Agreeing on inf/nan]
A plain GradScaler looks for inf/nan in the gradients it sees. With FSDP each
rank sees only its shard, so an overflow in rank 1's shard would make rank 1
skip the optimizer step while rank 0 steps: the replicas drift apart. Here
``unscale_`` sums the per-device "found inf" flags into one value, all-reduces
it over the process group (one collective per call on every rank, also on a
rank that holds no gradient at all, so the ranks never disagree on the number
of collectives) and writes it back, so every rank skips the step and backs off
the scale together. ``_unscale_grads_`` itself is local, with torch's
signature. Gradients may live on the CPU (parameter offloading), may be fp16
and may be sparse. The process group may be any object with torch's
``allreduce`` (``DummyProcessGroup`` in single-process tests).

[Note: Unscaling gradients on another device]
``GradScaler._unscale_grads_`` copies the scale and the found-inf flag to each
gradient device with ``non_blocking=True``. From an accelerator to the CPU that
copy is asynchronous, and the CPU kernel that unscales offloaded gradients runs
at once: it may read the scale before it arrives, and the copy, landing late,
overwrites the flag it set (an inf in a CPU gradient reported as none, seen on
two GPUs shared by two tests). Here each device's gradients are unscaled apart,
with the scale and the flag already copied there by a blocking copy.

[Note: The scaler's device]
``device`` defaults to ``"cuda"`` like torch's. On a machine without CUDA that
default means the CPU (this project's convention: "cuda" is "the test's
device"), where torch's scaler would disable itself with a warning.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.amp import GradScaler
from torch.amp.grad_scaler import OptState

from fsdp import _comm


class _OneDeviceParams:
    """The parameters of one gradient device, as ``_unscale_grads_`` reads an optimizer."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.param_groups = [{"params": params}]


def _params_by_grad_device(optimizer: torch.optim.Optimizer) -> dict[torch.device, list[Any]]:
    by_device: dict[torch.device, list[Any]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None:
                by_device.setdefault(param.grad.device, []).append(param)
    return by_device


def _resolve_device(device: str) -> str:
    if device == "cuda" and not torch.cuda.is_available():
        return "cpu"
    return device


class ShardedGradScaler(GradScaler):
    """``torch.amp.GradScaler`` whose inf/nan check spans every rank's shard."""

    process_group: Any

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: Any = dist.group.WORLD,
    ) -> None:
        super().__init__(
            _resolve_device(device),
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.process_group = process_group

    def scale(self, outputs: Any) -> Any:  # type: ignore[override]
        """Scales a tensor or (nested lists and tuples of) tensors, keeping each
        one's dtype (an fp16 loss stays fp16, as parameters under mixed
        precision compute in fp16)."""
        if not self._enabled:
            return outputs
        return self._scale_tree(outputs)

    def _scale_tree(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(value.device)
            assert self._scale is not None
            return (value * self._scale.to(value.device, non_blocking=True)).to(value.dtype)
        if isinstance(value, (list, tuple)):
            return type(value)(self._scale_tree(v) for v in value)
        if isinstance(value, Iterable):
            return map(self._scale_tree, value)
        raise ValueError("outputs must be a Tensor or an iterable of Tensors")

    def _unscale_grads_(  # type: ignore[override]
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool = True,
    ) -> dict[torch.device, torch.Tensor]:
        """Unscales this rank's gradients; returns the found-inf flag per device
        (at least one entry, on the flag's device, when there is no gradient).
        See [Note: Unscaling gradients on another device]."""
        per_device: dict[torch.device, torch.Tensor] = {}
        for device, params in _params_by_grad_device(optimizer).items():
            on_device = super()._unscale_grads_(
                _OneDeviceParams(params),  # type: ignore[arg-type]
                inv_scale.to(device),
                found_inf.to(device, copy=True),
                allow_fp16,
            )
            per_device.update(on_device)
        return per_device or {found_inf.device: found_inf}

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        assert self._scale is not None
        inv_scale = self._scale.double().reciprocal().float()
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=self._scale.device)
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, inv_scale, found_inf, True)
        state["stage"] = OptState.UNSCALED
        self._agree(state["found_inf_per_device"])

    def _agree(self, per_device: dict[torch.device, torch.Tensor]) -> None:
        """Every rank ends with the same, global count of ranks that found inf/nan."""
        flags = list(per_device.values())
        comm_device = self._comm_device(flags[0].device)
        total = torch.zeros((), device=comm_device)
        for flag in flags:
            total += flag.to(comm_device, torch.float32).sum()
        _comm.all_reduce(total, self.process_group)
        for flag in flags:
            flag.copy_(total.to(flag.device, flag.dtype))

    def _comm_device(self, default: torch.device) -> torch.device:
        group = self.process_group if self.process_group is not None else _comm.world()
        if isinstance(group, dist.ProcessGroup) and dist.get_backend(group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return default if not isinstance(group, dist.ProcessGroup) else torch.device("cpu")
