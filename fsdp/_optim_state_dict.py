"""Optimizer state dicts of models with FSDP units: between the state each rank's
optimizer holds and state keyed by parameter name.

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

[Note: Gathering a flat parameter's state]
(``use_orig_params=False``.) A positive-dimension state has the padded shard's
shape: all-gathering it gives the padded flat tensor; without the padding it is
split into views of the original parameters' shapes, as the flat parameter is.
0-dim and non-tensor states are one value for the whole flat parameter; each
original parameter gets it.

[Note: Gathering original parameters' states]
(``use_orig_params=True``.) Ranks first exchange, per parameter, which states
they have (shapes, dtypes) and their 0-dim and non-tensor values. Then, per
state name, each rank writes the parts it holds into a zeroed buffer of its
shard's size at the parts' offsets in the shard, and all-gathering the buffers
rebuilds the unit's flat layout, whose views are the full states. Each state
gets its own buffer: the returned views must not be overwritten. 0-dim and
non-tensor values come from the ranks holding elements of the parameter: a
rank whose part is empty may have stepped it fewer times.

[Note: Flattening for loading]
The way back, per model parameter in model order. ``use_orig_params=False``: a
flat parameter's positive-dimension state is its originals' states
concatenated in flat order (zeros for an original without state), then this
rank's shard of it; 0-dim and non-tensor states must be present and equal for
every original (Adam's "step" cannot be made up for one that has none).
``use_orig_params=True``: each original parameter gets the part of its
flattened state that this rank's shard holds, or nothing when it holds no
elements. Sharded values are gathered first, over the group they are chunked
over (so a sharded dict also loads into another wrapping, for parameters that
are outside every unit there too). Parameters outside every unit keep their
state. Finally keys become the local
optimizer's IDs and each saved group's "params" the sorted IDs of its FQNs; a
saved group's hyperparameters are kept.

[Note: Rank-0-only loading]
Only rank 0 has the dict. It broadcasts the dict's skeleton, every
positive-dimension tensor replaced by its shape and dtype, then each of those
tensors in torch's order: the parameters' state in model order (each FQN's values
in its state's order), then any other tensor in skeleton order. Every rank, rank
0 too, keeps the broadcast tensors, on the device (as torch), then flattens its
own part.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.distributed._shard.sharded_tensor import (
    ShardedTensor,
)
from torch.distributed.tensor import DTensor
from torch.utils._pytree import (
    tree_flatten,
    tree_flatten_with_path,
    tree_map_only,
    tree_unflatten,
)

from fsdp import _comm
from fsdp._common import clean_tensor_name
from fsdp._dtensor_extensions import DTensorExtensions
from fsdp._flat_param import FlatParamHandle
from fsdp._layout import FlatParamLayout
from fsdp._runtime import FSDPState
from fsdp._shard_utils import chunk_dtensor, chunk_sharded_tensor, full_tensor
from fsdp._state_dict import _mesh
from fsdp._unshard_params import ensure_initialized, states_in
from fsdp.api import OptimStateKeyType

OptimInput = Iterable[nn.Parameter] | list[dict[str, Any]] | None
OSD = dict[str, Any]
ParamKey = int | str

_MISSING_STATES = (
    "FSDP currently requires each rank to have at least the optimizer states needed by rank "
    "0's optimizer but some ranks are missing some of those states"
)
_SCALAR_MISMATCH = (
    "All unflattened parameters comprising a single flat parameter must have scalar state "
    "with the same value and dtype"
)


class OptimStateKey(NamedTuple):
    """A parameter as every rank names it (see [Note: Keys every rank agrees on])."""

    fqns: tuple[str, ...]
    managed: bool


@dataclass(frozen=True)
class _TensorMeta:
    """A positive-dimension tensor in rank 0's skeleton (a pytree leaf)."""

    shape: torch.Size
    dtype: torch.dtype


class _StateInfo(NamedTuple):
    """One rank's state of one parameter, without tensor data."""

    tensors: dict[str, tuple[torch.Size, torch.dtype]]
    scalars: dict[str, Any]  # 0-dim tensors (on the CPU) and non-tensors

    @classmethod
    def of(cls, state: dict[str, Any]) -> _StateInfo:
        tensors, scalars = {}, {}
        for name, value in _sorted_items(state):
            if _is_pos_dim(value):
                tensors[name] = (value.shape, value.dtype)
            else:
                scalars[name] = value.cpu() if torch.is_tensor(value) else value
        return cls(tensors, scalars)

    def has_elements(self) -> bool:
        return any(shape.numel() > 0 for shape, _ in self.tensors.values())


def _is_pos_dim(value: Any) -> bool:
    return torch.is_tensor(value) and value.dim() > 0


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


def _sorted_items(state: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """By state name: every rank issues its collectives in this order."""
    yield from sorted(state.items(), key=lambda item: item[0])


class SaveForm(NamedTuple):
    """How the full tensor states of a unit's parameters leave a save."""

    shard: bool  # the sharded form: ShardedTensor / DTensor rows
    offload: bool  # to the CPU

    def tensor(self, value: Tensor, unit: UnitLayout, index: int) -> Any:
        """The full state ``value`` of the unit's parameter ``index`` as saved."""
        if self.shard:
            return unit.sharded_rows(value, self.offload, index)
        value = unit.as_param_sees(value, index)
        return value.cpu() if self.offload else value

    def scalar(self, value: Any) -> Any:
        return value.cpu() if self.offload and torch.is_tensor(value) else value

    def unmanaged(self, state: dict[str, Any]) -> dict[str, Any]:
        """A parameter outside every unit: its state as the optimizer has it."""
        return {name: self.scalar(value) for name, value in state.items()}


class UnitLayout:
    """One unit's flat parameter as optimizer state sees it: the global FQNs of
    its original parameters (flat order), where each lies in the flat parameter
    and in this rank's shard (see [Note: Flat parameter layout]), and the
    collectives over the unit's group that move its states."""

    state: FSDPState
    handle: FlatParamHandle
    fqns: tuple[str, ...]
    _index: dict[str, int]

    def __init__(self, state: FSDPState, handle: FlatParamHandle, fqns: tuple[str, ...]) -> None:
        self.state = state
        self.handle = handle
        self.fqns = fqns
        self._index = {fqn: i for i, fqn in enumerate(fqns)}

    @property
    def group(self) -> Any:
        return self.state.process_group

    @property
    def rank(self) -> int:
        return self.state.rank

    @property
    def world_size(self) -> int:
        return self.state.world_size

    @property
    def device(self) -> torch.device:
        return self.state.compute_device

    @property
    def sharded(self) -> bool:
        """Whether each rank holds only part of the flat parameter."""
        return self.handle.uses_sharded_strategy and self.world_size > 1

    def index(self, fqn: str) -> int:
        return self._index[fqn]

    @property
    def _flat(self) -> FlatParamLayout:
        """The handle's layout (offsets, numels, shapes, total_numel): the one place
        this module reads it."""
        return self.handle.layout

    # -- the flat layout -------------------------------------------------------------

    def unflatten(self, flat: Tensor) -> list[Tensor]:
        """Views of the original parameters' shapes into an unpadded flat tensor."""
        layout = self._flat
        return [
            flat[offset : offset + numel].view(shape)
            for offset, numel, shape in zip(layout.offsets, layout.numels, layout.shapes)
        ]

    def flatten(self, tensors: list[Tensor | None], dtype: torch.dtype) -> Tensor:
        """The unpadded flat tensor of per-parameter tensors (zeros for None)."""
        layout = self._flat
        device = next(t.device for t in tensors if t is not None)
        flat = torch.zeros(layout.total_numel, dtype=dtype, device=device)
        for tensor, offset, numel in zip(tensors, layout.offsets, layout.numels):
            if tensor is not None:
                flat[offset : offset + numel].copy_(tensor.reshape(-1))
        return flat

    def shard(self, flat: Tensor) -> Tensor:
        """This rank's padded shard of an unpadded flat tensor (a copy)."""
        if not self.sharded:
            return flat
        size = self.handle.shard_numel
        start = self.rank * size
        part = flat[start : min(start + size, flat.numel())]
        shard = flat.new_zeros(size)
        shard[: part.numel()].copy_(part)
        return shard

    def gather(self, shard: Tensor) -> Tensor:
        """The unpadded flat tensor from every rank's padded shard (a collective)."""
        if shard.numel() != self.handle.shard_numel:
            raise ValueError(
                f"Expected optimizer state of {self.handle.shard_numel} elements (the local "
                f"shard of the flat parameter of {list(self.fqns)}), got {tuple(shard.shape)}"
            )
        local = shard.detach().to(self.device).contiguous()
        full = local.new_empty(self.handle.padded_numel)
        _comm.all_gather(full, local, self.group)
        return full[: self.handle.unpadded_numel]

    def as_param_sees(self, value: Tensor, index: int) -> Tensor:
        """A full state of parameter ``index`` in the parameter's form: a DTensor
        for a tensor-parallel one (see [Note: Tensor-parallel parameters])."""
        return DTensorExtensions.unflatten(value, self.handle._param_extensions[index])

    def sharded_rows(self, value: Tensor, offload: bool, index: int) -> Tensor:
        """This rank's rows of a full tensor state of parameter ``index``, as the
        unit's optimizer state-dict config asks (ShardedTensor unless
        ``_use_dtensor``; a tensor-parallel unit's on the root mesh)."""
        config = self.state.state_dict_settings.optim_state_dict_config
        extension = self.handle._fsdp_extension
        if extension is not None:
            return extension.chunk(self.as_param_sees(value, index), offload)
        if getattr(config, "_use_dtensor", False):
            return chunk_dtensor(value, _mesh(self.state), offload)
        local = value.to("cpu") if offload else value
        return chunk_sharded_tensor(local, self.rank, self.world_size, self.group)

    # -- where the original parameters lie -------------------------------------------------

    def part(self, index: int, full: Tensor) -> Tensor | None:
        """This rank's 1-D part of original parameter ``index``'s full tensor state
        (what the optimizer steps on), or None when the rank holds none of it."""
        info = self.handle.flat_param._shard_param_infos[index]
        if not info.in_shard:
            return None
        if not self.handle.uses_sharded_strategy:
            return full
        start, end = info.intra_param_start_idx, info.intra_param_end_idx
        assert start is not None and end is not None
        return full.reshape(-1)[start : end + 1].clone()

    def shard_of_parts(self, parts: dict[int, Tensor], dtype: torch.dtype) -> Tensor:
        """A padded shard holding each original parameter's local part at its offset."""
        shard = torch.zeros(self.handle.shard_numel, dtype=dtype, device=self.device)
        infos = self.handle.flat_param._shard_param_infos
        for index, part in parts.items():
            offset, numel = infos[index].offset_in_shard, infos[index].numel_in_shard
            if offset is None or numel != part.numel():
                raise ValueError(
                    f"Optimizer state of {self.fqns[index]} has {part.numel()} elements, but "
                    f"this rank's shard holds {numel or 0} of the parameter"
                )
            shard[offset : offset + numel].copy_(part.reshape(-1))
        return shard

    # -- saving ------------------------------------------------------------------------------

    def gather_flat_state(
        self, state: dict[str, Any], to_save: bool, form: SaveForm
    ) -> list[dict[str, Any]]:
        """The full state of each original parameter from the flat parameter's
        state (``use_orig_params=False``, [Note: Gathering a flat parameter's state]);
        empty unless ``to_save`` (the collectives run regardless)."""
        flats, scalars = {}, {}
        for name, value in _sorted_items(state):
            if _is_pos_dim(value):
                flats[name] = self.gather(value) if self.sharded else value
            else:
                scalars[name] = value.detach().clone() if torch.is_tensor(value) else value
        if not to_save:
            return []
        views = {name: self.unflatten(flat) for name, flat in flats.items()}
        return [
            {
                **{name: form.tensor(v[i], self, i) for name, v in views.items()},
                **{name: form.scalar(value) for name, value in scalars.items()},
            }
            for i in range(len(self.fqns))
        ]

    def gather_orig_states(
        self, states: dict[str, dict[str, Any]], to_save: bool, form: SaveForm
    ) -> dict[str, dict[str, Any]]:
        """The full states of the original parameters ``states`` names, from each
        rank's local parts (``use_orig_params=True``, [Note: Gathering original
        parameters' states]); empty unless ``to_save``."""
        if not self.sharded:
            return self._local_orig_states(states, form) if to_save else {}
        infos: list[dict[str, _StateInfo]] = _comm.all_gather_object(
            {fqn: _StateInfo.of(state) for fqn, state in states.items()}, self.group, self.device
        )
        out = {fqn: self._merged_scalars(fqn, infos, form) for fqn in states}
        for name, dtype in _tensor_names(infos).items():
            parts = {
                self.index(fqn): state[name]
                for fqn, state in states.items()
                if _is_pos_dim(state.get(name)) and state[name].numel() > 0
            }
            views = self.unflatten(self.gather(self.shard_of_parts(parts, dtype)))
            for fqn in states:
                if any(name in info[fqn].tensors for info in infos if fqn in info):
                    out[fqn][name] = form.tensor(views[self.index(fqn)], self, self.index(fqn))
        return out if to_save else {}

    def _local_orig_states(
        self, states: dict[str, dict[str, Any]], form: SaveForm
    ) -> dict[str, dict[str, Any]]:
        """Unsharded: each rank's state is already full; as torch's, it is returned
        unsharded also in the sharded form."""
        return {fqn: form.unmanaged(state) for fqn, state in states.items()}

    def _merged_scalars(
        self, fqn: str, infos: list[dict[str, _StateInfo]], form: SaveForm
    ) -> dict[str, Any]:
        """``fqn``'s 0-dim and non-tensor states, from the ranks that hold elements
        of it (every rank when it has no positive-dimension state)."""
        ranked = [(r, info[fqn]) for r, info in enumerate(infos) if fqn in info]
        holders = [(r, i) for r, i in ranked if i.has_elements()]
        if not any(i.tensors for _, i in ranked):
            holders = ranked
        merged: dict[str, Any] = {}
        for rank, info in holders:
            for name, value in info.scalars.items():
                if name in merged and not _same(merged[name], value):
                    raise ValueError(
                        f"Rank {rank} has different values for {name} of {fqn}: {value}. "
                        f"Other ranks: {merged[name]}"
                    )
                merged[name] = value
        return {name: form.scalar(value) for name, value in merged.items()}

    # -- loading -----------------------------------------------------------------------------

    def gathered(self, fqn: str, state: dict[str, Any]) -> dict[str, Any]:
        """``fqn``'s state with sharded values gathered (collectives in state-name
        order); a tensor-parallel unit's values become the parameter's local form
        (see [Note: Tensor-parallel parameters])."""
        extension = self.handle._fsdp_extension
        if extension is None:
            return _gathered(state, self.device)
        index = self.index(fqn)
        param_extension = self.handle._param_extensions[index]
        shape = self._flat.shapes[index]
        out = dict(state)
        for name, value in _sorted_items(state):
            if isinstance(value, (ShardedTensor, DTensor)) and value.dim() > 0:
                out[name] = extension.gather(value, shape, param_extension, self.device)
        return out

    def flatten_state(self, states: list[dict[str, Any] | None]) -> dict[str, Any]:
        """The local state of the flat parameter from its original parameters' full
        states (None: no state), ``use_orig_params=False``; {} when none has any.
        See [Note: Flattening for loading]."""
        present = [s for s in states if s is not None]
        if not present:
            return {}
        names = list(present[0])
        for state in present[1:]:
            if set(state) != set(names):
                raise ValueError(
                    "Differing optimizer state names for the unflattened parameters: "
                    f"{list(self.fqns)}"
                )
        return {
            name: self._flatten_one(name, [None if s is None else s[name] for s in states])
            for name in names
        }

    def _flatten_one(self, name: str, values: list[Any]) -> Any:
        given = [v for v in values if v is not None]
        if not given:
            return None
        kinds = {_value_kind(v) for v in given}
        if len(kinds) != 1 or len({type(v) for v in given}) != 1:
            raise ValueError(
                f"Differing optimizer state types for state {name}, values {given}, and "
                f"unflattened parameter names {list(self.fqns)}"
            )
        if kinds == {"tensor"}:
            return self.shard(self._flat_tensor(name, values))
        if len(given) != len(values) or not all(_same(v, given[0]) for v in given):
            shown = [v.item() if torch.is_tensor(v) else v for v in values]
            dtypes = [v.dtype if torch.is_tensor(v) else None for v in values]
            raise ValueError(
                f"{_SCALAR_MISMATCH} but got values {shown} and dtypes {dtypes} for state "
                f"{name} and unflattened parameter names {list(self.fqns)}"
            )
        value = given[0]
        return value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value

    def _flat_tensor(self, name: str, values: list[Tensor | None]) -> Tensor:
        dtypes = {v.dtype for v in values if v is not None}
        if len(dtypes) != 1:
            raise ValueError(
                "All unflattened parameters comprising a single flat parameter must have "
                f"positive-dimension tensor state with the same dtype but got dtypes {dtypes} "
                f"for state {name} and unflattened parameter names {list(self.fqns)}"
            )
        for value, shape in zip(values, self._flat.shapes):
            if value is None and len(shape) == 0:
                raise ValueError("Flattening a zero-dimension parameter is not supported")
            if value is not None and value.shape != shape:
                raise ValueError(
                    "Tensor optimizer state does not have same shape as its parameter: "
                    f"{value.shape} {shape}"
                )
        return self.flatten(values, dtypes.pop())

    def part_state(self, fqn: str, state: dict[str, Any]) -> dict[str, Any]:
        """The local state of original parameter ``fqn`` from its full state
        (``use_orig_params=True``): {} when this rank holds none of it."""
        if not state:
            return {}
        state = self.gathered(fqn, state)
        index = self.index(fqn)
        if not self.handle.flat_param._shard_param_infos[index].in_shard:
            return {}
        return {
            name: self.part(index, value) if _is_pos_dim(value) else value
            for name, value in state.items()
        }


def _value_kind(value: Any) -> str:
    if torch.is_tensor(value):
        return "tensor" if value.dim() > 0 else "scalar"
    return "other"


def _tensor_names(infos: list[dict[str, _StateInfo]]) -> dict[str, torch.dtype]:
    """Every positive-dimension state name any rank has for the unit, sorted, with its dtype."""
    found: dict[str, torch.dtype] = {}
    for info in infos:
        for state in info.values():
            for name, (_, dtype) in state.tensors.items():
                found.setdefault(name, dtype)
    return dict(sorted(found.items()))


def _gathered(state: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """``state`` with sharded values replaced by full tensors (collectives, in
    state-name order, the same on every rank)."""
    out = dict(state)
    for name, value in _sorted_items(state):
        if isinstance(value, (ShardedTensor, DTensor)):
            out[name] = full_tensor(value, device)
    return out


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


# -- saving: local -> full / sharded ---------------------------------------------------------


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
        groups = []
        for group in self.osd["param_groups"]:
            new = copy.deepcopy(group)
            new["params"] = [
                fqn for key in group["params"] for fqn in self.params.fqns[self.keys[key]]
            ]
            groups.append(new)
        return groups


@torch.no_grad()
def _check_same_use_orig_params(model: nn.Module) -> None:
    """Torch's check before anything else (the lazy initialisation included, whose
    check of the same attribute raises another error)."""
    if len({state.config.use_orig_params for state in states_in(model, recurse=True)}) > 1:
        raise AssertionError("Not all FSDP modules have the same _use_orig_params value")


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
    _check_same_use_orig_params(model)
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


# -- loading: full / sharded -> local --------------------------------------------------------


def _receive_from_rank0(osd: OSD, group: Any, params: ModelParams) -> OSD:
    """Rank 0's ``osd`` on every rank of ``group``, its broadcast tensors on the
    device on every rank (see [Note: Rank-0-only loading])."""
    device = params.device
    is_src = group.rank() == 0
    skeleton = tree_map_only(Tensor, _skeleton_leaf, osd) if is_src else None
    skeleton = _comm.broadcast_object(skeleton, 0, group, device)
    with_paths, spec = tree_flatten_with_path(skeleton)
    received = [leaf for _, leaf in with_paths]
    src_leaves = tree_flatten(osd)[0] if is_src else received
    src = _comm.group_ranks(group)[0]
    for index in _broadcast_order([path for path, _ in with_paths], received, params):
        meta = received[index]
        tensor = (
            src_leaves[index].to(device)
            if is_src
            else torch.empty(meta.shape, dtype=meta.dtype, device=device)
        )
        _comm.broadcast(tensor, src, group)
        received[index] = tensor
    return tree_unflatten(received, spec)


def _broadcast_order(
    paths: list[tuple[Any, ...]], leaves: list[Any], params: ModelParams
) -> list[int]:
    """Indices of the skeleton's tensors in torch's broadcast order: parameters'
    state in model order (each FQN's values in its state's order), then the rest
    in skeleton order."""
    by_fqn: dict[Any, list[int]] = {}
    rest: list[int] = []
    for i, (path, leaf) in enumerate(zip(paths, leaves, strict=True)):
        if not isinstance(leaf, _TensorMeta):
            continue
        keys = [getattr(entry, "key", None) for entry in path]
        if len(keys) == 3 and keys[0] == "state":
            by_fqn.setdefault(keys[1], []).append(i)
        else:
            rest.append(i)
    order = [i for fqns in params.fqns.values() for fqn in fqns for i in by_fqn.pop(fqn, [])]
    return order + sorted(rest + [i for indices in by_fqn.values() for i in indices])


def _skeleton_leaf(tensor: Tensor) -> Any:
    return _TensorMeta(tensor.shape, tensor.dtype) if tensor.dim() > 0 else tensor.cpu()


class _Loader:
    """One conversion of a full or sharded dict into a model's local form, still
    keyed by ``OptimStateKey`` (see [Note: Flattening for loading])."""

    params: ModelParams
    named_optim: torch.optim.Optimizer | None  # for a named optimizer's empty parts

    def __init__(self, params: ModelParams, named_optim: torch.optim.Optimizer | None) -> None:
        self.params = params
        self.named_optim = named_optim

    def state(self, state: dict[Any, Any]) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        used: set[Any] = set()
        for param, fqns in self.params.fqns.items():
            if fqns[0] not in state:
                continue
            used.update(fqns)
            key = self.params.key(param)
            value = self._param_state(param, key, state)
            if value is not None:
                out[key] = value
        out.update({k: copy.copy(v) for k, v in state.items() if k not in used})
        return out

    def _param_state(
        self, param: nn.Parameter, key: OptimStateKey, state: dict[Any, Any]
    ) -> dict[str, Any] | None:
        if not key.managed:  # gathered: it may come from a unit of another wrapping
            return _gathered(state[key.fqns[0]], self.params.device)
        unit = self.params.unit_of[key.fqns[0]]
        if not self.params.use_orig_params:
            gathered = [unit.gathered(f, state[f]) if f in state else None for f in key.fqns]
            return unit.flatten_state(gathered) or None
        local = unit.part_state(key.fqns[0], state[key.fqns[0]])
        if local:
            return local
        if self.named_optim is not None and param in self.named_optim.state:
            return copy.deepcopy(self.named_optim.state[param])  # keyed optimizers want every entry
        return None


def _rekey_to_optimizer(
    flat: dict[Any, Any], osd: OSD, params: ModelParams, keys: dict[ParamKey, Any]
) -> OSD:
    """``OptimStateKey`` s -> the local optimizer's keys; a saved group's FQNs -> its
    sorted keys. A key of a parameter the optimizer does not hold stays as FQNs."""
    key_of = {param: key for key, param in keys.items()}
    by_fqns: dict[tuple[str, ...], ParamKey] = {}
    by_fqn: dict[str, ParamKey] = {}
    for param, fqns in params.fqns.items():
        if param in key_of:
            by_fqns[fqns] = key_of[param]
            by_fqn.update(dict.fromkeys(fqns, key_of[param]))
    state = {
        (by_fqns.get(k.fqns, k.fqns) if isinstance(k, OptimStateKey) else k): v
        for k, v in flat.items()
    }
    out: OSD = {"state": state}
    if "param_groups" in osd:
        out["param_groups"] = [
            {**copy.deepcopy(g), "params": sorted({by_fqn[n] for n in g["params"]})}
            for g in osd["param_groups"]
        ]
    return out


@torch.no_grad()
def optim_state_dict_to_load(
    model: nn.Module,
    osd: OSD,
    source: KeySource,
    rank0_only: bool,
    named: bool,
    group: Any,
) -> OSD:
    """The local form of a full or sharded dict for ``model``'s optimizer. Under
    ``rank0_only`` only rank 0's ``osd`` is read."""
    _check_same_use_orig_params(model)
    ensure_initialized(model)
    params = ModelParams(model)
    params.require_units()
    group = group or _comm.world()
    if rank0_only:
        osd = _receive_from_rank0(osd if group.rank() == 0 else {}, group, params)
    if "state" not in osd:
        raise ValueError(
            '`optim_state_dict` must have the keys "state" to be a valid optimizer state dict'
        )
    loader = _Loader(params, source.optim if named else None)
    flat = loader.state(osd["state"])
    return _rekey_to_optimizer(flat, osd, params, source.keys(params, model, named))


# -- rekeying a non-wrapped model's dict ------------------------------------------------------


def rekey_optim_state_dict(
    osd: OSD, key_type: OptimStateKeyType, model: nn.Module, source: KeySource
) -> OSD:
    """``osd`` keyed by parameter IDs or names of a model without flat parameters."""
    if key_type not in (OptimStateKeyType.PARAM_NAME, OptimStateKeyType.PARAM_ID):
        raise AssertionError(f"Expected PARAM_NAME or PARAM_ID, got {key_type}")
    kinds = {type(key) for key in osd["state"]}
    if len(kinds) > 1 or not kinds <= {int, str}:
        raise ValueError(f"Invalid parameter keys: {osd['state'].keys()}")
    wanted = str if key_type is OptimStateKeyType.PARAM_NAME else int
    if kinds <= {wanted}:
        return osd
    params = ModelParams(model)
    names = {param: _single_name(fqns) for param, fqns in params.fqns.items()}
    ids = source.keys(params, model, named=False)
    id_to_name = {key: names[param] for key, param in ids.items()}
    mapping: dict[Any, Any] = id_to_name
    if key_type is OptimStateKeyType.PARAM_ID:
        mapping = {name: key for key, name in id_to_name.items()}
    groups = copy.deepcopy(osd["param_groups"])
    for group in groups:
        group["params"] = sorted(mapping[key] for key in group["params"])
    return {"state": {mapping[k]: v for k, v in osd["state"].items()}, "param_groups": groups}


def _single_name(fqns: tuple[str, ...]) -> str:
    if len(fqns) != 1:
        raise RuntimeError(
            f"Each parameter should only map to one parameter name but got {len(fqns)}: "
            f"{list(fqns)}"
        )
    return fqns[0]


# -- deprecation warnings ---------------------------------------------------------------------


def warn_optim_input(optim_input: OptimInput) -> None:
    if optim_input is not None:
        warnings.warn(
            "The `optim_input` argument is deprecated and will be removed after PyTorch 1.13. "
            "You may remove it from your code without changing its functionality.",
            FutureWarning,
            stacklevel=3,
        )


def warn_legacy(current: str, replacement: str) -> None:
    warnings.warn(
        f"``FullyShardedDataParallel.{current}``is being deprecated and is replaced by "
        f"``FullyShardedDataParallel.{replacement}``. ``FullyShardedDataParallel.{current}`` "
        "may be removed after PyTorch 2.2.",
        FutureWarning,
        stacklevel=3,
    )


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
