"""State dicts of FSDP units: hooks that make ``state_dict()`` / ``load_state_dict()``
speak the unwrapped module's names.

[Note: State dicts through module hooks]
``nn.Module.state_dict`` recurses through children, calling each module's hooks,
so each unit registers four hooks and handles its own keys; nested units do the
same for theirs while the enclosing unit is unsharded, and every key is cleaned
exactly once. Keys lose the wrapper prefix (``_fsdp_wrapped_module.``); buffers
are saved in their original dtype (they may live in ``buffer_dtype``).

- ``FULL_STATE_DICT``: save unshards in full precision and exposes the original
  parameters, so the module saves them; entries are cloned (their storage is
  freed right after). ``rank0_only`` leaves other ranks' dicts empty,
  ``offload_to_cpu`` returns CPU tensors. Load unshards, lets the module copy
  into the exposed parameters, then writes each rank's part back into its shard.
- ``SHARDED_STATE_DICT``: like full, but each parameter is saved as a
  ``DTensor`` sharded on dim 0 over the unit's process group (``torch.chunk``
  layout), holding only this rank's rows. Loading gathers the rows back.
- ``LOCAL_STATE_DICT``: the unit's flat shard itself under ``_flat_param``
  (padded, full precision), with no communication; loads only into the same
  world size and wrapping.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor, Replicate

from fsdp import _comm
from fsdp._common import FLAT_PARAM, FSDP_PREFIX, clean_tensor_name
from fsdp._runtime import FSDPState
from fsdp._unshard_params import SummonedUnit, ensure_initialized
from fsdp._utils import _replace_by_prefix
from fsdp.api import FullStateDictConfig, StateDictType


def _clean_key(prefix: str, names: dict[int, str], module: nn.Module, name: str) -> str | None:
    path = names.get(id(module))
    if path is None:
        return None
    return prefix + clean_tensor_name(f"{path}.{name}".lstrip("."))


class _UnitKeys:
    """The clean state-dict keys of one unit's parameters and buffers."""

    params: dict[str, int]  # key -> index of the parameter in the flat parameter
    buffer_dtypes: dict[str, torch.dtype]

    def __init__(self, state: FSDPState, prefix: str) -> None:
        names = {id(m): n for n, m in state.module.named_modules(remove_duplicate=False)}
        self.params = {}
        if state.handle is not None:
            for i, info in enumerate(state.handle.param_infos()):
                key = _clean_key(prefix, names, info.module, info.param_name)
                if key is not None:
                    self.params[key] = i
        self.buffer_dtypes = {}
        for module, name in state.buffers:
            dtype = state.orig_buffer_dtypes.get((id(module), name))
            key = _clean_key(prefix, names, module, name)
            if dtype is not None and key is not None:
                self.buffer_dtypes[key] = dtype


def _clean_entries(state_dict: dict[str, Any], prefix: str) -> list[str]:
    """Drops the wrapper prefix from the keys under ``prefix``; returns them."""
    keys = []
    for key in [k for k in state_dict if k.startswith(prefix)]:
        value = state_dict.pop(key)
        clean = prefix + clean_tensor_name(key[len(prefix) :])
        state_dict[clean] = value
        keys.append(clean)
    return keys


def _prefix_entries(state_dict: dict[str, Any], prefix: str) -> None:
    """Inserts the wrapper prefix into the keys under ``prefix``."""
    _replace_by_prefix(state_dict, prefix, prefix + FSDP_PREFIX)


def _saved(value: Tensor, dtype: torch.dtype | None, offload_to_cpu: bool) -> Tensor:
    value = value.detach().clone() if dtype is None else value.detach().to(dtype, copy=True)
    return value.cpu() if offload_to_cpu else value


class _FullStateDict:
    """Save and load through the exposed full parameters (one unit at a time)."""

    def pre_save(self, unit: SummonedUnit) -> None:
        unit.enter()

    def post_save(self, unit: SummonedUnit, state_dict: dict[str, Any], prefix: str) -> None:
        state = unit.state
        config = state.state_dict_config
        assert isinstance(config, FullStateDictConfig)
        keys = _UnitKeys(state, prefix)
        state_dict.pop(prefix + FLAT_PARAM, None)
        for key in _clean_entries(state_dict, prefix):
            if config.rank0_only and state.rank != 0:
                del state_dict[key]
            elif isinstance(state_dict[key], Tensor):
                state_dict[key] = _saved(
                    state_dict[key], keys.buffer_dtypes.get(key), config.offload_to_cpu
                )
        unit.exit(writeback=False)

    def pre_load(self, unit: SummonedUnit, state_dict: dict[str, Any], prefix: str) -> None:
        unit.enter()
        _prefix_entries(state_dict, prefix)

    def post_load(self, unit: SummonedUnit) -> None:
        unit.exit(writeback=True)


class _ShardedStateDict(_FullStateDict):
    def post_save(self, unit: SummonedUnit, state_dict: dict[str, Any], prefix: str) -> None:
        state = unit.state
        keys = _UnitKeys(state, prefix)
        state_dict.pop(prefix + FLAT_PARAM, None)
        offload = state.state_dict_config.offload_to_cpu
        for key in _clean_entries(state_dict, prefix):
            value = state_dict[key]
            if key in keys.params:
                state_dict[key] = _row_shard(value, state, offload)
            elif isinstance(value, Tensor):
                state_dict[key] = _saved(value, keys.buffer_dtypes.get(key), offload)
        unit.exit(writeback=False)

    def pre_load(self, unit: SummonedUnit, state_dict: dict[str, Any], prefix: str) -> None:
        # Every rank gathers the same parameters in the same (flat) order.
        keys = _UnitKeys(unit.state, prefix)
        for key in sorted(keys.params, key=keys.params.__getitem__):
            value = state_dict.get(key)
            if isinstance(value, (ShardedTensor, DTensor)):
                state_dict[key] = full_tensor(value, unit.state.compute_device)
        super().pre_load(unit, state_dict, prefix)


def _row_shard(value: Tensor, state: FSDPState, offload_to_cpu: bool) -> Tensor:
    """This rank's rows of ``value`` as a DTensor sharded on dim 0."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = DeviceMesh.from_group(state.process_group, state.compute_device.type)
    full = value.detach()
    if full.dim() == 0:
        return DTensor.from_local(full.clone(), mesh, [Replicate()], run_check=False)
    chunks = torch.chunk(full, state.world_size, dim=0)
    local = chunks[state.rank] if state.rank < len(chunks) else full[0:0]
    local = local.clone()
    local = local.cpu() if offload_to_cpu else local
    return DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
    )


def full_tensor(value: Tensor, device: torch.device) -> Tensor:
    """The full tensor of a ``ShardedTensor`` / ``DTensor`` chunked by rows
    (``torch.chunk`` over dim 0), all-gathered through ``fsdp._comm`` over the
    group it is chunked over, so also into another wrapping. (``DTensor.full_tensor``
    would bypass the seam, and its functional collectives keep the group
    referenced after it is destroyed.)"""
    if isinstance(value, DTensor):
        if all(isinstance(p, Replicate) for p in value.placements):
            return value.to_local()
        group, local = value.device_mesh.get_group(value.device_mesh.ndim - 1), value.to_local()
    else:
        assert isinstance(value, ShardedTensor)
        shards = value.local_shards()
        group, local = value._process_group, shards[0].tensor if shards else None
    shape = value.shape
    rows = math.ceil(shape[0] / group.size())
    chunk = torch.zeros((rows, *shape[1:]), dtype=value.dtype, device=device)
    if local is not None:
        chunk[: local.shape[0]].copy_(local)
    full = chunk.new_empty(chunk.numel() * group.size())
    _comm.all_gather(full, chunk.reshape(-1), group)
    return full[: shape.numel()].view(shape)


class _LocalStateDict:
    def pre_save(self, unit: SummonedUnit) -> None:
        pass

    def post_save(self, unit: SummonedUnit, state_dict: dict[str, Any], prefix: str) -> None:
        state = unit.state
        keys = _UnitKeys(state, prefix)
        offload = state.state_dict_config.offload_to_cpu
        for key in _clean_entries(state_dict, prefix):
            if key in keys.params:
                del state_dict[key]  # original parameters (views) are not local state
            elif isinstance(state_dict[key], Tensor):
                state_dict[key] = _saved(state_dict[key], keys.buffer_dtypes.get(key), offload)
        if state.handle is not None:
            shard = state.handle.flat_param._local_shard
            state_dict[prefix + FLAT_PARAM] = _saved(shard, None, offload)

    def pre_load(self, unit: SummonedUnit, state_dict: dict[str, Any], prefix: str) -> None:
        handle = unit.state.handle
        key = prefix + FLAT_PARAM
        if handle is not None and key in state_dict:
            handle.load_local_shard(state_dict.pop(key))
        _prefix_entries(state_dict, prefix)

    def post_load(self, unit: SummonedUnit) -> None:
        pass


_KINDS: dict[StateDictType, Any] = {
    StateDictType.FULL_STATE_DICT: _FullStateDict(),
    StateDictType.SHARDED_STATE_DICT: _ShardedStateDict(),
    StateDictType.LOCAL_STATE_DICT: _LocalStateDict(),
}


class StateDictHooks:
    """The four state-dict hooks of one unit; the unit's state-dict type picks
    what they do."""

    state: FSDPState
    _load_prefix: str
    _unit: SummonedUnit | None  # between a pre-hook and its post-hook

    def __init__(self, state: FSDPState) -> None:
        self.state = state
        self._load_prefix = ""
        self._unit = None

    def register(self, module: nn.Module) -> None:
        # torch tags hook objects with attributes: hand it partials, not bound methods
        module.register_state_dict_pre_hook(functools.partial(StateDictHooks.pre_save, self))
        module.register_state_dict_post_hook(functools.partial(StateDictHooks.post_save, self))
        module.register_load_state_dict_pre_hook(functools.partial(StateDictHooks.pre_load, self))
        module.register_load_state_dict_post_hook(functools.partial(StateDictHooks.post_load, self))

    def _kind(self) -> Any:
        return _KINDS[self.state.state_dict_type]

    def pre_save(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        ensure_initialized(module)
        self._unit = SummonedUnit(self.state)
        self._kind().pre_save(self._unit)

    def post_save(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
    ) -> None:
        unit, self._unit = self._unit, None
        assert unit is not None, "state_dict post-hook without its pre-hook"
        self._kind().post_save(unit, state_dict, prefix)

    def pre_load(
        self,
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        ensure_initialized(module)
        self._load_prefix = prefix
        self._unit = SummonedUnit(self.state)
        self._kind().pre_load(self._unit, state_dict, prefix)

    def post_load(self, module: nn.Module, incompatible_keys: Any) -> None:
        prefix = self._load_prefix
        unit_keys: set[str] = set()
        if self.state.state_dict_type is StateDictType.LOCAL_STATE_DICT:
            params = _UnitKeys(self.state, prefix).params
            unit_keys = {_with_wrapper_prefix(k, prefix) for k in params}
        incompatible_keys.missing_keys[:] = [
            k
            for k in incompatible_keys.missing_keys
            if k != prefix + FLAT_PARAM and k not in unit_keys
        ]
        unit, self._unit = self._unit, None
        assert unit is not None, "load_state_dict post-hook without its pre-hook"
        self._kind().post_load(unit)


def _with_wrapper_prefix(key: str, prefix: str) -> str:
    return prefix + FSDP_PREFIX + key[len(prefix) :]
