"""State dicts of FSDP units: hooks that make ``state_dict()`` / ``load_state_dict()``
speak the unwrapped module's names.

[Note: Full state dicts through module hooks]
``nn.Module.state_dict`` recurses through children, calling each module's hooks.
Each unit registers four hooks:

- state_dict pre-hook: unshard in full precision and expose the original
  parameters (as for summon_full_params), hide the flat parameter;
- state_dict post-hook: drop the wrapper prefix from the keys under this unit,
  clone the parameter entries (they are views into storage that is freed next),
  restore buffers to their original dtypes, apply ``offload_to_cpu`` /
  ``rank0_only``, then reshard;
- load pre-hook: unshard and expose the original parameters, and insert the
  wrapper prefix into the keys under this unit so they reach them;
- load post-hook: write the loaded values back into the shard, reshard, and
  drop the flat parameter from the missing keys.
Nested units do the same for their own keys while the enclosing unit is
unsharded, so every key is cleaned exactly once.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn

from fsdp._common import FLAT_PARAM, FSDP_PREFIX, HandleTrainingState, TrainingState, clean_tensor_name
from fsdp._runtime import FSDPState
from fsdp._unshard_params import ensure_initialized
from fsdp.api import FullStateDictConfig, StateDictType


def _check_supported(state: FSDPState) -> None:
    if state.state_dict_type is not StateDictType.FULL_STATE_DICT:
        raise NotImplementedError(f"{state.state_dict_type} is not supported yet")


def _unshard_for_checkpoint(state: FSDPState) -> None:
    state.training_state = TrainingState.SUMMON_FULL_PARAMS
    handle = state.handle
    if handle is None:
        return
    handle._training_state = HandleTrainingState.SUMMON_FULL_PARAMS
    handle.set_force_full_precision(True)
    state.unshard(handle)
    state.wait_for_unshard(handle)
    state.hide_flat_param()
    handle._use_unsharded_views(as_params=True)


def _reshard_after_checkpoint(state: FSDPState, writeback: bool) -> None:
    handle = state.handle
    try:
        if handle is None:
            return
        if writeback:
            handle.writeback_unsharded()
        if not handle._use_orig_params:
            handle._use_unsharded_views(as_params=False)
        state.reshard(handle, free=True)
        state.show_flat_param()
        handle.set_force_full_precision(False)
        handle._training_state = HandleTrainingState.IDLE
    finally:
        state.training_state = TrainingState.IDLE


class StateDictHooks:
    """The four hooks of one unit (see the module note)."""

    state: FSDPState

    def __init__(self, state: FSDPState) -> None:
        self.state = state

    def register(self, module: nn.Module) -> None:
        # torch tags hook objects with attributes: hand it partials, not bound methods
        module.register_state_dict_pre_hook(functools.partial(StateDictHooks.pre_state_dict, self))
        module.register_state_dict_post_hook(functools.partial(StateDictHooks.post_state_dict, self))
        module.register_load_state_dict_pre_hook(functools.partial(StateDictHooks.pre_load, self))
        module.register_load_state_dict_post_hook(functools.partial(StateDictHooks.post_load, self))

    def pre_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        _check_supported(self.state)
        ensure_initialized(module)
        _unshard_for_checkpoint(self.state)

    def post_state_dict(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
    ) -> None:
        state = self.state
        config = state.state_dict_config
        assert isinstance(config, FullStateDictConfig)
        drop = config.rank0_only and state.rank != 0
        buffer_dtypes = self._buffer_dtypes(prefix)
        for key in [k for k in state_dict if k.startswith(prefix)]:
            value = state_dict.pop(key)
            if drop or key == prefix + FLAT_PARAM:
                continue
            clean = prefix + clean_tensor_name(key[len(prefix) :])
            state_dict[clean] = self._checkpoint_value(value, buffer_dtypes.get(clean), config)
        _reshard_after_checkpoint(state, writeback=False)

    def _buffer_dtypes(self, prefix: str) -> dict[str, torch.dtype]:
        """Original dtypes of this unit's buffers, by their clean state-dict key."""
        state = self.state
        names = {id(m): n for n, m in state.module.named_modules()}
        dtypes = {}
        for module, name in state.buffers:
            dtype = state.orig_buffer_dtypes.get((id(module), name))
            if dtype is not None and id(module) in names:
                path = f"{names[id(module)]}.{name}".lstrip(".")
                dtypes[prefix + clean_tensor_name(path)] = dtype
        return dtypes

    def _checkpoint_value(
        self, value: Any, dtype: torch.dtype | None, config: FullStateDictConfig
    ) -> Any:
        if not isinstance(value, Tensor):
            return value
        value = value.detach().clone() if dtype is None else value.detach().to(dtype, copy=True)
        return value.cpu() if config.offload_to_cpu else value

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
        _check_supported(self.state)
        ensure_initialized(module)
        _unshard_for_checkpoint(self.state)
        for key in [k for k in state_dict if k.startswith(prefix)]:
            rest = key[len(prefix) :]
            if not rest.startswith(FSDP_PREFIX):
                state_dict[prefix + FSDP_PREFIX + rest] = state_dict.pop(key)

    def post_load(self, module: nn.Module, incompatible_keys: Any) -> None:
        missing = incompatible_keys.missing_keys
        missing[:] = [k for k in missing if not k.endswith(FLAT_PARAM)]
        _reshard_after_checkpoint(self.state, writeback=True)
