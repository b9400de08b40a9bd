"""Every collective FSDP issues, as free functions on explicit inputs.

[Note: The collective seam]
This module is the only place that calls ``torch.distributed`` collectives.
Functions are looked up on ``torch.distributed`` at call time, so the harness's
patches and recorders (``harness.collectives``) see every call, and each call
carries a profiler label. Torch 2.13 names the single-tensor collectives
``all_gather_single`` / ``reduce_scatter_single``; torch 2.11 has only
``all_gather_into_tensor`` / ``reduce_scatter_tensor``: the newest name present
is used.

[Note: Objects as bytes]
Optimizer state dicts exchange Python objects (state keys, tensor metadata,
rank 0's dict skeleton). ``broadcast_object_list`` / ``all_gather_object``
unpickle through ``tensor.numpy()``, which fails where numpy is absent, and
they bypass this seam. Objects are therefore pickled here into a ``uint8``
tensor on the caller's device and sent with the tensor collectives below (a
size first, then the padded bytes).
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
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


def reduce_scatter(output: Tensor, input: Tensor, group: Any, op: Any = dist.ReduceOp.SUM) -> None:
    """Reduces ``input`` over ranks with ``op`` (a sum unless told); rank r
    receives chunk r in ``output``."""
    with profiler_label("FSDP::reduce_scatter"):
        _newest("reduce_scatter_single", "reduce_scatter_tensor")(output, input, op=op, group=group)


def all_reduce(tensor: Tensor, group: Any, op: Any = dist.ReduceOp.SUM) -> None:
    with profiler_label("FSDP::all_reduce"):
        dist.all_reduce(tensor, op=op, group=group)


def broadcast(tensor: Tensor, src: int, group: Any) -> None:
    with profiler_label("FSDP::broadcast"):
        dist.broadcast(tensor, src=src, group=group)


def broadcast_object(obj: Any, src: int, group: Any, device: torch.device) -> Any:
    """Rank ``src`` (of ``group``)'s ``obj`` on every rank of ``group``; the
    other ranks' ``obj`` is ignored. See [Note: Objects as bytes]."""
    global_src = group_ranks(group)[src]
    is_src = group.rank() == src
    payload = _to_bytes(obj, device) if is_src else torch.empty(0, dtype=torch.uint8, device=device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    with profiler_label("FSDP::broadcast_object"):
        broadcast(size, global_src, group)
        if not is_src:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        broadcast(payload, global_src, group)
    return obj if is_src else _from_bytes(payload)


def all_gather_object(obj: Any, group: Any, device: torch.device) -> list[Any]:
    """Every rank's ``obj``, in rank order. See [Note: Objects as bytes]."""
    payload = _to_bytes(obj, device)
    sizes = torch.empty(group.size(), dtype=torch.int64, device=device)
    with profiler_label("FSDP::all_gather_object"):
        all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64, device=device), group)
        longest = int(sizes.max().item())
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[: payload.numel()] = payload
        gathered = torch.empty(longest * group.size(), dtype=torch.uint8, device=device)
        all_gather(gathered, padded, group)
    starts = range(0, gathered.numel(), longest)
    return [_from_bytes(gathered[s : s + int(n)]) for s, n in zip(starts, sizes.tolist())]


def _to_bytes(obj: Any, device: torch.device) -> Tensor:
    data = bytearray(pickle.dumps(obj))
    return torch.frombuffer(data, dtype=torch.uint8).to(device, copy=True)


def _from_bytes(payload: Tensor) -> Any:
    # A copy: a view's storage is its base's whole storage.
    return pickle.loads(bytes(payload.cpu().clone().untyped_storage()))


def new_group(ranks: list[int], use_local_synchronization: bool = False) -> Any:
    return dist.new_group(ranks, use_local_synchronization=use_local_synchronization)


def group_ranks(group: Any) -> list[int]:
    return dist.get_process_group_ranks(group)


def group_device_type(group: Any) -> str | None:
    """The device type collectives of ``group`` run on, as torch reads it (its
    one backend's; ``cpu`` among several; ``None`` for a group without one)."""
    devices = list(getattr(group, "_device_types", None) or ())
    if not devices:
        return None
    if len(devices) > 1 and torch.device("cpu") in devices:
        return "cpu"
    return devices[0].type


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
