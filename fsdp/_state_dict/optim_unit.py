"""One unit's flat parameter as optimizer state sees it, and the collectives over
its group that gather its states for a save and shard them for a load (see [Note:
Three forms of optimizer state] in fsdp._state_dict.optim_keys and [Note: Flattening
for loading] in fsdp._state_dict.optim_load).

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
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

from fsdp import _comm
from fsdp._dtensor_extensions import DTensorExtensions
from fsdp._flat_param import FlatParamHandle
from fsdp._layout import FlatParamLayout
from fsdp._runtime import FSDPState
from fsdp._shard_utils import chunk_dtensor, chunk_sharded_tensor, full_tensor
from fsdp._state_dict.values import unit_mesh

_SCALAR_MISMATCH = (
    "All unflattened parameters comprising a single flat parameter must have scalar state "
    "with the same value and dtype"
)


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
            return chunk_dtensor(value, unit_mesh(self.state), offload)
        sharded = chunk_sharded_tensor(value, self.rank, self.world_size, self.group)
        return sharded.cpu() if offload else sharded  # placed on the CPU, as torch's

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
            return gathered_state(state, self.device)
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
            # flattened on the CPU, as torch does: Optimizer.load_state_dict moves
            # each state to its parameter's device
            on_cpu = [None if v is None else v.detach().to("cpu") for v in values]
            return self.shard(self._flat_tensor(name, on_cpu))
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


def gathered_state(state: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """``state`` with sharded values replaced by full tensors (collectives, in
    state-name order, the same on every rank), gathered on ``device``: a DTensor's
    stays there, a ShardedTensor's goes where its local shard is (the CPU for a
    rank without one), as torch's ``_gather_state_dict`` places them."""
    out = dict(state)
    for name, value in _sorted_items(state):
        if isinstance(value, DTensor):
            out[name] = full_tensor(value, device)
        elif isinstance(value, ShardedTensor):
            shards = value.local_shards()
            home = shards[0].tensor.device if shards else torch.device("cpu")
            out[name] = full_tensor(value, device).to(home)
    return out
