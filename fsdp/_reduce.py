"""Gradient reduction: one unit's unsharded gradient in, its reduced shard out.

Free functions on explicit inputs beside the collective seam (fsdp._comm), as
FSDP2's ``foreach_reduce``: the unit (fsdp._flat_param) takes the gradient from
autograd, calls ``reduce_gradient`` on the reduce stream and keeps the result.

[Note: Communication hooks]
``register_comm_hook(state, hook)`` on the root gives every unit of its tree a
hook that replaces the gradient reduction (torch's semantics): sharded
strategies call ``hook(state, padded_unsharded_grad, output)``, where ``output``
is an empty shard the hook must fill; ``NO_SHARD`` calls ``hook(state, grad)``,
which reduces ``grad`` in place. The hook divides as it sees fit (the default
path divides by ``pre`` before and ``post`` after the collective). The gradient
reaches the hook in the reduce dtype, except for torch's two low-precision
hooks (``fp16_compress_hook``, ``bf16_compress_hook``), which cast it
themselves and, as in torch, get it in the dtype backward produced. Whatever
dtype the hook leaves, the result is cast to the gradient dtype the optimizer
expects. Hybrid strategies refuse hooks (their reduction has two steps).

[Note: A one-rank group sums nothing]
A ``NO_SHARD`` unit whose group is one rank (FSDP on one rank, or a user's
one-rank group) holds the whole gradient already: an all-reduce over one rank
returns its input. Torch's FSDP still calls it; on NCCL each call costs about
0.1 ms of host time, for every unit and step, which is most of what one GPU
pays for FSDP's reduction of a many-unit model (docs/runs/benchmarks.md). It is
skipped; a communication hook still gets the gradient (the hook is the user's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fsdp import _comm

__all__ = ["CommHook", "CommHookSpec", "ReducePlan", "reduce_gradient"]

CommHook = Callable[..., None]

# torch's low-precision hooks (see [Note: Communication hooks]), known by name:
# this package does not import torch's hook module.
_LOW_PRECISION_HOOKS = frozenset(
    ("torch.distributed.algorithms._comm_hooks.default_hooks", name)
    for name in ("fp16_compress_hook", "bf16_compress_hook")
)


class CommHookSpec(NamedTuple):
    """A registered communication hook and the state passed to each call."""

    hook: CommHook
    state: object

    @property
    def casts_itself(self) -> bool:
        """torch's low-precision hooks get the gradient in backward's dtype."""
        key = (getattr(self.hook, "__module__", None), getattr(self.hook, "__qualname__", None))
        return key in _LOW_PRECISION_HOOKS


class ReducePlan(NamedTuple):
    """How one unit reduces, fixed at construction: the groups, the sizes and
    the divide factors (``_comm.gradient_divide_factors``)."""

    sharded: bool
    padded_numel: int
    shard_numel: int
    group: Any
    replicate_group: Any | None
    pre: float
    post: float

    @classmethod
    def of(
        cls, sharded: bool, padded_numel: int, shard_numel: int, group: Any, replicate: Any | None
    ) -> ReducePlan:
        replicas = replicate.size() if replicate is not None else 1
        pre, post = _comm.gradient_divide_factors(group.size() * replicas)
        return cls(sharded, padded_numel, shard_numel, group, replicate, pre, post)


def reduce_gradient(
    grad: Tensor, reduce_dtype: torch.dtype, plan: ReducePlan, hook: CommHookSpec | None
) -> Tensor:
    """Averages ``grad`` over the data-parallel ranks (or hands it to ``hook``);
    returns this rank's reduced shard (``NO_SHARD``: the whole gradient)."""
    if grad.dtype != reduce_dtype and (hook is None or not hook.casts_itself):
        grad = grad.to(reduce_dtype)
    if hook is not None:
        return _hook_reduce(grad, plan, hook)
    if plan.pre > 1:
        grad.div_(plan.pre)
    reduced = _sum(grad, plan)
    if plan.post > 1:
        reduced.div_(plan.post)
    return reduced


def _sum(grad: Tensor, plan: ReducePlan) -> Tensor:
    """Sums the gradient over the shard group (reduce-scatter, or all-reduce
    for ``NO_SHARD``), then over the replicate group of hybrid sharding. A
    unit whose shard group is one rank holds the whole gradient: only the
    replicas sum it, if any (see [Note: A one-rank group sums nothing])."""
    if plan.sharded:
        padded, reduced = _reduce_scatter_tensors(grad, plan)
        _comm.reduce_scatter(reduced, padded, plan.group)
    else:
        reduced = grad
        if plan.group.size() > 1:
            _comm.all_reduce(reduced, plan.group)
    if plan.replicate_group is not None:
        _comm.all_reduce(reduced, plan.replicate_group)
    return reduced


def _hook_reduce(grad: Tensor, plan: ReducePlan, hook: CommHookSpec) -> Tensor:
    """See [Note: Communication hooks]."""
    if not plan.sharded:
        hook.hook(hook.state, grad)
        return grad
    padded, output = _reduce_scatter_tensors(grad, plan)
    hook.hook(hook.state, padded, output)
    return output


def _reduce_scatter_tensors(grad: Tensor, plan: ReducePlan) -> tuple[Tensor, Tensor]:
    """The padded unsharded gradient and an empty shard for the result."""
    padded = grad
    if grad.numel() != plan.padded_numel:
        padded = torch.zeros(plan.padded_numel, dtype=grad.dtype, device=grad.device)
        padded[: grad.numel()].copy_(grad)
    return padded, torch.empty(plan.shard_numel, dtype=grad.dtype, device=grad.device)
