"""A unit's values in sharded and local state dicts: ``ShardedTensor`` s and
``DTensor`` s (built by fsdp._shard_utils) out of and back into its parameters and its
flat shard (see [Note: The three state-dict types] in fsdp._state_dict.kinds)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.device_mesh import DeviceMesh

from fsdp._dtensor_extensions import DTensorExtensions
from fsdp._runtime import FSDPState
from fsdp._shard_utils import full_tensor, sharded_tensor
from fsdp.api import ShardedStateDictConfig


def extension_of(state: FSDPState) -> DTensorExtensions | None:
    return None if state.handle is None else state.handle._fsdp_extension


def unit_mesh(state: FSDPState) -> DeviceMesh:
    """The unit's mesh: the constructor's, or one over its process group."""
    if state.device_mesh is not None:
        mesh: DeviceMesh = state.device_mesh
        return mesh
    return DeviceMesh.from_group(state.process_group, state.compute_device.type)


def _valid_numel(state: FSDPState, rank: int) -> int:
    """How much of ``rank``'s flat shard is data (the rest is padding)."""
    handle = state.handle
    assert handle is not None
    numel = handle.shard_numel
    return max(0, min(numel, handle.unpadded_numel - rank * numel))


def flat_shard(state: FSDPState) -> ShardedTensor:
    """The local flat shard without padding, as a piece of the unpadded flat parameter."""
    handle = state.handle
    assert handle is not None
    numel = handle.shard_numel
    shard = handle.flat_param._local_shard
    pieces = [([r * numel], [_valid_numel(state, r)]) for r in range(state.world_size)]
    local = shard[: _valid_numel(state, state.rank)]
    size = torch.Size([handle.unpadded_numel])
    return sharded_tensor(local, state.rank, pieces, size, shard, state.process_group)


def local_shard_to_load(value: ShardedTensor, state: FSDPState) -> Tensor:
    """The saved local flat shard, padded back to this rank's shard size (a
    rank that holds only padding keeps its shard)."""
    handle = state.handle
    assert handle is not None
    if _valid_numel(state, state.rank) == 0:
        return handle.flat_param._local_shard
    shards = value.local_shards()
    if not shards:
        raise AssertionError("load_local_state_dict assume one shard per ShardedTensor.")
    tensor = shards[0].tensor.flatten()
    if tensor.numel() > handle.shard_numel:
        raise AssertionError(
            f"Local shard size = {handle.shard_numel} and the tensor in the state_dict is "
            f"{tensor.numel()}."
        )
    return F.pad(tensor, [0, handle.shard_numel - tensor.numel()])


def saves_dtensors(state: FSDPState) -> bool:
    config = state.state_dict_config
    use_dtensor = isinstance(config, ShardedStateDictConfig) and config._use_dtensor
    return use_dtensor or state.device_mesh is not None


def gathered_param(value: Tensor, state: FSDPState, index: int) -> Tensor:
    """A sharded value gathered for the unit's parameter ``index`` (see [Note: The
    three state-dict types] and [Note: Tensor-parallel parameters])."""
    extension = extension_of(state)
    if extension is None:
        return full_tensor(value, state.compute_device)
    handle = state.handle
    assert handle is not None
    param_extension = handle._param_extensions[index]
    shape = handle.layout.shapes[index]
    local = extension.gather(value, shape, param_extension, state.compute_device)
    return DTensorExtensions.unflatten(local, param_extension)
