"""A parameter group's collectives: one all-gather of every parameter through
one flat buffer, and one reduce-scatter of every gradient (plus an all-reduce
across replicas for HSDP).

[Note: The all-gather buffer]
Each rank copies its padded shards, one after the other and cast to the
all-gather dtype in the same copy, into its slot of one flat buffer of
``world * sum(padded shard numels)`` elements, and all-gathers into that
buffer (``fsdp._comm.all_gather``). The buffer is then rank-major: rank r's
shards of every parameter, then rank r+1's. Copying out (one
``split_with_sizes_copy`` over the ``(world, -1)`` view) puts each parameter's
chunks, in rank order, into its own unsharded data. Parameters of several
all-gather dtypes share a ``uint8`` buffer (each shard copied in as bytes, after
its cast: a slot need not be aligned to its dtype). The copy-in and the collective run
on the unshard stream (fsdp._streams), the copy-out on the current stream
after an event. Writing the unsharded data keeps its version counter: autograd
saved the unsharded parameters in forward, and backward's all-gather refills
the same memory with the same values. On a one-rank shard group there is
nothing to gather and no buffer: the shards are copied (and cast) straight
into the unsharded data on the current stream.

[Note: The gradient reduction]
Every gradient of the group is padded in dimension 0 to a multiple of the
shard size and chunked: ``torch._chunk_cat`` writes, per rank, every
gradient's chunk for that rank into one flat buffer of the reduce dtype (a
gradient sharded in dimension ``d > 0`` is first rearranged so its chunks lie
in dimension 0). One reduce-scatter gives each rank its chunks; for HSDP one
all-reduce over the replicate group follows (or, without it, the result is
kept and added to the next one). The reduced shard is cast to the parameters'
dtype and viewed out into each parameter's gradient (on the CPU with
offloading). The division by the data-parallel size is torch's (see
``Division.of``): for fp32 and bf16 the collectives average (``AVG``; a
custom factor ``f`` is ``PREMUL_SUM(1/f)`` for the reduce-scatter and a sum for
the all-reduce), for other dtypes the sum is divided in two steps before and
after (fsdp._comm.gradient_divide_factors), so fp16 neither overflows nor
underflows. Where the backend has no ``PREMUL_SUM`` (gloo, on the CPU) a
custom factor divides the sum after the reduction instead. The ``PREMUL_SUM``
op is built by ``torch.distributed._make_nccl_premul_sum``, as torch 2.11's
FSDP2 builds it: ``ReduceOp.PREMUL_SUM`` is the op's type, which only torch
2.13 makes callable (on 2.11 calling it raised a ``TypeError`` on NCCL ranks,
docs/runs/gpu-runs.md run 82).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from fsdp import _comm
from fsdp._fully_shard._param import ShardedParam
from fsdp._streams import CommStreams

__all__ = [
    "Comms",
    "Division",
    "GatherResult",
    "ReduceGroups",
    "ReduceSpec",
    "all_gather",
    "copy_out",
    "reduce_grads",
]


class GatherResult(NamedTuple):
    """An all-gather issued and not yet copied out."""

    output: Tensor | None  # (world * per_rank,) in the buffer dtype; None on one rank
    split_sizes: list[int]  # each input's per-rank part (one per parameter but an
    # extension's), in buffer elements
    world: int
    event: torch.cuda.Event | None  # after the collective, on the unshard stream


class Comms:
    """How a group's collectives allocate their buffers and run: through
    fsdp._comm into ``torch.empty`` buffers by default; with a user's all-gather
    or reduce-scatter object (``set_custom_all_gather`` /
    ``set_custom_reduce_scatter``: its ``allocate`` and its call, torch's
    ``AllGather`` / ``ReduceScatter`` interface), or with buffers from the process
    group's own allocator where its backend has one
    (``set_allocate_memory_from_process_group_for_comm``)."""

    all_gather: Any | None
    reduce_scatter: Any | None
    from_group: bool

    def __init__(self) -> None:
        self.all_gather = self.reduce_scatter = None
        self.from_group = False

    def allocate(
        self,
        custom: Any | None,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        group: ProcessGroup,
    ) -> Tensor:
        if custom is not None:
            allocated: Tensor = custom.allocate((numel,), dtype=dtype, device=device)
            return allocated
        if self.from_group and device.type != "cpu":
            backend = group._get_backend(device)
            if backend.supports_tensor_alloc(device):
                return backend.allocate_tensor(numel, dtype=dtype, device=device)
        return torch.empty(numel, dtype=dtype, device=device)

    def gather(self, output: Tensor, send: Tensor, group: ProcessGroup) -> None:
        if self.all_gather is not None:
            self.all_gather(output_tensor=output, input_tensor=send, group=group, async_op=False)
        else:
            _comm.all_gather(output, send, group)

    def scatter(self, output: Tensor, send: Tensor, group: ProcessGroup, op: Any) -> None:
        if self.reduce_scatter is not None:
            self.reduce_scatter(
                output_tensor=output, input_tensor=send, group=group, op=op, async_op=False
            )
        else:
            _comm.reduce_scatter(output, send, group, op)


def _buffer_dtype(inputs: Sequence[tuple[Tensor, torch.dtype]]) -> torch.dtype:
    dtypes = {dtype for _, dtype in inputs}
    return dtypes.pop() if len(dtypes) == 1 else torch.uint8


@torch.no_grad()
def all_gather(
    params: Sequence[ShardedParam], group: ProcessGroup, streams: CommStreams, comms: Comms
) -> GatherResult:
    """Copies in and all-gathers the group's shards (see [Note: The all-gather buffer])."""
    world, rank = group.size(), group.rank()
    if world == 1:  # nothing to gather: the copy-out copies (and casts) the shards
        return GatherResult(None, [], 1, None)
    with streams.on_unshard():
        per_param = [p.gather_inputs() for p in params]
        inputs = [pair for pairs in per_param for pair in pairs]
        dtype = _buffer_dtype(inputs)
        sizes = [_in_buffer_units(t.numel(), d, dtype) for t, d in inputs]
        per_rank = sum(sizes)
        output = comms.allocate(comms.all_gather, world * per_rank, dtype, params[0].device, group)
        send = output.narrow(0, per_rank * rank, per_rank)
        sources = [t for t, _ in inputs]
        if dtype is torch.uint8:  # each source as bytes: a slot may not be aligned to its dtype
            sources = [(t if t.dtype == d else t.to(d)).view(torch.uint8) for t, d in inputs]
        torch._foreach_copy_(list(torch.split(send, sizes)), sources)
        comms.gather(output, send, group)
        event = streams.record_unshard()
    return GatherResult(output, sizes, world, event)


def _in_buffer_units(numel: int, dtype: torch.dtype, buffer: torch.dtype) -> int:
    return numel * dtype.itemsize if buffer is torch.uint8 else numel


@torch.no_grad()
def copy_out(result: GatherResult, params: Sequence[ShardedParam], streams: CommStreams) -> None:
    """Fills each parameter's unsharded data from the gathered buffer."""
    buffer = result.output
    if buffer is None:
        _copy_one_rank(params)
        return
    streams.compute_waits(result.event)
    world = result.world
    outs: list[Tensor] = []
    regroup: list[tuple[ShardedParam, Tensor]] = []
    extended: list[ShardedParam] = []
    sizes = iter(result.split_sizes)
    for param in params:
        if param.extended:
            assert param.extension is not None
            for out in param.extension.alloc_outputs(world, param.device):
                next(sizes)
                out = out.view(world, -1)
                outs.append(out.view(torch.uint8) if buffer.dtype is torch.uint8 else out)
            extended.append(param)
            continue
        size = next(sizes)
        numel = (
            size * world
            if buffer.dtype is not torch.uint8
            else size * world // param.gather_dtype.itemsize
        )
        data = param.alloc_unsharded(numel)
        target = data if param.shard_dim == 0 else torch.empty_like(data)
        if param.shard_dim != 0:
            regroup.append((param, target))
        out = target.view(world, -1)
        outs.append(out.view(torch.uint8) if buffer.dtype is torch.uint8 else out)
    with _keeping_versions(params):
        torch.split_with_sizes_copy(buffer.view(world, -1), result.split_sizes, dim=1, out=outs)
        for param, gathered in regroup:
            _cat_along_shard_dim(param, gathered, world)
    for param in extended:
        param.finish_extension()
    # the unshard stream may reuse the buffer's memory once the copy-out ran
    streams.unshard_waits_for_compute()


def _keeping_versions(params: Sequence[ShardedParam]) -> Any:
    """Writes into the unsharded data that leave its version counter as it was
    (tensors made under inference_mode have none)."""
    unsharded = [p.unsharded_data for p in params if p.unsharded_data is not None]
    unsharded += [t for p in params if p.extension is not None for t in p.extension.outputs]
    return torch.autograd._unsafe_preserve_version_counter(
        tuple(t for t in unsharded if not t.is_inference())
    )


def _copy_one_rank(params: Sequence[ShardedParam]) -> None:
    """One rank: each shard is the whole (padded) parameter, copied and cast on
    the current stream."""
    per_param = [p.gather_inputs() for p in params]
    datas: list[Tensor] = []
    for param in params:
        if param.extended:
            assert param.extension is not None
            datas += param.extension.alloc_outputs(1, param.device)
        else:
            datas.append(param.alloc_unsharded(param.sharded_data.numel()))
    with _keeping_versions(params):
        torch._foreach_copy_(datas, [t for pairs in per_param for t, _ in pairs])
    for param in params:
        if param.extended:
            param.finish_extension()


def _cat_along_shard_dim(param: ShardedParam, gathered: Tensor, world: int) -> None:
    """Rank-major chunks (dimension 0) rearranged along the shard dimension."""
    padded = list(param.padded_sharded_size)
    stacked = [padded[0] * world, *padded[1:]]
    chunks = torch.chunk(gathered.view(stacked), world, dim=0)
    assert param.unsharded_data is not None
    target = list(padded)
    target[param.shard_dim] *= world
    torch.cat(chunks, dim=param.shard_dim, out=param.unsharded_data.view(target))


class Division(NamedTuple):
    """How the reduction divides by the data-parallel size (see [Note: The
    gradient reduction]): ``pre`` before, ``post`` after, the two ops."""

    pre: float | None
    post: float | None
    reduce_scatter_op: object
    all_reduce_op: object

    @classmethod
    def of(
        cls,
        reduce_dtype: torch.dtype,
        data_parallel: int,
        shard_size: int,
        factor: float | None,
        force_sum: bool,
        device_type: str,
    ) -> Division:
        """``force_sum``: ``set_force_sum_reduction_for_comms``; ``device_type``: where
        the gradients are reduced (gloo, the CPU's backend, has no ``PREMUL_SUM``)."""
        summed = dist.ReduceOp.SUM
        exact = reduce_dtype in (torch.float32, torch.bfloat16)
        sum_only = force_sum or (factor is not None and device_type == "cpu")
        if exact and not sum_only:
            if factor is None:
                op = dist.ReduceOp.SUM if data_parallel == 1 else dist.ReduceOp.AVG
                return cls(None, None, op, op)
            if factor == shard_size:
                return cls(None, None, dist.ReduceOp.AVG, summed)
            return cls(None, None, dist._make_nccl_premul_sum(1 / factor), summed)
        total = float(data_parallel) if factor is None else factor
        if exact:
            return cls(None, total, summed, summed)
        pre, post = _comm.gradient_divide_factors(total)  # type: ignore[arg-type]
        return cls(pre, post, summed, summed)


class ReduceGroups(NamedTuple):
    """Where a group's gradients are reduced."""

    shard: ProcessGroup
    shard_size: int
    replicate: ProcessGroup | None  # HSDP
    replicate_size: int


def _div(tensor: Tensor, factor: float | None) -> None:
    if factor is not None and factor != 1:
        tensor.div_(factor)


def _padded(size: torch.Size, world: int) -> torch.Size:
    return torch.Size([math.ceil(size[0] / world) * world, *size[1:]])


def _dim0_chunks(params: Sequence[ShardedParam], grads: list[Tensor], world: int) -> list[Tensor]:
    """Gradients sharded along ``d > 0`` rearranged so their chunks lie in dimension 0."""
    if world == 1:
        return list(grads)  # a list of its own: the caller empties ``grads``
    return [
        g if p.shard_dim == 0 else torch.cat(torch.chunk(g, world, dim=p.shard_dim), dim=0)
        for p, g in zip(params, grads)
    ]


class ReduceSpec(NamedTuple):
    """How one group's gradients are reduced this backward."""

    groups: ReduceGroups
    reduce_dtype: torch.dtype | None  # None: the gradients' own dtype
    orig_dtype: torch.dtype | None  # the sharded gradients' dtype
    divide_factor: float | None  # set_gradient_divide_factor
    all_reduce: bool  # HSDP: all-reduce across replicas now (else keep the partial sum)
    force_sum: bool  # set_force_sum_reduction_for_comms
    hook: Callable[[Tensor], None] | None  # set_all_reduce_hook: on the reduced output
    hook_stream: torch.cuda.Stream | None  # the stream the hook runs on (else the reduce stream)
    comms: Comms


@torch.no_grad()
def reduce_grads(
    params: Sequence[ShardedParam],
    grads: list[Tensor],
    spec: ReduceSpec,
    streams: CommStreams,
    partial: Tensor | None,
) -> Tensor | None:
    """Reduces ``grads`` (consumed: the list is emptied) into the sharded
    gradients of ``params`` (see [Note: The gradient reduction]). Returns the
    HSDP partial sum to keep when the all-reduce is left for later, else None."""
    dtypes = {g.dtype for g in grads}
    if len(dtypes) != 1:
        raise AssertionError(f"FSDP reduce-scatter expects uniform gradient dtype but got {dtypes}")
    groups, world = spec.groups, spec.groups.shard_size
    reduce_dtype = spec.reduce_dtype or grads[0].dtype
    division = Division.of(
        reduce_dtype,
        world * groups.replicate_size,
        world,
        spec.divide_factor,
        spec.force_sum,
        params[0].device.type,
    )
    send, padded = _chunked_copy(params, grads, reduce_dtype, spec)
    with streams.on_reduce(send):
        out = _reduce_scatter(send, world, groups, division, spec)
        if groups.replicate is not None:
            if not spec.all_reduce:
                return out if partial is None else partial.add_(out)
            if partial is not None:
                out += partial
            _comm.all_reduce(out, groups.replicate, division.all_reduce_op)
        if spec.hook is not None:
            _run_hook(spec.hook, out, spec.hook_stream)
        _div(out, division.post)
        if spec.orig_dtype is not None and out.dtype != spec.orig_dtype:
            out = out.to(spec.orig_dtype)
        _view_out(params, out, padded, world)
    return None


def _run_hook(
    hook: Callable[[Tensor], None], out: Tensor, stream: torch.cuda.Stream | None
) -> None:
    """The user's all-reduce hook on the reduced output, on its own stream if it
    gave one (ordered after the reduction and before what follows it), through
    the device's module as torch's does: on the CPU ``torch.cpu``'s streams,
    whose current stream is the given one while the hook runs."""
    if stream is None:
        hook(out)
        return
    device_module = torch.get_device_module(out.device.type)
    reduce = device_module.current_stream(out.device)
    stream.wait_stream(reduce)
    with device_module.stream(stream):
        hook(out)
    reduce.wait_stream(stream)


def _chunked_copy(
    params: Sequence[ShardedParam], grads: list[Tensor], dtype: torch.dtype, spec: ReduceSpec
) -> tuple[Tensor, list[torch.Size]]:
    """The reduce-scatter's input (each rank's chunks of every gradient, padded)
    and the gradients' padded sizes; ``grads`` is emptied, freeing the gradients."""
    world = spec.groups.shard_size
    chunked = _dim0_chunks(params, grads, world)
    grads.clear()
    padded = [_padded(g.size(), world) for g in chunked]
    numel = sum(s.numel() for s in padded)
    comms = spec.comms
    send = comms.allocate(comms.reduce_scatter, numel, dtype, params[0].device, spec.groups.shard)
    torch._chunk_cat(chunked, dim=0, num_chunks=world, out=send.view(world, -1))
    return send, padded


def _reduce_scatter(
    send: Tensor, world: int, groups: ReduceGroups, division: Division, spec: ReduceSpec
) -> Tensor:
    """The reduced shard. On one rank the input is the output: the sharded
    gradients become views of it, without a copy (a user's reduce-scatter, whose
    ``allocate`` owns the output, still gets its own buffer)."""
    comms, factor = spec.comms, spec.divide_factor
    _div(send, division.pre)
    if world > 1:
        out = comms.allocate(
            comms.reduce_scatter, send.numel() // world, send.dtype, send.device, groups.shard
        )
        comms.scatter(out, send, groups.shard, division.reduce_scatter_op)
        return out
    if factor is not None and division.pre is None and division.post is None:
        send.div_(factor)  # a one-rank PREMUL_SUM(1 / factor)
    if comms.reduce_scatter is None:
        return send
    out = comms.allocate(comms.reduce_scatter, send.numel(), send.dtype, send.device, groups.shard)
    return out.copy_(send)


def _view_out(
    params: Sequence[ShardedParam], out: Tensor, padded: list[torch.Size], world: int
) -> None:
    offset = 0
    for param, size in zip(params, padded):
        shard = torch.as_strided(out, param.sharded_size, param.sharded_stride, offset)
        if param.offload:
            shard = _offloaded(param, shard)
        param.set_sharded_grad(shard)
        offset += size.numel() // world


def _offloaded(param: ShardedParam, shard: Tensor) -> Tensor:
    """The gradient shard copied to the CPU: without waiting where nothing on the
    CPU reads it before the end of backward (which waits for the copies)."""
    hooks = getattr(param.sharded_param, "_post_accumulate_grad_hooks", None)
    non_blocking = param.pin_memory and param.sharded_param.grad is None and not hooks
    return shard.to(torch.device("cpu"), non_blocking=non_blocking)
