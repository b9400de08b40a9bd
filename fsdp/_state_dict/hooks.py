"""The four state-dict hooks of a unit: ``state_dict()`` / ``load_state_dict()``
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
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from fsdp._common import FLAT_PARAM, clean_tensor_name
from fsdp._runtime import FSDPState
from fsdp._state_dict.kinds import KINDS, Kind
from fsdp._state_dict.settings import Settings, use_dtensor_with_mesh, warn_if_no_shard
from fsdp._unshard_params import SummonedUnit, ensure_initialized


class StateDictHooks:
    """The four state-dict hooks of one unit; the unit's state-dict type picks
    what they do."""

    state: FSDPState
    _load_prefix: str
    _settings: Settings | None  # between a pre-hook and its post-hook
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

    def _begin(self, module: nn.Module, loading: bool) -> Kind:
        warn_if_no_shard(self.state, loading)
        ensure_initialized(module)
        use_dtensor_with_mesh(self.state)
        self._settings = Settings.of(self.state)
        return KINDS[self._settings.kind]

    def _end(self, loading: bool) -> tuple[Kind, Settings, SummonedUnit | None]:
        warn_if_no_shard(self.state, loading)
        settings, unit = self._settings, self._unit
        assert settings is not None, "state-dict post-hook without its pre-hook"
        self._settings, self._unit = None, None
        return KINDS[settings.kind], settings, unit

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
