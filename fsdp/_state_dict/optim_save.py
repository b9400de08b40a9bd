"""Saving optimizer state: a rank's local optimizer state dict into the full or
sharded form (see [Note: Three forms of optimizer state] in
fsdp._state_dict.optim_keys)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch import nn

from fsdp import _comm
from fsdp._state_dict.optim_keys import (
    OSD,
    KeySource,
    ModelParams,
    OptimStateKey,
    ParamKey,
    check_same_use_orig_params,
    is_named_optimizer_state,
)
from fsdp._state_dict.optim_unit import SaveForm, UnitLayout
from fsdp._unshard_params import ensure_initialized

_MISSING_STATES = (
    "FSDP currently requires each rank to have at least the optimizer states needed by rank "
    "0's optimizer but some ranks are missing some of those states"
)


class _Saver:
    """One conversion of a local optimizer state dict into the full or sharded
    form (see [Note: Three forms of optimizer state])."""

    params: ModelParams
    osd: OSD
    keys: dict[ParamKey, Any]
    local: dict[OptimStateKey, ParamKey]
    group: Any
    to_save: bool
    form: SaveForm

    def __init__(
        self,
        model: nn.Module,
        osd: OSD,
        source: KeySource,
        group: Any,
        to_save: bool,
        form: SaveForm,
    ) -> None:
        self.params = ModelParams(model)
        self.params.require_units()
        self.osd = osd
        self.keys = source.keys(self.params, model, is_named_optimizer_state(osd))
        self.local = {
            self.params.key(param): key for key, param in self.keys.items() if key in osd["state"]
        }
        self.group = group
        self.to_save = to_save
        self.form = form

    def agreed_keys(self) -> list[OptimStateKey]:
        """See [Note: Keys every rank agrees on]."""
        device = self.params.device
        if self.params.use_orig_params:
            every = _comm.all_gather_object(list(self.local), self.group, device)
            return sorted({key for keys in every for key in keys})
        keys = _comm.broadcast_object(list(self.local), 0, self.group, device)
        missing = _comm.all_gather_object(
            [k for k in keys if k not in self.local], self.group, device
        )
        if any(missing):
            lines = [
                f"\nRank {rank} is missing states for the parameters: {[k.fqns for k in lacking]}"
                for rank, lacking in enumerate(missing)
                if lacking
            ]
            raise RuntimeError(_MISSING_STATES + "".join(lines))
        return keys

    def state(self) -> dict[str, Any]:
        keys = self.agreed_keys()
        if self.params.use_orig_params:
            return self._orig_param_state(keys)
        return self._flat_param_state(keys)

    def _flat_param_state(self, keys: list[OptimStateKey]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in keys:
            local = self.osd["state"][self.local[key]]
            if key.managed:
                unit = self.params.unit_of[key.fqns[0]]
                out.update(zip(key.fqns, unit.gather_flat_state(local, self.to_save, self.form)))
            elif self.to_save:
                out[key.fqns[0]] = self.form.unmanaged(local)
        return out

    def _orig_param_state(self, keys: list[OptimStateKey]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        per_unit: dict[UnitLayout, dict[str, dict[str, Any]]] = {}
        for key in keys:
            local_key = self.local.get(key)
            fqn = key.fqns[0]
            unit = self.params.unit_of.get(fqn)
            if key.managed and unit is not None:
                state = {} if local_key is None else self.osd["state"][local_key]
                per_unit.setdefault(unit, {})[fqn] = state
            elif not key.managed and local_key is not None and self.to_save:
                out[fqn] = self.form.unmanaged(self.osd["state"][local_key])
        for unit, states in per_unit.items():
            out.update(unit.gather_orig_states(states, self.to_save, self.form))
        return out

    def unrecognized(self, state: dict[str, Any]) -> None:
        """State under keys that name no parameter is copied as it is."""
        for key, value in self.osd["state"].items():
            if key in state or key in self.keys:
                continue
            warnings.warn(
                f"Found a optim state, {key}, that FSDP cannot process. FSDP will directly copy "
                "everything to the returned state_dict. In most cases, this is a user-defined "
                "state that is not associated with any particular parameter.",
                stacklevel=4,
            )
            state[key] = value

    def param_groups(self) -> list[dict[str, Any]]:
        # KeyError for a parameter the model does not list, after every collective, as
        # torch's (see [Note: Parameters the optimizer holds and the model does not list])
        groups = []
        for group in self.osd["param_groups"]:
            new = copy.deepcopy(group)
            new["params"] = [
                fqn for key in group["params"] for fqn in self.params.fqns[self.keys[key]]
            ]
            groups.append(new)
        return groups


@torch.no_grad()
def optim_state_dict(
    model: nn.Module,
    osd: OSD,
    source: KeySource,
    rank0_only: bool,
    form: SaveForm,
    group: Any,
) -> OSD:
    """The full (or, with ``form.shard``, sharded) form of the local optimizer state
    dict ``osd``; {} on ranks other than 0 under ``rank0_only``, which still take
    part in every collective."""
    check_same_use_orig_params(model)
    ensure_initialized(model)
    group = group or _comm.world()
    to_save = not rank0_only or group.rank() == 0 or form.shard
    saver = _Saver(model, osd, source, group, to_save, form)
    state = saver.state()
    if not to_save:
        return {}
    saver.unrecognized(state)
    out: OSD = {"state": state}
    if "param_groups" in osd:
        out["param_groups"] = saver.param_groups()
    return out
