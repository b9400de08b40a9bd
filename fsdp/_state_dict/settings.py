"""Which state-dict type and config a unit's hooks apply, and when a device mesh
changes them.

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

[Note: NO_SHARD units save full state dicts]
As in torch, a ``NO_SHARD`` unit (also a sharded strategy at world size 1,
which becomes ``NO_SHARD``) saves and loads ``FULL_STATE_DICT`` with the
default config, whatever type and config are set, and warns that it does so in
each of its four hooks (twice per save and twice per load, with torch's texts):
there is nothing to shard, and ``rank0_only`` / ``offload_to_cpu`` do not apply.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import NamedTuple

from fsdp._runtime import FSDPState
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


def use_dtensor_with_mesh(state: FSDPState) -> None:
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
            state.set_state_dict_settings(new)


class Settings(NamedTuple):
    """The type and config a unit's hooks apply (see [Note: NO_SHARD units save
    full state dicts])."""

    kind: StateDictType
    config: StateDictConfig

    @classmethod
    def of(cls, state: FSDPState) -> Settings:
        if state.config.sharding_strategy is not ShardingStrategy.NO_SHARD:
            return cls(state.state_dict_type, state.state_dict_config)
        return cls(StateDictType.FULL_STATE_DICT, FullStateDictConfig())

    @property
    def rank0_only(self) -> bool:
        return isinstance(self.config, FullStateDictConfig) and self.config.rank0_only


def warn_if_no_shard(state: FSDPState, loading: bool) -> None:
    """Each of a ``NO_SHARD`` unit's four hooks warns (see [Note: NO_SHARD units
    save full state dicts])."""
    if state.config.sharding_strategy is ShardingStrategy.NO_SHARD:
        text = _NO_SHARD_LOAD_WARNING if loading else _NO_SHARD_SAVE_WARNING
        warnings.warn(text, stacklevel=5)
