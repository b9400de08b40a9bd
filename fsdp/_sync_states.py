"""``sync_module_states``: every rank starts from the first rank's parameters and
buffers.

[Note: Which states a unit broadcasts]
As torch's FSDP does, a unit broadcasts, from the first rank of a group, every
buffer of its module's subtree that no unit broadcast before, then the
parameters it manages. Nested units are built first, so an inner unit's buffers
go with it, and an ignored module's buffers go with the unit above it (torch
does not leave them out). A broadcast buffer is marked on the tensor. A hybrid
unit broadcasts over its replicate group first, so that the first rank of every
shard group holds the source's values, then forgets the marks of its subtree
and broadcasts over its shard group, every buffer of the subtree again (torch
2.13's order). Torch before 2.13 broadcast over the shard group first and then
the parameters alone over the replicate group, which leaves the first rank of
each shard group's own values in it (the conformance search does not ask torch
2.11 that: ``HYBRID_SYNC_ORDER_BEFORE_TORCH_2_13``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fsdp import _comm
from fsdp._common import ProcessGroups
from fsdp._dtensor_extensions import local_of

_SYNCED = "_fsdp_module_state_synced"


def sync_module_states(
    module: nn.Module, params: list[nn.Parameter], groups: ProcessGroups, device: torch.device
) -> None:
    """See [Note: Which states a unit broadcasts]."""
    if groups.replicate is not None:
        _broadcast([*_unsynced_buffers(module), *params], groups.replicate, device)
        for buffer in module.buffers():
            setattr(buffer, _SYNCED, False)
    _broadcast([*_unsynced_buffers(module), *params], groups.shard, device)


def _unsynced_buffers(module: nn.Module) -> list[torch.Tensor]:
    found = []
    for buffer in module.buffers():
        if not getattr(buffer, _SYNCED, False):
            setattr(buffer, _SYNCED, True)
            found.append(buffer)
    return found


def _broadcast(states: list[torch.Tensor], group: Any, device: torch.device) -> None:
    src = _comm.group_ranks(group)[0]
    with torch.no_grad():  # a DTensor's local tensor (see [Note: Tensor-parallel parameters])
        tensors = [local_of(t.data) for t in states]
    if device.type != "cpu" and any(t.device.type == "cpu" for t in tensors):
        raise ValueError(
            "The module has CPU parameters or buffers when `sync_module_states=True`, which "
            "requires them to be on GPU. Please specify the `device_id` argument or move the "
            "module to GPU before passing it to FSDP."
        )
    with torch.no_grad():
        for tensor in tensors:
            on_device = tensor if tensor.device == device else tensor.to(device)
            _comm.broadcast(on_device, src=src, group=group)
            if on_device is not tensor:
                tensor.copy_(on_device)
