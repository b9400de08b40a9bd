"""FSDP over the data-parallel dimension of a device mesh whose other dimension
is tensor-parallel (``torch.distributed.tensor.parallel``): DTensor parameters.

[Note: Tensor-parallel parameters]
``parallelize_module(model, mesh_2d["tp"], plan)`` replaces the parameters of the
planned modules by ``DTensor`` s over the tensor-parallel mesh (the local tensor
is the rank's shard, or a replica); ``FSDP(model, device_mesh=mesh_2d["dp"])``
then shards over the data-parallel dimension. A unit gets an extension when its
device mesh is a slice of a larger mesh (its root mesh is another mesh, as
torch's ``DTensorExtensions`` are chosen); it then does what torch's FSDP does
with them (facts read from torch, behaviour checked against it):

- Flattening: each DTensor parameter is flattened through its local tensor. Its
  names in the module are given a ``Parameter`` of that local tensor (sharing its
  storage, with its ``requires_grad``), which is what ``use_orig_params=True``
  keeps as the original parameter (1-D views of the shard between iterations,
  as torch's); its mesh, placements, global shape and stride are remembered.
  Plain parameters of the same unit flatten as they are.
- Unflattening: wherever the module sees its parameters unsharded (forward,
  backward, ``summon_full_params``, state dicts), a DTensor parameter's view of
  the unsharded flat parameter is wrapped back into a DTensor with what was
  remembered (``DTensor.from_local(view, mesh, placements, shape, stride)``, no
  communication), so the tensor-parallel layers compute as before and their
  gradients reach the flat parameter through the local view; under
  ``use_orig_params`` such a name holds a new ``Parameter`` each time (a DTensor
  cannot be the ``.data`` of the local one).
- Sharded state dicts and sharded optimizer state dicts: each value is a DTensor
  on the root mesh with the value's global shape. A tensor-parallel value keeps
  its placement on the last (tensor-parallel) dimension and is ``Shard(0)`` on
  the one before (the data-parallel one), replicated on the others; a plain
  value is ``Shard(0)`` on mesh dimension 0 and replicated on the others (what
  torch builds with ``DTensor.from_local(...).redistribute(...)``). The local
  tensors are what DTensor's placements say: the rank's data-parallel chunk of
  its tensor-parallel shard, except where the tensor-parallel placement splits
  rows too (``Shard(0)``): DTensor then chunks the whole value over the data-
  parallel dimension first and each chunk over the tensor-parallel one, so the
  value is first gathered over the tensor-parallel group (through
  ``fsdp._comm``) and cut so. Full state dicts keep the DTensors of the
  tensor-parallel mesh as the unsharded parameters are.
- Loading either: a value on the root mesh is gathered back to the parameter's
  tensor-parallel shard (over the data-parallel group, and over both groups
  where both split rows), then wrapped again for the module to copy. A DTensor
  of the tensor-parallel mesh (a full state dict's) loads its local tensor.
- Torch's FSDP loads a sharded optimizer state dict of such a unit by gathering
  each DTensor whole (every mesh dimension): with ``use_orig_params=False`` it
  then refuses the global shape ("Tensor optimizer state does not have same
  shape as its parameter"); with ``use_orig_params=True`` it keeps the global
  tensor's first elements as the rank's part, which is wrong on ranks whose
  tensor-parallel shard is not the first. Ours gathers the data-parallel
  dimension only and loads what was saved (``suites/test_fsdp_tp_integration.py``
  asserts both).
- ``sync_module_states`` broadcasts local tensors over the data-parallel group
  (a DTensor buffer's local tensor too), as torch's.

A unit whose parameters include DTensors but whose mesh is not such a slice
(no mesh, a process group, a root mesh) refuses them with an error naming the
parameter: flattening a DTensor with plain tensors cannot work (torch's fails
inside DTensor's dispatch, "got mixed torch.Tensor and DTensor").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import Shard as DShard

from fsdp._shard_utils import full_tensor, gather_rows


def local_of(tensor: Tensor) -> Tensor:
    """A DTensor's local tensor (the same storage); any other tensor itself."""
    if isinstance(tensor, DTensor):
        with torch.no_grad():
            return tensor.to_local()
    return tensor


def root_mesh_of(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (itself for a mesh that was not)."""
    get_root = getattr(mesh, "_get_root_mesh", None)
    if get_root is not None:
        root: DeviceMesh = get_root()
        return root
    from torch.distributed.device_mesh import _mesh_resources  # torch 2.11 without the method

    return _mesh_resources.get_root_mesh(mesh)


class ParamExtension(NamedTuple):
    """What a DTensor parameter was (torch's ``param_extension``)."""

    mesh: DeviceMesh
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]


class DTensorExtensions:
    """The tensor-parallel parameters of one unit (see [Note: Tensor-parallel
    parameters])."""

    root_mesh: DeviceMesh
    _extensions: dict[int, ParamExtension]  # id of the local Parameter -> what it was

    def __init__(self, root_mesh: DeviceMesh) -> None:
        self.root_mesh = root_mesh
        self._extensions = {}

    @classmethod
    def for_mesh(cls, device_mesh: DeviceMesh | None) -> DTensorExtensions | None:
        """An extension for a unit over ``device_mesh`` when it is a slice of a larger mesh."""
        if device_mesh is None:
            return None
        root = root_mesh_of(device_mesh)
        return None if root == device_mesh else cls(root)

    # -- flattening --------------------------------------------------------------------------

    def localize(self, params: Sequence[nn.Parameter], module: nn.Module) -> list[nn.Parameter]:
        """``params`` with each DTensor replaced by a ``Parameter`` of its local tensor,
        under every name it has in ``module``'s tree."""
        local_of_param: dict[int, nn.Parameter] = {}
        for param in params:
            if isinstance(param, DTensor):
                local = nn.Parameter(local_of(param).detach(), requires_grad=param.requires_grad)
                self._extensions[id(local)] = ParamExtension(
                    param.device_mesh, tuple(param.placements), param.shape, param.stride()
                )
                local_of_param[id(param)] = local
        if not local_of_param:
            return list(params)
        for submodule in module.modules():
            for name, param in list(submodule._parameters.items()):
                if param is not None and id(param) in local_of_param:
                    submodule._parameters[name] = local_of_param[id(param)]
        return [local_of_param.get(id(p), p) for p in params]

    def extension_of(self, param: Tensor) -> ParamExtension | None:
        return self._extensions.get(id(param))

    @staticmethod
    def unflatten(view: Tensor, extension: ParamExtension | None) -> Tensor:
        """A view of the unsharded flat parameter as the module sees it."""
        if extension is None:
            return view
        return DTensor.from_local(
            view,
            extension.mesh,
            extension.placements,
            run_check=False,
            shape=extension.shape,
            stride=extension.stride,
        )

    # -- state dicts ---------------------------------------------------------------------------

    def chunk(self, value: Tensor, offload_to_cpu: bool) -> DTensor:
        """A state-dict value (an unsharded parameter or optimizer state, a DTensor
        of the tensor-parallel mesh or a plain tensor) on the root mesh."""
        root = self.root_mesh
        placements: list[Any] = [Replicate() for _ in range(root.ndim)]
        if isinstance(value, DTensor):
            placements[-2], placements[-1] = DShard(0), value.placements[0]
            local = self._data_parallel_chunk(value)
        else:
            placements[0] = DShard(0)
            local = _chunk_rows(value.detach(), root, 0)
        result = DTensor.from_local(
            local.clone(),
            root,
            placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
        return result.cpu() if offload_to_cpu else result  # after: from_local moves to the mesh

    def _data_parallel_chunk(self, value: DTensor) -> Tensor:
        """This rank's part of a tensor-parallel value placed ``(..., Shard(0),
        placement)`` on the root mesh. When the tensor-parallel placement splits
        rows too, DTensor splits the whole value over the data-parallel dimension
        first and each chunk over the tensor-parallel one: the value is gathered
        over the tensor-parallel group (through fsdp._comm) to cut it so."""
        root, local = self.root_mesh, local_of(value).detach()
        if value.placements[0] != DShard(0):
            return _chunk_rows(local, root, root.ndim - 2)
        whole = gather_rows(local, value.shape, value.device_mesh.get_group(), local.device)
        return _chunk_rows(_chunk_rows(whole, root, root.ndim - 2), root, root.ndim - 1)

    def gather(
        self,
        value: Tensor,
        shape: torch.Size,
        extension: ParamExtension | None,
        device: torch.device,
    ) -> Tensor:
        """A loaded value as its parameter's local tensor of ``shape`` (see [Note:
        Tensor-parallel parameters]); a value of another kind is gathered whole."""
        if isinstance(value, DTensor) and value.device_mesh == self.root_mesh:
            return self._tensor_parallel_local(value, shape, device)
        if (
            isinstance(value, DTensor)
            and extension is not None
            and value.device_mesh == extension.mesh
        ):
            return local_of(value)
        if isinstance(value, (DTensor, ShardedTensor)):
            return full_tensor(value, device)
        return value

    def _tensor_parallel_local(
        self, value: DTensor, shape: torch.Size, device: torch.device
    ) -> Tensor:
        """The inverse of ``chunk``: gathers the data-parallel dimension back (and,
        where the tensor-parallel placement splits rows too, the whole value)."""
        root = self.root_mesh
        dims = [d for d in range(root.ndim - 1) if value.placements[d] == DShard(0)]
        if len(dims) != 1:
            raise ValueError(f"cannot load a DTensor placed {value.placements} into FSDP")
        dp_dim, tp_dim = dims[0], root.ndim - 1
        local = local_of(value).to(device)
        if value.placements[tp_dim] != DShard(0):
            return gather_rows(local, shape, root.get_group(dp_dim), device)
        rows = _chunk_size(value.shape[0], root.size(dp_dim), _coordinate(root, dp_dim))
        block = gather_rows(
            local, torch.Size([rows, *value.shape[1:]]), root.get_group(tp_dim), device
        )
        whole = gather_rows(block, value.shape, root.get_group(dp_dim), device)
        return _chunk_rows(whole, root, tp_dim)


def _coordinate(mesh: DeviceMesh, dim: int) -> int:
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "this rank is not in the unit's device mesh"
    return coordinate[dim]


def _chunk_size(rows: int, parts: int, index: int) -> int:
    """How many rows ``torch.chunk`` gives chunk ``index`` of ``parts`` (0 beyond the last)."""
    size = -(-rows // parts)
    return max(0, min(size, rows - index * size))


def _chunk_rows(tensor: Tensor, mesh: DeviceMesh, dim: int) -> Tensor:
    """This rank's ``torch.chunk`` of ``tensor``'s rows over mesh dimension ``dim``
    (empty beyond the number of chunks, as DTensor's ``Shard(0)``)."""
    chunks = torch.chunk(tensor, mesh.size(dim), dim=0)
    index = _coordinate(mesh, dim)
    return chunks[index] if index < len(chunks) else tensor[0:0]
