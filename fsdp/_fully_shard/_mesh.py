"""The data-parallel mesh of a ``fully_shard`` call, as process groups.

[Note: Meshes and groups]
A 1-D mesh shards each parameter over all its ranks (``Shard(0)``); a 2-D mesh
(HSDP, which must name its dimensions) replicates over dimension 0 and shards
over dimension 1 (``(Replicate(), Shard(0))``). ``MeshInfo`` holds the groups
the collectives run on: the shard group (all-gather, reduce-scatter) and, for
HSDP, the replicate group (the all-reduce of the reduced shards).

``reshard_after_forward`` chooses the mesh parameters are resharded to after
forward (``post_forward_mesh``): ``True`` the shard mesh itself, ``False`` none
(parameters stay unsharded until after backward), an int ``k`` a mesh of the
same ranks viewed as ``(-1, k)``: after forward each rank keeps a ``1/k`` shard,
and backward all-gathers over ``k`` ranks only. ``k`` must divide the shard
size; ``1`` means ``False`` (with torch's warning) and the shard size means ``True``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = [
    "MeshInfo",
    "logger",
    "default_mesh",
    "device_of",
    "post_forward_mesh",
    "spmd_mesh",
    "validate_mesh",
]

# torch's ``fully_shard`` logger name: the warnings and the debug trace of each
# hook (``FSDP::pre_forward (<module>)``, ...) go where torch's go, so that
# ``TORCH_LOGS=fsdp`` (torch's "fsdp" log covers ``torch.distributed.fsdp``) and a
# user's logging configuration for torch's FSDP show ours as well
logger = logging.getLogger("torch.distributed.fsdp.fully_shard")


@dataclass(frozen=True, eq=False)
class MeshInfo:
    """A data-parallel mesh: its shard dimension (the last) and, for HSDP, its
    replicate dimension (the first)."""

    mesh: DeviceMesh
    shard_group: ProcessGroup
    shard_size: int
    shard_rank: int
    replicate_group: ProcessGroup | None
    replicate_size: int

    @classmethod
    def of(cls, mesh: DeviceMesh) -> MeshInfo:
        shard_dim = mesh.ndim - 1
        shard_group = mesh.get_group(shard_dim)
        replicate = mesh.get_group(0) if mesh.ndim == 2 else None
        return cls(
            mesh,
            shard_group,
            shard_group.size(),
            shard_group.rank(),
            replicate,
            replicate.size() if replicate is not None else 1,
        )

    @property
    def is_hsdp(self) -> bool:
        return self.replicate_group is not None


def validate_mesh(mesh: DeviceMesh) -> None:
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}")
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise AssertionError("Please init the 2D mesh for HSDP with mesh_dim_names specified")


def default_mesh() -> DeviceMesh:
    """A 1-D mesh of the default group's ranks on the accelerator (the CPU when
    there is none), as torch's ``fully_shard`` makes when given no mesh."""
    if not dist.is_initialized():
        dist.init_process_group()
    device_type = torch._C._get_accelerator().type
    return init_device_mesh(device_type, (dist.get_world_size(),))


def device_of(mesh: DeviceMesh) -> torch.device:
    """The device parameters live on: the CPU, or the current device of the mesh's type."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def post_forward_mesh(reshard_after_forward: bool | int, info: MeshInfo) -> MeshInfo | None:
    """The mesh parameters are resharded to after forward (see [Note: Meshes and groups])."""
    if not isinstance(reshard_after_forward, (bool, int)):
        raise ValueError(
            "reshard_after_forward should be a bool or an int representing the "
            f"group size to reshard to, not {reshard_after_forward}"
        )
    value = _normalized(reshard_after_forward, info.shard_size)
    if value is True:
        return info
    if value is False:
        return None
    grid = info.mesh.mesh.view(-1, value)
    return MeshInfo.of(DeviceMesh(info.mesh.device_type, grid))


def _normalized(value: bool | int, shard_size: int) -> bool | int:
    if isinstance(value, bool):
        return value
    if value < 1 or value > shard_size or shard_size % value != 0:
        raise ValueError(
            "If passing reshard_after_forward as an int, it should be a "
            f"factor of {shard_size}, not {value}"
        )
    if value == 1:
        logger.warning(
            "reshard_after_forward=1 (int) means resharding parameters to world size 1, "
            "instead of reshard_after_forward=True (bool)"
        )
        return False
    return True if value == shard_size else value


def spmd_mesh(data_parallel: DeviceMesh, model_parallel: DeviceMesh) -> DeviceMesh:
    """The mesh of a tensor-parallel parameter once sharded: the data-parallel
    dimensions, then the model-parallel ones, sliced from the mesh both come from
    (torch 2.13 concatenates them; torch 2.11 slices their root mesh by name)."""
    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if concatenate is not None:
        mesh: DeviceMesh = concatenate([data_parallel, model_parallel])
        return mesh
    names = (*(data_parallel.mesh_dim_names or ()), *(model_parallel.mesh_dim_names or ()))
    if len(names) != data_parallel.ndim + model_parallel.ndim:
        raise AssertionError("FSDP requires named DeviceMesh dims for ND parallelism")
    root = data_parallel._get_root_mesh()
    if root is not model_parallel._get_root_mesh():
        raise AssertionError(
            "FSDP requires the DP and model parallel TP/EP mesh to have the same parent mesh "
            f"but got: \nDP's mesh: {data_parallel}\nTP/EP's mesh: {model_parallel}"
        )
    return root[names]
