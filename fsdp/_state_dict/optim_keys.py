"""Optimizer state dicts: the three forms, and the keys every rank gives the
model's parameters.

[Note: Three forms of optimizer state]
- Local (flattened): what ``optim.state_dict()`` returns on a rank. Keys are the
  optimizer's integer parameter IDs (its param-group order, which may differ by
  rank). The tensor states of a unit's parameter have the shape of what the
  optimizer steps on: the flat parameter's padded shard (``use_orig_params=False``)
  or the original parameter's 1-D part of the shard, maybe empty
  (``use_orig_params=True``); under ``NO_SHARD`` the whole flat or original
  parameter. Each group's "params" lists IDs.
- Full (unflattened): keyed by parameter FQN, the keys of the model's
  ``FULL_STATE_DICT`` (no wrapper prefixes). Positive-dimension tensor states
  have the original parameter's shape; 0-dim tensor states (Adam's "step") and
  non-tensor states (floats, None) are as the optimizer keeps them. A group's
  "params" lists FQNs (a flat parameter expands to its original FQNs in flat
  order). Parameters outside every unit (ignored, or under no unit) keep their
  state, keyed by FQN too. Full dicts are offloaded to the CPU by default.
- Sharded: the full form in which each positive-dimension tensor state of a
  unit's parameter is a ``ShardedTensor`` (or, with the config's
  ``_use_dtensor``, a ``DTensor``) chunked by rows over the unit's process group
  as ``torch.chunk`` splits it: each rank keeps its rows.

[Note: Keys every rank agrees on]
IDs name different parameters on ranks whose optimizers got the parameters in
different orders, so conversions work on ``OptimStateKey`` s: the FQNs a
parameter stands for (one, or a flat parameter's originals) and whether a unit
manages it. Every rank must run the same collectives in the same order. With
``use_orig_params=False`` every rank has state for a flat parameter that has
state anywhere, so all follow rank 0's keys (broadcast), and a rank missing one
of them is an error: it would have no shard to contribute. With
``use_orig_params=True`` a rank has no state for an original parameter with no
elements in its shard (the optimizer never saw a gradient there), so the keys
are the union over ranks, sorted, and a missing state contributes nothing.

[Note: Parameters the optimizer holds and the model does not list]
Parameters are named by ``named_parameters()`` at call time, as torch's FSDP
names them, so an optimizer may hold a ``Parameter`` the model no longer lists:
one the user set (``setattr(module, name, nn.Parameter(...))``) that FSDP did not
keep, or one that was replaced after the optimizer was built. FSDP keeps a new
object only where it writes it back: with ``use_orig_params=False`` never (the
next forward shows the flat parameter's view under the name again), with
``use_orig_params=True`` on the ranks whose shard holds elements of it (elsewhere
the old, empty parameter comes back). Torch's outcomes, which ours keep: a save
raises ``KeyError`` (the parameter) for such a parameter with state before any
collective, or else when naming the param groups, after every collective; a
load raises ``AssertionError`` after its collectives when the optimizer holds
more parameters than the model lists, or else ``KeyError`` (the name) for a
saved group's name that no parameter of the optimizer stands for. Whether a
rank fails depends on its shard, so ranks may differ.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from fsdp._common import clean_tensor_name
from fsdp._runtime import FSDPState
from fsdp._state_dict.optim_unit import UnitLayout
from fsdp._unshard_params import states_in

OptimInput = Iterable[nn.Parameter] | list[dict[str, Any]] | None
OSD = dict[str, Any]
ParamKey = int | str


class OptimStateKey(NamedTuple):
    """A parameter as every rank names it (see [Note: Keys every rank agrees on])."""

    fqns: tuple[str, ...]
    managed: bool


class ModelParams:
    """A model's parameters as optimizer state dicts name them: each parameter
    (a flat parameter, an original parameter, or one outside every unit) once,
    in model order, with the FQNs it stands for."""

    units: list[UnitLayout]
    fqns: dict[nn.Parameter, tuple[str, ...]]
    names: dict[nn.Parameter, str]  # the name ``named_parameters()`` gives first
    unit_of: dict[str, UnitLayout]  # a managed original parameter's FQN -> its unit
    use_orig_params: bool

    def __init__(self, model: nn.Module) -> None:
        paths = {id(module): name for name, module in model.named_modules()}
        self.units = [_unit_layout(s, paths) for s in states_in(model, recurse=True) if s.handle]
        flat_units = {id(u.handle.flat_param): u for u in self.units}
        self.fqns, self.names = {}, {}
        for name, param in model.named_parameters(remove_duplicate=False):
            if param in self.fqns:
                continue
            unit = flat_units.get(id(param))
            self.fqns[param] = unit.fqns if unit is not None else (clean_tensor_name(name),)
            self.names[param] = name
        self.unit_of = {fqn: unit for unit in self.units for fqn in unit.fqns}
        modes = {unit.state.config.use_orig_params for unit in self.units}
        if len(modes) > 1:
            raise AssertionError("Not all FSDP modules have the same _use_orig_params value")
        self.use_orig_params = modes == {True}

    def require_units(self) -> None:
        if not self.units:
            raise ValueError("No FSDP modules found in the given module")

    @property
    def device(self) -> torch.device:
        """Where object collectives over a caller's group run."""
        return self.units[0].device

    def key(self, param: nn.Parameter) -> OptimStateKey:
        fqns = self.fqns[param]
        return OptimStateKey(fqns, fqns[0] in self.unit_of)

    def optimizer_keys(self, optim: torch.optim.Optimizer, named: bool) -> dict[ParamKey, Any]:
        """The optimizer's parameter keys (IDs in param-group order, or names for a
        named optimizer) and the parameters they stand for."""
        keys: dict[ParamKey, Any] = {}
        for group in optim.param_groups:
            for param in group["params"]:
                keys[self.names[param] if named else len(keys)] = param
        return keys

    def input_keys(self, model: nn.Module, optim_input: OptimInput) -> dict[ParamKey, Any]:
        """The IDs an optimizer built from ``optim_input`` (parameters, or groups;
        None: ``model.parameters()``) gives its parameters."""
        if optim_input is None:
            return dict(enumerate(model.parameters()))
        try:
            items = list(optim_input)
        except TypeError as e:
            raise TypeError(
                f"Optimizer input should be an iterable of Tensors or dicts, but got {optim_input}"
            ) from e
        if not items:
            raise ValueError("Optimizer input should not be empty")
        if all(isinstance(item, Tensor) for item in items):
            return dict(enumerate(items))
        if not all(isinstance(item, dict) for item in items):
            raise TypeError("Optimizer input should be an iterable of Tensors or dicts")
        return dict(enumerate(p for group in items for p in group["params"]))


def _unit_layout(state: FSDPState, paths: dict[int, str]) -> UnitLayout:
    handle = state.handle
    assert handle is not None
    fqns = tuple(
        clean_tensor_name(f"{paths[id(info.module)]}.{info.param_name}".lstrip("."))
        for info in handle.param_infos()
    )
    return UnitLayout(state, handle, fqns)


class KeySource(NamedTuple):
    """Where parameter keys come from: the optimizer, or the deprecated ``optim_input``."""

    optim: torch.optim.Optimizer | None
    optim_input: OptimInput
    use_optim_input: bool

    @classmethod
    def of(cls, optim: torch.optim.Optimizer | None, optim_input: OptimInput) -> KeySource:
        return cls(optim, optim_input, optim_input is not None or optim is None)

    def keys(self, params: ModelParams, model: nn.Module, named: bool) -> dict[ParamKey, Any]:
        if self.use_optim_input:
            return params.input_keys(model, self.optim_input)
        assert self.optim is not None
        return params.optimizer_keys(self.optim, named)


def is_named_optimizer_state(osd: OSD) -> bool:
    """Whether ``osd`` keys its state by names (``_NamedOptimizer``, TorchRec's
    ``KeyedOptimizer``) instead of IDs."""
    state = osd.get("state")
    return bool(state) and isinstance(next(iter(state)), str)


def _get_param_to_fqns(
    model: nn.Module, dedup_shared_params: bool = True
) -> dict[nn.Parameter, list[str]]:
    """torch's name: each parameter of ``model`` with the FQNs it stands for (a
    flat parameter: its original parameters', in flat order; no wrapper prefixes).
    A parameter registered under several names keeps its first one, or, without
    ``dedup_shared_params``, all of them."""
    params = ModelParams(model)
    out = {param: list(fqns) for param, fqns in params.fqns.items()}
    if not dedup_shared_params:
        flat = {id(unit.handle.flat_param) for unit in params.units}
        for name, param in model.named_parameters(remove_duplicate=False):
            fqn = clean_tensor_name(name)
            if id(param) not in flat and fqn not in out[param]:
                out[param].append(fqn)
    return out


def check_same_use_orig_params(model: nn.Module) -> None:
    """Torch's check before anything else in the optimizer state-dict calls (the
    lazy initialisation included, whose check of the same attribute raises
    another error)."""
    if len({state.config.use_orig_params for state in states_in(model, recurse=True)}) > 1:
        raise AssertionError("Not all FSDP modules have the same _use_orig_params value")
