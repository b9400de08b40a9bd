"""Every collective FSDP issues, as free functions on explicit inputs.

[Note: The collective seam]
This module is the only place that calls ``torch.distributed`` collectives.
Functions are looked up on ``torch.distributed`` at call time, so the harness's
patches and recorders (``harness.collectives``) see every call, and each call
carries a profiler label. Torch 2.13 names the single-tensor collectives
``all_gather_single`` / ``reduce_scatter_single``; torch 2.11 has only
``all_gather_into_tensor`` / ``reduce_scatter_tensor``: the newest name present
is used.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor

from fsdp._common import profiler_label


def _newest(*names: str) -> Any:
    for name in names:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    raise RuntimeError(f"torch.distributed has none of {names}")


def all_gather(output: Tensor, input: Tensor, group: Any) -> None:
    """Gathers every rank's ``input`` into ``output`` (rank order)."""
    with profiler_label("FSDP::all_gather"):
        _newest("all_gather_single", "all_gather_into_tensor")(output, input, group=group)


def reduce_scatter(output: Tensor, input: Tensor, group: Any) -> None:
    """Sums ``input`` over ranks; rank r receives chunk r in ``output``."""
    with profiler_label("FSDP::reduce_scatter"):
        _newest("reduce_scatter_single", "reduce_scatter_tensor")(
            output, input, op=dist.ReduceOp.SUM, group=group
        )


def all_reduce(tensor: Tensor, group: Any, op: Any = dist.ReduceOp.SUM) -> None:
    with profiler_label("FSDP::all_reduce"):
        dist.all_reduce(tensor, op=op, group=group)


def broadcast(tensor: Tensor, src: int, group: Any) -> None:
    with profiler_label("FSDP::broadcast"):
        dist.broadcast(tensor, src=src, group=group)


def new_group(ranks: list[int]) -> Any:
    return dist.new_group(ranks)


def group_ranks(group: Any) -> list[int]:
    return dist.get_process_group_ranks(group)


def world() -> Any:
    return dist.distributed_c10d._get_default_group()


def gradient_divide_factors(world_size: int) -> tuple[float, float]:
    """(pre, post) with pre * post == world_size: dividing part before the
    reduction keeps fp16 sums from overflowing, part after keeps small
    gradients from underflowing."""
    pre = 1
    while world_size % pre == 0 and world_size / pre > pre:
        pre *= 2
    return float(pre), world_size / pre
