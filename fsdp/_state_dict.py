"""State dicts of FSDP units: hooks that make ``state_dict()`` / ``load_state_dict()``
speak the unwrapped module's names, with torch's value types.

[Note: State dicts through module hooks]
``nn.Module.state_dict`` recurses through children, calling each module's hooks,
so each unit registers four hooks and handles its own keys; nested units do the
same for theirs while the enclosing unit is unsharded. Keys lose the wrapper
prefix (``_fsdp_wrapped_module.``; activation checkpointing's is dropped by its
own wrapper, or by ``clean_tensor_name``). Load hooks put the prefix back, and
the missing and unexpected keys that ``load_state_dict`` reports are clean.
A unit's parameter keys come from its flat parameter's records (every name of
a shared parameter included), so only the unit's own parameters are touched:
parameters of ignored modules, or added after wrapping, pass through as the
module saves them (not copied).

[Note: The three state-dict types]
- ``FULL_STATE_DICT``: save unshards the unit (summon, full precision) and
  clones each original parameter, since the unsharded storage is freed right
  after. ``rank0_only``: other ranks take part in the all-gather, then drop the
  unit's parameters and buffers. ``offload_to_cpu``: CPU tensors. Load
  unshards, lets the module copy into the exposed parameters, then writes each
  rank's part back into its shard.
- ``SHARDED_STATE_DICT``: like full, but each parameter is a ``ShardedTensor``
  chunked on dim 0 over the unit's sharding group, or with ``_use_dtensor`` (set
  whenever the unit has a device mesh) a ``DTensor`` on the unit's mesh (see
  [Note: Rows chunked as torch.chunk] in fsdp._shard_utils; a unit composed with
  tensor parallelism saves DTensors of the mesh its mesh was sliced from, see
  [Note: Tensor-parallel parameters] in fsdp._dtensor_extensions). Load gathers
  each parameter (see [Note: Gathering chunked rows]), every rank in the same
  (flat) order, then loads it as full. A value of any kind, wrapping, world size
  or mesh loads (torch's FSDP loads only the kind and mesh it saves, asserted in
  ``suites/test_fsdp_dtensor_state_dict.py``). A 0-dim parameter cannot be
  chunked and stays a plain tensor; any other plain tensor is refused with
  torch's ``AssertionError`` (unless ``DTensor`` s are saved).
- ``LOCAL_STATE_DICT``: the unit's flat shard under ``_flat_param``, as a
  ``ShardedTensor`` over the *unpadded* flat parameter (a view, no copy; a rank
  that holds only padding has no local shard), so it survives ``torch.save``
  and a gather plus re-chunk loads it into another world size. Load takes only
  a ``ShardedTensor`` and pads the local shard back. Everything else is what
  the module saves and loads itself, as in torch: buffers as they live (in
  ``buffer_dtype`` under buffer mixed precision, on the device), and under
  ``use_orig_params`` the original parameters, which then are views of their
  parts of the shard (loaded again through those views, with the same values).
  The flat shard is loaded by the pre-load hook, which removes its key, with or
  without ``use_orig_params``: torch's FSDP leaves the key in place when the
  flat parameter is not registered (``use_orig_params=True``), so its own local
  state dicts then fail a strict load with ``Unexpected key(s) ...
  "_flat_param"`` (asserted in ``suites/test_state_dict_options.py`` and
  ``suites/test_property_findings.py``). Unlike torch's, the local shard does
  not require grad (torch's is a view of the flat parameter created under
  ``no_grad``, which a gloo gather in grad mode refuses).

[Note: _use_dtensor follows the device mesh]
As torch's: before a unit with a device mesh (and a sharded strategy) saves or
loads, ``LOCAL_STATE_DICT`` is refused ("DeviceMesh is not compatible with
LOCAL_STATE_DICT") and a ``ShardedStateDictConfig``'s ``_use_dtensor`` becomes
True; ``get_state_dict_type`` of units some of which have a mesh refuses
``LOCAL_STATE_DICT`` likewise and makes the optimizer config's ``_use_dtensor``
True (``optim_state_dict`` asks it first). Torch sets the flag on the config
object every unit shares, so it stays until ``set_state_dict_type`` installs
another config; the configs here are frozen, so every unit holding the same
settings gets new settings with the flag set.

[Note: Buffers in full and sharded state dicts]
As torch's: with ``offload_to_cpu`` every buffer of the unit's subtree goes to
the CPU; a unit with buffer mixed precision saves every buffer of its subtree
that some unit manages (ignored ones excepted) as a copy in its original dtype
(its dtype when the unit was built; buffers live in ``buffer_dtype`` from lazy
initialisation on). Otherwise the
entries are the module's own tensors. Names come from ``named_buffers()``: the
second name of a module registered twice is left as the module saves it.

[Note: NO_SHARD units save full state dicts]
As in torch, a ``NO_SHARD`` unit (also a sharded strategy at world size 1,
which becomes ``NO_SHARD``) saves and loads ``FULL_STATE_DICT`` with the
default config, whatever type and config are set, and warns that it does so in
each of its four hooks (twice per save and twice per load, with torch's texts):
there is nothing to shard, and ``rank0_only`` / ``offload_to_cpu`` do not apply.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp._common import FLAT_PARAM, FSDP_PREFIX, FSDP_WRAPPED_MODULE, clean_tensor_name
from fsdp._dtensor_extensions import DTensorExtensions
from fsdp._runtime import FSDPState
from fsdp._shard_utils import (
    chunk_dtensor,
    chunk_sharded_tensor,
    full_tensor,
    sharded_tensor,
)
from fsdp._unshard_params import SummonedUnit, ensure_initialized, validate_unshard
from fsdp._utils import _replace_by_prefix
from fsdp.api import (
    FullStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)

# Torch's texts, word for word (its load hooks lose a space).
_NO_SHARD_SAVE_WARNING = (
    "When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will be returned."
)
_NO_SHARD_LOAD_WARNING = (
    "When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict willbe returned."
)


_LOCAL_WITH_MESH = (
    "Found state_dict_type LOCAL_STATE_DICT. DeviceMesh is not compatible with LOCAL_STATE_DICT. "
    "Please set state_dict_type to SHARDED_STATE_DICT to get DTensor state_dict."
)


def _use_dtensor_with_mesh(state: FSDPState) -> None:
    """See [Note: _use_dtensor follows the device mesh] (before a unit's state-dict
    hooks; NO_SHARD units save full state dicts and are left alone)."""
    if state.device_mesh is None or state.config.sharding_strategy is ShardingStrategy.NO_SHARD:
        return
    settings = state.state_dict_settings
    if settings.state_dict_type is StateDictType.LOCAL_STATE_DICT:
        raise RuntimeError(_LOCAL_WITH_MESH)
    config = settings.state_dict_config
    if isinstance(config, ShardedStateDictConfig) and not config._use_dtensor:
        new = dataclasses.replace(config, _use_dtensor=True)
        _share(state.root.states, settings, dataclasses.replace(settings, state_dict_config=new))


def optim_settings_with_mesh(
    states: list[FSDPState], settings: StateDictSettings
) -> StateDictSettings:
    """``get_state_dict_type`` of units some of which have a device mesh (see
    [Note: _use_dtensor follows the device mesh])."""
    if all(s.device_mesh is None for s in states):
        return settings
    if settings.state_dict_type is StateDictType.LOCAL_STATE_DICT:
        raise RuntimeError(_LOCAL_WITH_MESH)
    config = settings.optim_state_dict_config
    if not isinstance(config, ShardedOptimStateDictConfig):
        for state in states:
            if state.device_mesh is not None:
                _mark_use_dtensor(state.state_dict_settings.optim_state_dict_config)
        return settings
    if not config._use_dtensor:
        new = dataclasses.replace(config, _use_dtensor=True)
        settings_new = dataclasses.replace(settings, optim_state_dict_config=new)
        _share(states, settings, settings_new)
        return settings_new
    return settings


def _mark_use_dtensor(config: OptimStateDictConfig | None) -> None:
    """Torch sets ``_use_dtensor`` on whatever optimizer config object a unit with
    a mesh holds, a full one included, and ``sharded_optim_state_dict`` then
    saves DTensors until ``set_state_dict_type`` installs other config objects
    (a context's exit restores the marked one). The full configs have no such
    field here: the mark is an attribute of the config object, as in torch."""
    if config is not None and not getattr(config, "_use_dtensor", False):
        object.__setattr__(config, "_use_dtensor", True)


def _share(states: list[FSDPState], old: StateDictSettings, new: StateDictSettings) -> None:
    """Every unit that holds ``old`` (``set_state_dict_type`` gives all the same
    object) now holds ``new``: torch changes the one config object they share."""
    for state in states:
        if state.state_dict_settings is old:
            state.state_dict_settings = new


class _Settings(NamedTuple):
    """The type and config a unit's hooks apply (see [Note: NO_SHARD units save
    full state dicts])."""

    kind: StateDictType
    config: StateDictConfig

    @classmethod
    def of(cls, state: FSDPState) -> _Settings:
        if state.config.sharding_strategy is not ShardingStrategy.NO_SHARD:
            return cls(state.state_dict_type, state.state_dict_config)
        return cls(StateDictType.FULL_STATE_DICT, FullStateDictConfig())

    @property
    def rank0_only(self) -> bool:
        return isinstance(self.config, FullStateDictConfig) and self.config.rank0_only


def _warn_if_no_shard(state: FSDPState, loading: bool) -> None:
    """Each of a ``NO_SHARD`` unit's four hooks warns (see [Note: NO_SHARD units
    save full state dicts])."""
    if state.config.sharding_strategy is ShardingStrategy.NO_SHARD:
        text = _NO_SHARD_LOAD_WARNING if loading else _NO_SHARD_SAVE_WARNING
        warnings.warn(text, stacklevel=5)


def _key(prefix: str, module_name: str, name: str) -> str:
    return prefix + clean_tensor_name(f"{module_name}.{name}".lstrip("."))


class _UnitKeys:
    """The clean state-dict keys of one unit's parameters (every name of a
    shared one, in flat order) and of the buffers in its subtree (see [Note:
    Buffers in full and sharded state dicts])."""

    params: list[str]
    param_indices: list[int]  # each key's parameter in the flat parameter
    param_names: list[tuple[str, str]]  # each parameter's module name and name
    buffers: list[str]
    buffer_dtypes: dict[str, torch.dtype]  # managed buffers: their original dtype

    def __init__(self, state: FSDPState, prefix: str) -> None:
        handle = state.handle
        own = [] if handle is None else list(handle.param_infos())
        shared = [] if handle is None else list(handle.shared_param_infos())
        infos = [*own, *shared]
        self.params = [_key(prefix, i.module_name, i.param_name) for i in infos]
        self.param_names = [(i.module_name, i.param_name) for i in infos]
        primaries = {(id(i.module), i.param_name): n for n, i in enumerate(own)}
        self.param_indices = list(range(len(own))) + [
            primaries[(id(i.prim_module), i.prim_param_name)] for i in shared
        ]
        orig_dtypes: dict[tuple[int, str], torch.dtype] = {}
        for unit in state.subtree_states():
            orig_dtypes.update(unit.orig_buffer_dtypes)
        self.buffers = []
        self.buffer_dtypes = {}
        seen: set[int] = set()  # named_buffers(): a buffer once, under its first name
        for path, module in state.module.named_modules():
            for name, buffer in module.named_buffers(recurse=False):
                if id(buffer) in seen:
                    continue
                seen.add(id(buffer))
                key = _key(prefix, path, name)
                self.buffers.append(key)
                dtype = orig_dtypes.get((id(module), name))
                if dtype is not None:
                    self.buffer_dtypes[key] = dtype


def _is_wrapper(state: FSDPState) -> bool:
    return FSDP_WRAPPED_MODULE in state.module._modules


def _strip_wrapper_prefix(state_dict: dict[str, Any], prefix: str) -> None:
    """Drops the wrapper prefixes from the keys under ``prefix``."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        clean = prefix + clean_tensor_name(key[len(prefix) :])
        if clean != key:
            state_dict[clean] = state_dict.pop(key)


def _insert_wrapper_prefix(state: FSDPState, state_dict: dict[str, Any], prefix: str) -> None:
    """Inserts the wrapper prefix into the keys under ``prefix`` (wrappers only)."""
    if _is_wrapper(state):
        _replace_by_prefix(state_dict, prefix, prefix + FSDP_PREFIX)


def _save_buffers(
    state: FSDPState, keys: _UnitKeys, state_dict: dict[str, Any], offload_to_cpu: bool
) -> None:
    """See [Note: Buffers in full and sharded state dicts]."""
    casts = state.config.mixed_precision.buffer_dtype is not None
    for key in keys.buffers:
        value = state_dict.get(key)
        if not isinstance(value, Tensor):
            continue
        if offload_to_cpu and value.device.type != "cpu":
            value = value.cpu()
        dtype = keys.buffer_dtypes.get(key)
        if casts and dtype is not None:
            value = value.to(dtype, copy=True)
        state_dict[key] = value


def _drop_unit_entries(keys: _UnitKeys, state_dict: dict[str, Any], prefix: str) -> None:
    """``rank0_only`` on other ranks: the unit's parameters and buffers go."""
    for key in (*keys.params, *keys.buffers, prefix + FLAT_PARAM):
        state_dict.pop(key, None)


def _check_saved(
    key: str, info: tuple[str, str], prefix: str, state_dict: dict[str, Any], state: FSDPState
) -> None:
    """Torch's check and message (``info``: the parameter's module and name), e.g.
    for a rank that a ``summon_full_params(rank0_only=True)`` leaves sharded."""
    if key not in state_dict:
        module_name, param_name = info
        module_name = clean_tensor_name(f"{module_name}.") if module_name else ""
        raise AssertionError(
            f"FSDP assumes {key} is in the state_dict but the state_dict only has "
            f"{state_dict.keys()}. prefix={prefix}, module_name={module_name}, "
            f"param_name={param_name} rank={state.rank}."
        )


# -- sharded values (fsdp._shard_utils) ---------------------------------------------------------


def _extension(state: FSDPState) -> DTensorExtensions | None:
    return None if state.handle is None else state.handle._fsdp_extension


def _mesh(state: FSDPState) -> DeviceMesh:
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


def _flat_shard(state: FSDPState) -> ShardedTensor:
    """The local flat shard without padding, as a piece of the unpadded flat parameter."""
    handle = state.handle
    assert handle is not None
    numel = handle.shard_numel
    shard = handle.flat_param._local_shard
    pieces = [([r * numel], [_valid_numel(state, r)]) for r in range(state.world_size)]
    local = shard[: _valid_numel(state, state.rank)]
    size = torch.Size([handle.unpadded_numel])
    return sharded_tensor(local, state.rank, pieces, size, shard, state.process_group)


def _local_shard_to_load(value: ShardedTensor, state: FSDPState) -> Tensor:
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


# -- the three types ---------------------------------------------------------------------------


class _Kind:
    """What the hooks of one state-dict type do; a pre-hook may return the unit
    it summoned, which its post-hook receives."""

    def pre_save(self, state: FSDPState, settings: _Settings) -> SummonedUnit | None:
        return None

    def post_save(
        self,
        state: FSDPState,
        unit: SummonedUnit | None,
        settings: _Settings,
        state_dict: dict[str, Any],
        prefix: str,
    ) -> None:
        raise NotImplementedError

    def pre_load(
        self, state: FSDPState, state_dict: dict[str, Any], prefix: str
    ) -> SummonedUnit | None:
        raise NotImplementedError

    def post_load(self, unit: SummonedUnit | None) -> None:
        pass


class _FullStateDict(_Kind):
    """Save and load through the exposed full parameters (one unit at a time)."""

    def summoned(self, state: FSDPState, settings: _Settings) -> SummonedUnit:
        return SummonedUnit(state, settings.rank0_only, settings.config.offload_to_cpu)

    def save_param(self, value: Tensor, state: FSDPState, config: StateDictConfig) -> Tensor:
        return value.detach().clone()

    def pre_save(self, state: FSDPState, settings: _Settings) -> SummonedUnit | None:
        unit = self.summoned(state, settings)
        validate_unshard(state, False, unit.rank0_only, unit.offload_to_cpu, False)
        unit.enter()
        return unit

    def post_save(
        self,
        state: FSDPState,
        unit: SummonedUnit | None,
        settings: _Settings,
        state_dict: dict[str, Any],
        prefix: str,
    ) -> None:
        assert unit is not None
        _strip_wrapper_prefix(state_dict, prefix)
        keys = _UnitKeys(state, prefix)
        try:
            if settings.rank0_only and state.rank != 0:
                _drop_unit_entries(keys, state_dict, prefix)
                return
            for key, info in zip(keys.params, keys.param_names):
                _check_saved(key, info, prefix, state_dict, state)
                state_dict[key] = self.save_param(state_dict[key], state, settings.config)
            state_dict.pop(prefix + FLAT_PARAM, None)
        finally:
            unit.exit(writeback=False)
        _save_buffers(state, keys, state_dict, settings.config.offload_to_cpu)

    def pre_load(
        self, state: FSDPState, state_dict: dict[str, Any], prefix: str
    ) -> SummonedUnit | None:
        unit = SummonedUnit(state)
        unit.enter()
        _insert_wrapper_prefix(state, state_dict, prefix)
        return unit

    def post_load(self, unit: SummonedUnit | None) -> None:
        assert unit is not None
        unit.exit(writeback=True)


def _saves_dtensors(state: FSDPState) -> bool:
    config = state.state_dict_config
    use_dtensor = isinstance(config, ShardedStateDictConfig) and config._use_dtensor
    return use_dtensor or state.device_mesh is not None


class _ShardedStateDict(_FullStateDict):
    def summoned(self, state: FSDPState, settings: _Settings) -> SummonedUnit:
        return SummonedUnit(state)  # chunked first, offloaded after

    def save_param(self, value: Tensor, state: FSDPState, config: StateDictConfig) -> Tensor:
        assert isinstance(config, ShardedStateDictConfig)
        value = value.detach()
        offload = config.offload_to_cpu
        if value.dim() == 0:
            return value.to("cpu", copy=True) if offload else value.clone()
        extension = _extension(state)
        if extension is not None:
            return extension.chunk(value, offload)
        if config._use_dtensor or state.device_mesh is not None:
            return chunk_dtensor(value, _mesh(state), offload)
        sharded = chunk_sharded_tensor(value, state.rank, state.world_size, state.process_group)
        return sharded.cpu() if offload else sharded

    def pre_load(
        self, state: FSDPState, state_dict: dict[str, Any], prefix: str
    ) -> SummonedUnit | None:
        # Every rank gathers the same parameters in the same (flat) order.
        keys = _UnitKeys(state, prefix)
        for key, index in zip(keys.params, keys.param_indices):
            value = state_dict.get(key)
            if isinstance(value, (ShardedTensor, DTensor)):
                state_dict[key] = _loaded(value, state, index)
            elif isinstance(value, Tensor) and value.dim() > 0 and not _saves_dtensors(state):
                raise AssertionError(f"Expected ShardedTensor, got {type(value)}")  # torch's
        return super().pre_load(state, state_dict, prefix)


def _loaded(value: Tensor, state: FSDPState, index: int) -> Tensor:
    """A sharded value gathered for the unit's parameter ``index`` (see [Note: The
    three state-dict types] and [Note: Tensor-parallel parameters])."""
    extension = _extension(state)
    if extension is None:
        return full_tensor(value, state.compute_device)
    handle = state.handle
    assert handle is not None
    param_extension = handle._param_extensions[index]
    shape = handle.layout.shapes[index]
    local = extension.gather(value, shape, param_extension, state.compute_device)
    return DTensorExtensions.unflatten(local, param_extension)


class _LocalStateDict(_Kind):
    def post_save(
        self,
        state: FSDPState,
        unit: SummonedUnit | None,
        settings: _Settings,
        state_dict: dict[str, Any],
        prefix: str,
    ) -> None:
        _strip_wrapper_prefix(state_dict, prefix)
        if state.handle is not None:
            value = _flat_shard(state)
            state_dict[prefix + FLAT_PARAM] = (
                value.cpu() if settings.config.offload_to_cpu else value
            )

    def pre_load(
        self, state: FSDPState, state_dict: dict[str, Any], prefix: str
    ) -> SummonedUnit | None:
        handle = state.handle
        key = prefix + FLAT_PARAM
        if handle is not None:
            if key not in state_dict:
                raise AssertionError(
                    "No `FlatParameter` in `state_dict` for this FSDP instance but it has "
                    "parameters"
                )
            if not isinstance(state_dict[key], ShardedTensor):
                raise AssertionError("Tensors in local_state_dict should be ShardedTensor.")
            handle.load_local_shard(_local_shard_to_load(state_dict[key], state))
            del state_dict[key]
        _insert_wrapper_prefix(state, state_dict, prefix)
        return None


_KINDS: dict[StateDictType, _Kind] = {
    StateDictType.FULL_STATE_DICT: _FullStateDict(),
    StateDictType.SHARDED_STATE_DICT: _ShardedStateDict(),
    StateDictType.LOCAL_STATE_DICT: _LocalStateDict(),
}


class StateDictHooks:
    """The four state-dict hooks of one unit; the unit's state-dict type picks
    what they do."""

    state: FSDPState
    _load_prefix: str
    _settings: _Settings | None  # between a pre-hook and its post-hook
    _unit: SummonedUnit | None  # likewise, when the pre-hook summoned the unit

    def __init__(self, state: FSDPState) -> None:
        self.state = state
        self._load_prefix = ""
        self._settings = None
        self._unit = None

    def register(self, module: nn.Module) -> None:
        # torch tags hook objects with attributes: hand it partials, not bound methods
        module.register_state_dict_pre_hook(functools.partial(StateDictHooks.pre_save, self))
        module.register_state_dict_post_hook(functools.partial(StateDictHooks.post_save, self))
        module.register_load_state_dict_pre_hook(functools.partial(StateDictHooks.pre_load, self))
        module.register_load_state_dict_post_hook(functools.partial(StateDictHooks.post_load, self))

    def _begin(self, module: nn.Module, loading: bool) -> _Kind:
        _warn_if_no_shard(self.state, loading)
        ensure_initialized(module)
        _use_dtensor_with_mesh(self.state)
        self._settings = _Settings.of(self.state)
        return _KINDS[self._settings.kind]

    def _end(self, loading: bool) -> tuple[_Kind, _Settings, SummonedUnit | None]:
        _warn_if_no_shard(self.state, loading)
        settings, unit = self._settings, self._unit
        assert settings is not None, "state-dict post-hook without its pre-hook"
        self._settings, self._unit = None, None
        return _KINDS[settings.kind], settings, unit

    @torch.no_grad()
    def pre_save(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        kind = self._begin(module, loading=False)
        assert self._settings is not None
        self._unit = kind.pre_save(self.state, self._settings)

    @torch.no_grad()
    def post_save(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
    ) -> None:
        kind, settings, unit = self._end(loading=False)
        kind.post_save(self.state, unit, settings, state_dict, prefix)

    @torch.no_grad()
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
        kind = self._begin(module, loading=True)
        self._load_prefix = prefix
        self._unit = kind.pre_load(self.state, state_dict, prefix)

    def post_load(self, module: nn.Module, incompatible_keys: Any) -> None:
        kind, _, unit = self._end(loading=True)
        kind.post_load(unit)
        # A local state dict's flat shard was loaded (and removed) by the pre-hook.
        loaded = clean_tensor_name(self._load_prefix + FLAT_PARAM)
        missing = [clean_tensor_name(k) for k in incompatible_keys.missing_keys]
        incompatible_keys.missing_keys[:] = [k for k in missing if k != loaded]
        incompatible_keys.unexpected_keys[:] = [
            clean_tensor_name(k) for k in incompatible_keys.unexpected_keys
        ]
