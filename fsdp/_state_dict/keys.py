"""The keys of a unit's entries in a module state dict: its parameters' and
buffers' clean names, and the wrapper prefix taken off on save and put back on load
(see [Note: State dicts through module hooks] in fsdp._state_dict.hooks).

[Note: Buffers in full and sharded state dicts]
As torch's: with ``offload_to_cpu`` every buffer of the unit's subtree goes to
the CPU; a unit with buffer mixed precision saves every buffer of its subtree
that some unit manages (ignored ones excepted) as a copy in its original dtype
(its dtype when the unit was built; buffers live in ``buffer_dtype`` from lazy
initialisation on). Otherwise the
entries are the module's own tensors. Names come from ``named_buffers()``: the
second name of a module registered twice is left as the module saves it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fsdp._common import FLAT_PARAM, FSDP_PREFIX, FSDP_WRAPPED_MODULE, clean_tensor_name
from fsdp._runtime import FSDPState
from fsdp._utils import _replace_by_prefix


def _key(prefix: str, module_name: str, name: str) -> str:
    return prefix + clean_tensor_name(f"{module_name}.{name}".lstrip("."))


class UnitKeys:
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


def strip_wrapper_prefix(state_dict: dict[str, Any], prefix: str) -> None:
    """Drops the wrapper prefixes from the keys under ``prefix``."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        clean = prefix + clean_tensor_name(key[len(prefix) :])
        if clean != key:
            state_dict[clean] = state_dict.pop(key)


def insert_wrapper_prefix(state: FSDPState, state_dict: dict[str, Any], prefix: str) -> None:
    """Inserts the wrapper prefix into the keys under ``prefix`` (wrappers only)."""
    if _is_wrapper(state):
        _replace_by_prefix(state_dict, prefix, prefix + FSDP_PREFIX)


def save_buffers(
    state: FSDPState, keys: UnitKeys, state_dict: dict[str, Any], offload_to_cpu: bool
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


def drop_unit_entries(keys: UnitKeys, state_dict: dict[str, Any], prefix: str) -> None:
    """``rank0_only`` on other ranks: the unit's parameters and buffers go."""
    for key in (*keys.params, *keys.buffers, prefix + FLAT_PARAM):
        state_dict.pop(key, None)


def check_saved(
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
