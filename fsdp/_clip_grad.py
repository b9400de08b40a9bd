"""``clip_grad_norm_`` over every gradient of one root's FSDP tree.

[Note: The total norm of sharded and replicated gradients]
A sharded unit's gradient lives in pieces, one per rank of its group: the
p-th powers of the local norms are summed over the group (the maximum for the
infinity norm). A ``NO_SHARD`` unit's gradient, and a parameter no unit
manages, is the same on every rank: it is counted once, locally, and must not
go through the sum, which would count it once per rank. Local norms are
computed in float32 whatever the gradients' dtype; the returned norm has the
gradients' promoted dtype (float16 when every gradient is float16). A rank
without any gradient warns and returns the norm in the default dtype, as
torch's FSDP does (it cannot know the other ranks' dtypes without another
collective). With ``use_orig_params=True`` the original parameters'
gradients are what is clipped (a user may have dropped some of them). When no
unit shards (every unit is ``NO_SHARD``, or no unit has parameters), every
gradient is replicated and ``torch.nn.utils.clip_grad_norm_`` does it all, as
in torch (without the warning about a rank without gradients).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import Tensor, nn

from fsdp import _comm
from fsdp._runtime import FSDPState


class GradPlacement(NamedTuple):
    """The parameters of a root's tree, by where their gradients live."""

    sharded: list[nn.Parameter]
    replicated: list[nn.Parameter]  # NO_SHARD units and parameters no unit manages

    @classmethod
    def of(cls, root: nn.Module, states: Iterable[FSDPState]) -> GradPlacement:
        sharded: dict[int, nn.Parameter] = {}
        replicated: dict[int, nn.Parameter] = {}
        managed: set[int] = set()
        for state in states:
            handle = state.handle
            if handle is None:
                continue
            params = handle.views.params if handle._use_orig_params else [handle.flat_param]
            target = sharded if handle.uses_sharded_strategy else replicated
            for param in params:
                target.setdefault(id(param), param)
            managed.update(id(p) for p in (handle.flat_param, *handle.views.params))
        for param in root.parameters():
            if id(param) not in managed:
                replicated.setdefault(id(param), param)
        return cls(list(sharded.values()), list(replicated.values()))

    def grads(self) -> list[Tensor]:
        return [p.grad for p in (*self.sharded, *self.replicated) if p.grad is not None]


def _local_norm(params: list[nn.Parameter], norm_type: float, device: torch.device) -> Tensor:
    # An empty gradient (a user's, of a parameter outside this rank's shard)
    # adds nothing: vector_norm refuses the infinity norm of an empty tensor, and
    # a refusal on one rank would leave the others waiting in the all-reduce.
    grads = [p.grad.detach() for p in params if p.grad is not None and p.grad.numel()]
    if not grads:
        return torch.zeros((), device=device)
    norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads]
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
    return total


def total_norm(placement: GradPlacement, norm_type: float, state: FSDPState) -> Tensor:
    """The norm of every gradient in ``placement``, the same on every rank."""
    device = state.compute_device
    sharded = _local_norm(placement.sharded, norm_type, device)
    replicated = _local_norm(placement.replicated, norm_type, device)
    if math.isinf(norm_type):
        total = torch.maximum(sharded, replicated)
        _comm.all_reduce(total, state.process_group, op=torch.distributed.ReduceOp.MAX)
        return total
    total = sharded**norm_type
    _comm.all_reduce(total, state.process_group)
    return (total + replicated**norm_type) ** (1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm(
    root: nn.Module, state: FSDPState, states: list[FSDPState], max_norm: float, norm_type: float
) -> Tensor:
    """Clips every gradient of the tree in place; returns the total norm."""
    handles = [s.handle for s in states if s.handle is not None]
    if not any(h.uses_sharded_strategy for h in handles):  # no unit shards: torch's shortcut
        return torch.nn.utils.clip_grad_norm_(root.parameters(), max_norm, norm_type)
    placement = GradPlacement.of(root, states)
    total = total_norm(placement, norm_type, state)
    if state.config.cpu_offload.offload_params:
        total = total.cpu()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = placement.grads()
    for grad in grads:
        grad.mul_(coef.to(grad.device, grad.dtype))
    if not grads:
        warnings.warn(
            f"Called FSDP.clip_grad_norm_() on rank {state.rank} with no gradients -- "
            f"returning the total norm in the default dtype {total.dtype}",
            stacklevel=3,
        )
        return total
    dtype = grads[0].dtype
    for grad in grads[1:]:
        dtype = torch.promote_types(dtype, grad.dtype)
    return total.to(dtype)
