"""Sharded values of state dicts: a full tensor chunked by rows over a process
group (``ShardedTensor``) or a device mesh (``DTensor``), and the way back.

[Note: Rows chunked as torch.chunk]
Sharded model and optimizer state dicts split a full tensor on dim 0 as
``torch.chunk`` does over the ``n`` ranks of the unit's sharding group: rank ``r``
holds chunk ``r`` (a copy), and a rank beyond the number of chunks holds nothing.
Nothing is communicated: every rank builds the value alone.

- ``ShardedTensor``: its global metadata lists each non-empty chunk with its
  offsets, sizes and placement on the device type the group's collectives run on
  (``rank:<global rank>/cpu`` for gloo, ``rank:<global rank>/cuda:<global rank %
  device count>`` for NCCL, also where the values are on the CPU: offloaded
  parameters, or states); the local shard is placed on its tensor's device. A
  rank without a chunk has no local shard.
- ``DTensor`` (torch's ``_use_dtensor``, set whenever the unit has a device mesh):
  placements ``[Replicate()] * (ndim - 1) + [Shard(0)]`` on the unit's mesh, so a
  1-D mesh gives ``(Shard(0),)`` and a hybrid unit's 2-D mesh ``(Replicate(),
  Shard(0))``: replicated over dimension 0, sharded over dimension 1 (the
  sharding group). The local tensor is the chunk of the rank's coordinate on the
  last mesh dimension, empty (``[0, *rest]``) beyond the number of chunks, as
  DTensor's ``Shard(0)`` splits; the DTensor's shape and stride are the full
  tensor's. A 0-dim tensor cannot be chunked and is replicated.

[Note: Gathering chunked rows]
Loading gathers a value back through ``fsdp._comm`` (the harness's seam), not
through ``DTensor.full_tensor``/``ShardedTensor.gather``, whose collectives
bypass it (DTensor's functional collectives also keep the group referenced
after it is destroyed): each rank pads its chunk to ``ceil(rows / n)`` rows,
all-gathers over the group the value is chunked over (a ``ShardedTensor``'s
process group, the group of each ``Shard(0)`` dimension of a ``DTensor``'s
mesh, last dimension first), and the padding is cut off. Every rank must
gather the same values in the same order. A value of any wrapping, world size
or mesh loads this way, also into a unit of another kind.

``_create_chunk_sharded_tensor``, ``_create_chunk_dtensor`` and
``_all_gather_dtensor`` have the signatures of torch's ``fsdp._shard_utils``
(upstream tests call them).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import (
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
    TensorProperties,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import Shard as DShard

from fsdp import _comm

Piece = tuple[list[int], list[int]]  # offsets, sizes


def placement(global_rank: int, device_type: str) -> str:
    """A ``ShardedTensor`` placement on a device type: the CPU, or device ``global
    rank % device count`` (see [Note: Rows chunked as torch.chunk])."""
    if device_type == "cpu":
        return f"rank:{global_rank}/cpu"
    count = torch.get_device_module(device_type).device_count()
    return f"rank:{global_rank}/{device_type}:{global_rank % max(count, 1)}"


def sharded_tensor(
    local: Tensor | None,
    rank: int,
    pieces: Sequence[Piece],
    size: torch.Size,
    like: Tensor,
    group: Any,
    by_group: bool = False,
) -> ShardedTensor:
    """A ``ShardedTensor`` of global ``size`` whose rank ``i`` (of ``group``) holds
    ``pieces[i]`` (an empty piece: nothing), built without communication;
    ``local`` is this rank's piece. Global metadata places every piece on the
    device type of ``group``'s collectives (``by_group``: torch's chunked values)
    or as ``like`` is placed (a LOCAL_STATE_DICT's flat shard: torch gathers each
    rank's own placement)."""
    global_ranks = _comm.group_ranks(group)
    device = like.device
    group_type = _comm.group_device_type(group) if by_group else None

    def placed(i: int) -> str:
        if group_type is None and i == rank:
            return f"rank:{global_ranks[i]}/{device}"
        return placement(global_ranks[i], group_type or device.type)

    metadata = [
        ShardMetadata(offsets, sizes, placed(i))
        for i, (offsets, sizes) in enumerate(pieces)
        if math.prod(sizes) > 0
    ]
    properties = TensorProperties(
        dtype=like.dtype,
        layout=like.layout,
        requires_grad=False,
        memory_format=torch.contiguous_format,
        pin_memory=_pinned(like if local is None or local.numel() == 0 else local),
    )
    own = ShardMetadata(*pieces[rank], f"rank:{global_ranks[rank]}/{device}")
    shards = [] if local is None or local.numel() == 0 else [Shard(local, own)]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards,
        sharded_tensor_metadata=ShardedTensorMetadata(metadata, size, properties),
        process_group=group,
    )


def _pinned(tensor: Tensor) -> bool:
    """Whether ``tensor`` lives in pinned host memory (a CPU-offloaded shard on a GPU
    machine): ShardedTensor checks its properties against the local shard's."""
    return tensor.device.type == "cpu" and tensor.is_pinned()


def chunk_sharded_tensor(tensor: Tensor, rank: int, world_size: int, group: Any) -> ShardedTensor:
    """``tensor`` chunked on dim 0 over ``group`` (this rank's chunk copied)."""
    chunks = torch.chunk(tensor, world_size, dim=0)
    starts = itertools.accumulate((c.size(0) for c in chunks), initial=0)
    tail = [0] * (tensor.dim() - 1)
    pieces: list[Piece] = [([start, *tail], list(c.size())) for start, c in zip(starts, chunks)]
    empty: Piece = ([0] * tensor.dim(), [0] * tensor.dim())
    pieces += [empty] * (world_size - len(chunks))
    local = chunks[rank].detach().clone() if rank < len(chunks) else None
    return sharded_tensor(local, rank, pieces, tensor.size(), tensor, group, by_group=True)


def row_placements(mesh: DeviceMesh) -> list[Any]:
    """FSDP's placements of a value on its unit's mesh (see [Note: Rows chunked as
    torch.chunk])."""
    return [Replicate() for _ in range(mesh.ndim - 1)] + [DShard(0)]


def chunk_dtensor(tensor: Tensor, mesh: DeviceMesh, offload_to_cpu: bool = False) -> DTensor:
    """``tensor`` chunked on dim 0 over the last dimension of ``mesh`` (a copy of
    this rank's chunk; with ``offload_to_cpu`` moved to the CPU after the DTensor
    is made, as ``DTensor.from_local`` moves a local tensor to the mesh's device)."""
    full = tensor.detach()
    if full.dim() == 0:
        value = DTensor.from_local(full.clone(), mesh, [Replicate()] * mesh.ndim, run_check=False)
        return value.cpu() if offload_to_cpu else value
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "this rank is not in the unit's device mesh"
    chunks = torch.chunk(full, mesh.size(mesh.ndim - 1), dim=0)
    index = coordinate[-1]
    chunk = chunks[index] if index < len(chunks) else full[0:0]
    value = DTensor.from_local(
        chunk.clone(),
        mesh,
        row_placements(mesh),
        run_check=False,
        shape=full.shape,
        stride=full.stride(),
    )
    return value.cpu() if offload_to_cpu else value


def gather_rows(local: Tensor, shape: torch.Size, group: Any, device: torch.device) -> Tensor:
    """The tensor of ``shape`` whose rows ``group``'s ranks hold in ``torch.chunk``
    order (``local``: this rank's rows, maybe none); see [Note: Gathering chunked
    rows]."""
    size = group.size()
    rows = math.ceil(shape[0] / size)
    chunk = torch.zeros((rows, *shape[1:]), dtype=local.dtype, device=device)
    if local.numel() > 0:
        chunk[: local.shape[0]].copy_(local)
    full = chunk.new_empty(chunk.numel() * size)
    _comm.all_gather(full, chunk.reshape(-1), group)
    return full[: shape.numel()].view(shape)


def full_tensor(value: Tensor, device: torch.device) -> Tensor:
    """The full tensor of a ``ShardedTensor`` chunked by rows, or of a ``DTensor``
    sharded by rows over one mesh dimension (see [Note: Gathering chunked rows])."""
    if isinstance(value, DTensor):
        dims = [d for d, p in enumerate(value.placements) if not isinstance(p, Replicate)]
        if not dims:
            return value.to_local()
        if len(dims) > 1 or value.placements[dims[0]] != DShard(0):
            raise ValueError(
                f"cannot load a DTensor placed {value.placements}: FSDP's sharded values are "
                "Shard(0) over one mesh dimension (tensor-parallel values load into a unit "
                "over the data-parallel dimension of their mesh)"
            )
        return gather_mesh_dim(value, dims[0], value.shape, device)
    assert isinstance(value, ShardedTensor)
    shards = value.local_shards()
    if len(shards) > 1:
        raise AssertionError(f"Expects 0 or 1 shard per rank but got {len(shards)} shards.")
    local = shards[0].tensor if shards else torch.empty(0, dtype=value.dtype, device=device)
    return gather_rows(local, value.shape, value._process_group, device)


def gather_mesh_dim(value: DTensor, dim: int, shape: torch.Size, device: torch.device) -> Tensor:
    """``value``'s local tensor with its ``Shard(0)`` placement on mesh dimension
    ``dim`` gathered (a collective over that dimension's group); ``shape`` is the
    result's."""
    if value.placements[dim] != DShard(0):
        raise ValueError(
            f"cannot gather a DTensor placed {value.placements} over mesh dimension {dim}: "
            "FSDP's sharded values are Shard(0) there"
        )
    group = value.device_mesh.get_group(dim)
    return gather_rows(value.to_local().to(device), shape, group, device)


# -- torch's names (fsdp._shard_utils) ---------------------------------------------------------


def _create_chunk_sharded_tensor(
    tensor: Tensor,
    rank: int,
    world_size: int,
    num_devices_per_node: int,
    pg: Any,
    device: torch.device | None = None,
) -> ShardedTensor:
    """torch's signature: ``tensor`` chunked on dim 0 over ``pg`` as a ``ShardedTensor``
    (``num_devices_per_node`` and ``device`` are not needed: placements come from
    the tensor's device)."""
    return chunk_sharded_tensor(tensor, rank, world_size, pg)


def _create_chunk_dtensor(tensor: Tensor, rank: int, device_mesh: DeviceMesh) -> DTensor:
    """torch's signature: ``tensor`` chunked on dim 0 over the last dimension of
    ``device_mesh`` (``rank`` is not needed: the mesh knows the coordinate)."""
    return chunk_dtensor(tensor, device_mesh)


def _all_gather_dtensor(tensor: DTensor, root_mesh: DeviceMesh | None) -> Tensor:
    """torch's signature: the local tensor once the last mesh dimension is gathered
    (FSDP's values: the full tensor); ``tensor``'s mesh must be ``root_mesh``
    (torch's check and message)."""
    if root_mesh != tensor.device_mesh:
        raise AssertionError("The device mesh of a tensor should be a root mesh.")
    return full_tensor(tensor, tensor.to_local().device)
