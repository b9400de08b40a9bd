"""What the conformance search observes, as plain, comparable data (rank side).

[Note: Observations are plain data]
Everything a user or a training loop can see is turned into values that compare
with ``==`` except for floating-point numbers: ints, bools, strings, ``None``,
tuples (lists and the items of dicts, in their order: the order of a state
dict's keys is observable), ``Number`` (a Python float, compared with a
tolerance) and ``TensorView`` (a tensor's kind, dtype, shape, device,
``requires_grad`` and values; a ``ShardedTensor``'s shard metadata and local
shards; a ``DTensor``'s mesh, placements and local tensor). Objects of any other
class are observed by their class's name and, for dataclasses and named tuples,
their fields, so that two implementations' objects of the same public class
(``StateDictSettings``, ``_IncompatibleKeys``) compare by content. Values are
copied when observed: a later in-place change of the observed tensor does not
change the observation. A tensor whose storage is freed (an FSDP view of a
resharded parameter) is observed as such, without values.

[Note: Collectives as observed]
Every call of a tensor collective (all-gather, reduce-scatter, all-reduce,
broadcast, reduce, gather, scatter, all-to-all, barrier) is recorded with its
kind, input dtype, input and output numel and its group's global ranks, once
(a call that passes through another patched name inside is not recorded
again: torch 2.13's old names call the new ones). Object collectives
(``all_gather_object``, ``broadcast_object_list``) are recorded as the tensor
collectives they issue: a size (int64), then the pickled bytes (uint8). The
number of pickled bytes depends on the Python objects an implementation
chooses to exchange, not on anything a user sees, so a uint8 collective's
numel is recorded as ``None`` (``fsdptest.conformance.allowed``:
``PICKLED_PAYLOAD_SIZES``); its kind, group and place in the sequence are
compared.

Two other ways torch issues collectives are recorded as the collectives they
stand for. DTensor's redistributions (``full_tensor()``, ``redistribute``: a
sharded state dict of units built with a device mesh) go through the
functional collectives (``torch.distributed._functional_collectives``), which
never call the names above: ``all_gather_single`` and its older names are
recorded as an all-gather of the local tensor over the mesh dimension's
group, ``reduce_scatter_single`` and ``all_reduce`` likewise. And
``sync_module_states`` broadcasts through ``dist._broadcast_coalesced``
(flattened buckets, on accelerators only: torch refuses CPU modules there),
recorded as one broadcast per tensor, in its order: which tensors travel from
which rank is what a user sees, the bucketing is not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import inspect
import math
import os
import re
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


class Number(NamedTuple):
    """A Python float (compared with a tolerance)."""

    value: float


class TensorView(NamedTuple):
    """A tensor as a user sees it (see [Note: Observations are plain data])."""

    kind: str  # Tensor, Parameter, ShardedTensor or DTensor
    dtype: str
    shape: tuple[int, ...]
    device: str
    requires_grad: bool
    values: torch.Tensor | str | None  # a CPU copy; "freed storage"; None: no values (meta)
    layout: tuple[Any, ...] = ()  # ShardedTensor / DTensor: how it is sharded
    local: tuple[Any, ...] = ()  # ShardedTensor / DTensor: the local shards' views


def tensor_kind(value: torch.Tensor) -> str:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return "DTensor"
    if isinstance(value, ShardedTensor):
        return "ShardedTensor"
    if isinstance(value, nn.Parameter):
        return "Parameter"
    return "Tensor"


class Observer:
    """Turns values into observations on one rank (``device`` is the rank's own)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def device_text(self, device: torch.device) -> str:
        """The device's type, and its index where that is not the rank's own."""
        own = device.index is None or device.index == self.device.index
        return device.type if own or device.type != self.device.type else str(device)

    def tensor(self, value: torch.Tensor) -> TensorView:
        kind = tensor_kind(value)
        if kind == "DTensor":
            return self._dtensor(value)
        if kind == "ShardedTensor":
            return self._sharded_tensor(value)
        return TensorView(
            kind=kind,
            dtype=str(value.dtype),
            shape=tuple(value.shape),
            device=self.device_text(value.device),
            requires_grad=value.requires_grad,
            values=_values(value),
        )

    def _dtensor(self, value: Any) -> TensorView:
        mesh = value.device_mesh
        layout = (
            ("mesh", tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist())),
            ("placements", tuple(str(p) for p in value.placements)),
        )
        return TensorView(
            kind="DTensor",
            dtype=str(value.dtype),
            shape=tuple(value.shape),
            device=self.device_text(value.device),
            requires_grad=value.requires_grad,
            values=None,
            layout=layout,
            local=(self.tensor(value.to_local()),),
        )

    def _sharded_tensor(self, value: Any) -> TensorView:
        metadata = value.metadata()
        shards = tuple(
            (tuple(s.shard_offsets), tuple(s.shard_sizes), _placement(s.placement))
            for s in metadata.shards_metadata
        )
        local = tuple(
            (
                tuple(s.metadata.shard_offsets),
                tuple(s.metadata.shard_sizes),
                _placement(s.metadata.placement),
                self.tensor(s.tensor),
            )
            for s in value.local_shards()
        )
        return TensorView(
            kind="ShardedTensor",
            dtype=str(metadata.tensor_properties.dtype),
            shape=tuple(metadata.size),
            device=self.device_text(value.device) if hasattr(value, "device") else "",
            requires_grad=bool(metadata.tensor_properties.requires_grad),
            values=None,
            layout=shards,
            local=local,
        )

    def __call__(self, value: Any) -> Any:
        """The observation of any value (see [Note: Observations are plain data])."""
        if value is None or isinstance(value, (bool, int, str, TensorView, Number)):
            return value  # plain already (an observation made by hand)
        if isinstance(value, float):
            return Number(value)
        if isinstance(value, torch.Tensor) or tensor_kind_of(value) != "":
            return self.tensor(value)
        if isinstance(value, enum.Enum):
            return f"{type(value).__name__}.{value.name}"
        if isinstance(value, (torch.dtype, torch.device)):
            return str(value) if isinstance(value, torch.dtype) else self.device_text(value)
        if isinstance(value, dict):
            return ("dict", tuple((self(k), self(v)) for k, v in value.items()))
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            fields = tuple((f, self(getattr(value, f))) for f in value._fields)
            return (type(value).__name__, fields)
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, tuple(self(v) for v in value))
        if isinstance(value, (set, frozenset)):
            return ("set", tuple(sorted(repr(self(v)) for v in value)))
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = tuple(
                (f.name, self(getattr(value, f.name))) for f in dataclasses.fields(value)
            )
            return (type(value).__name__, fields)
        return ("object", type(value).__name__)


def tensor_kind_of(value: Any) -> str:
    """The kind of a ShardedTensor (not a ``torch.Tensor`` subclass), else ''."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return "ShardedTensor" if isinstance(value, ShardedTensor) else ""


def _placement(placement: Any) -> str:
    return "" if placement is None else str(placement)


def _values(value: torch.Tensor) -> torch.Tensor | str | None:
    try:
        return _readable_values(value)
    except RuntimeError:  # a tensor that refuses to be read (a placeholder)
        return "unreadable"


def _readable_values(value: torch.Tensor) -> torch.Tensor | str | None:
    if value.device.type == "meta":
        return None
    if value.numel() and value.untyped_storage().size() == 0:
        return "freed storage"
    needed = (value.storage_offset() + _extent(value)) * value.element_size()
    if value.numel() and value.untyped_storage().size() < needed:
        return "freed storage"
    return value.detach().to("cpu", copy=True)


def _extent(value: torch.Tensor) -> int:
    if value.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(value.shape, value.stride()))


def message(text: str) -> str:
    """A message with object addresses replaced (they differ between runs)."""
    return _ADDRESS.sub("0xADDR", text)


# -- collectives ------------------------------------------------------------------------------


class Kind(enum.Enum):
    """The collectives recorded, by the names ``torch.distributed`` has for each."""

    ALL_GATHER = ("all_gather_single", "all_gather_into_tensor", "_all_gather_base", "all_gather")
    REDUCE_SCATTER = (
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "_reduce_scatter_base",
        "reduce_scatter",
    )
    ALL_REDUCE = ("all_reduce",)
    BROADCAST = ("broadcast",)
    REDUCE = ("reduce",)
    GATHER = ("gather",)
    SCATTER = ("scatter",)
    ALL_TO_ALL = ("all_to_all_single", "all_to_all")
    BARRIER = ("barrier", "monitored_barrier")

    def names(self) -> list[str]:
        return [name for name in self.value if hasattr(dist, name)]


class CollectiveCall(NamedTuple):
    kind: str
    dtype: str | None
    input_numel: int | None
    output_numel: int | None
    group: tuple[int, ...]


class Collectives:
    """Records every collective while entered (see [Note: Collectives as observed])."""

    def __init__(self) -> None:
        self.calls: list[CollectiveCall] = []
        self._guard = threading.local()
        self._originals: dict[tuple[Any, str], Callable[..., Any]] = {}

    def take(self) -> tuple[CollectiveCall, ...]:
        calls, self.calls = tuple(self.calls), []
        return calls

    def _wrap(self, kind: Kind, original: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._guard, "active", False):
                return original(*args, **kwargs)
            self._guard.active = True
            try:
                self.calls.append(_call(kind, args, kwargs))
                return original(*args, **kwargs)
            finally:
                self._guard.active = False

        return recorded

    def _wrap_functional(self, kind: Kind, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._guard, "active", False):
                return original(*args, **kwargs)
            self._guard.active = True
            try:
                bound = signature.bind(*args, **kwargs).arguments
                tensor = bound[next(iter(signature.parameters))]
                self.calls.append(_functional_call(kind, tensor, bound.get("group")))
                return original(*args, **kwargs)
            finally:
                self._guard.active = False

        return recorded

    def _wrap_coalesced(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(group: Any, tensors: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
            if getattr(self._guard, "active", False):
                return original(group, tensors, *args, **kwargs)
            self._guard.active = True
            try:
                for tensor in tensors:
                    self.calls.append(_call(Kind.BROADCAST, (tensor, group), {}))
                return original(group, tensors, *args, **kwargs)
            finally:
                self._guard.active = False

        return recorded

    def __enter__(self) -> Collectives:
        for kind in Kind:
            for name in kind.names():
                self._patch(dist, name, self._wrap(kind, getattr(dist, name)))
        for kind, names in _FUNCTIONAL.items():
            for name in names:
                if hasattr(funcol, name):
                    self._patch(funcol, name, self._wrap_functional(kind, getattr(funcol, name)))
        if hasattr(dist, "_broadcast_coalesced"):
            self._patch(
                dist, "_broadcast_coalesced", self._wrap_coalesced(dist._broadcast_coalesced)
            )
        return self

    def _patch(self, module: Any, name: str, recorded: Callable[..., Any]) -> None:
        self._originals[(module, name)] = getattr(module, name)
        setattr(module, name, recorded)

    def __exit__(self, *exc: object) -> None:
        for (module, name), original in self._originals.items():
            setattr(module, name, original)
        self._originals.clear()


def _call(kind: Kind, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CollectiveCall:
    tensors = [
        x
        for x in (*args, *kwargs.values())
        if isinstance(x, torch.Tensor)
        or (isinstance(x, (list, tuple)) and x and all(isinstance(t, torch.Tensor) for t in x))
    ]
    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    if not tensors:
        return CollectiveCall(kind.name, None, None, None, ranks)
    first, last = tensors[0], tensors[-1]
    out_numel = first.numel() if isinstance(first, torch.Tensor) else sum(t.numel() for t in first)
    inp = last if isinstance(last, torch.Tensor) else last[0]
    if inp.dtype == torch.uint8:  # pickled objects: see the note
        return CollectiveCall(kind.name, str(inp.dtype), None, None, ranks)
    return CollectiveCall(kind.name, str(inp.dtype), inp.numel(), out_numel, ranks)


# The functional collectives DTensor redistributes with (torch 2.13's names and older ones).
_FUNCTIONAL: dict[Kind, tuple[str, ...]] = {
    Kind.ALL_GATHER: ("all_gather_single", "all_gather_tensor", "all_gather_tensor_autograd"),
    Kind.REDUCE_SCATTER: (
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_autograd",
    ),
    Kind.ALL_REDUCE: ("all_reduce",),
}


def _functional_call(kind: Kind, tensor: torch.Tensor, group: Any) -> CollectiveCall:
    """A functional collective of ``tensor`` over ``group`` (a process group, a
    1-D mesh, a ``(mesh, dim)`` pair, a group name or a rank list)."""
    ranks = _functional_group_ranks(group)
    size = len(ranks)
    out = {
        Kind.ALL_GATHER: tensor.numel() * size,
        Kind.REDUCE_SCATTER: tensor.numel() // max(size, 1),
    }.get(kind, tensor.numel())
    return CollectiveCall(kind.name, str(tensor.dtype), tensor.numel(), out, ranks)


def _functional_group_ranks(group: Any) -> tuple[int, ...]:
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        group = group[0].get_group(group[1])
    elif isinstance(group, DeviceMesh):
        group = group.get_group()
    elif isinstance(group, str):
        group = dist.distributed_c10d._resolve_process_group(group)
    if isinstance(group, (list, tuple)) and all(isinstance(r, int) for r in group):
        return tuple(group)
    return tuple(dist.get_process_group_ranks(group))


# -- warnings and exceptions ------------------------------------------------------------------------


def error_text(exc: BaseException) -> str:
    """An exception's message. [Note: Messages raised in pieces]: torch 2.11 raises
    some errors with the message's sentences as separate arguments
    (``RuntimeError("Found ... LOCAL_STATE_DICT. ", "DeviceMesh is not ...", ...)``),
    which ``str()`` shows as a tuple; torch 2.13 joins them into one string. The
    text compared is the arguments joined (with a space where a piece does not end
    in one), so that one FSDP is compared with either torch by what it says."""
    pieces = exc.args
    if len(pieces) > 1 and all(isinstance(p, str) for p in pieces):
        return "".join(p if p.endswith(" ") else p + " " for p in pieces[:-1]) + pieces[-1]
    return str(exc)


class Caught(NamedTuple):
    warnings: tuple[tuple[str, str, str], ...]
    error: tuple[str, str] | None


# [Note: Where a warning points]
# A warning is shown at the frame its ``stacklevel`` names: a user reads "your
# line N" or "inside the library". Which line is not comparable between two
# implementations (their internals differ), but which side of the boundary is:
# each warning is observed with ``the program`` when it points into the
# scenario's own code (this package, where every API call of a program is made)
# and ``the implementation`` otherwise (the FSDP's package, torch, or anything
# else it calls). A warning whose stacklevel is one frame off shows here.
_PROGRAM = str(Path(__file__).resolve().parent)


def pointed_at(filename: str) -> str:
    """``the program`` or ``the implementation`` (see [Note: Where a warning points])."""
    inside = str(Path(filename).resolve()).startswith(_PROGRAM + os.sep)
    return "the program" if inside else "the implementation"


@contextlib.contextmanager
def catching() -> Iterator[list[Caught]]:
    """Records every warning (``always``: an implementation's own once-only
    logic shows, Python's registry does not hide repeats) and the exception
    raised inside, which it swallows; yields a list that holds the ``Caught``
    afterwards."""
    result: list[Caught] = []
    error: tuple[str, str] | None = None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            yield result
        except Exception as exc:  # every exception is an observation
            error = (type(exc).__name__, message(error_text(exc)))
    caught = tuple(
        (w.category.__name__, message(str(w.message)), pointed_at(w.filename)) for w in seen
    )
    result.append(Caught(caught, error))


# -- comparing observations ---------------------------------------------------------------------


class Tolerance(NamedTuple):
    rtol: float
    atol: float
    # atol of a tensor's values times the largest magnitude among them (at least 1):
    # see [Note: Conformance tolerances] in fsdptest.conformance.compare
    scaled: bool = False


EXACT = Tolerance(0.0, 0.0)


def first_difference(a: Any, b: Any, tol: Tolerance, path: str = "") -> tuple[str, Any, Any] | None:
    if isinstance(a, TensorView) and isinstance(b, TensorView):
        return _tensor_difference(a, b, tol, path)
    if isinstance(a, Number) and isinstance(b, Number):
        return None if _close_numbers(a.value, b.value, tol) else (path, a, b)
    if isinstance(a, tuple) and isinstance(b, tuple) and type(a) is type(b):
        if len(a) != len(b):
            return (f"{path} (length {len(a)} vs {len(b)})", a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            place = first_difference(x, y, tol, f"{path}[{i}]")
            if place is not None:
                return place
        return None
    if isinstance(a, list) and isinstance(b, list):
        return first_difference(tuple(a), tuple(b), tol, path)
    return None if _same(a, b) else (path, a, b)


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    return bool(a == b)


def _tensor_difference(
    a: TensorView, b: TensorView, tol: Tolerance, path: str
) -> tuple[str, Any, Any] | None:
    for field in ("kind", "dtype", "shape", "device", "requires_grad"):
        if getattr(a, field) != getattr(b, field):
            return (f"{path} .{field}", a, b)
    place = first_difference(a.layout, b.layout, tol, f"{path} .layout")
    if place is not None:
        return place
    place = first_difference(a.local, b.local, tol, f"{path} .local")
    if place is not None:
        return place
    if isinstance(a.values, torch.Tensor) and isinstance(b.values, torch.Tensor):
        return None if _close_tensors(a.values, b.values, tol) else (f"{path} .values", a, b)
    return None if a.values == b.values else (f"{path} .values", a, b)


def _close_numbers(a: float, b: float, tol: Tolerance) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= tol.atol + tol.rtol * abs(b)


def _close_tensors(a: torch.Tensor, b: torch.Tensor, tol: Tolerance) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not (a.is_floating_point() or a.is_complex()):
        return bool(torch.equal(a, b))
    atol = tol.atol
    if tol.scaled and b.numel():
        finite = b.double()[torch.isfinite(b)]
        atol *= max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
    return bool(torch.allclose(a.double(), b.double(), rtol=tol.rtol, atol=atol, equal_nan=True))


def plain_tensors(value: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The plain tensors (not subclasses) in nested dicts, lists and tuples, by path."""
    if type(value) is torch.Tensor:
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from plain_tensors(item, f"{path}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from plain_tensors(item, f"{path}[{i}]")


def sharing_with(saved: Any, optim: torch.optim.Optimizer | None) -> list[str]:
    """Where a saved optimizer state dict holds the optimizer's own state tensors
    (the same storage): a later ``step()`` then changes what was saved."""
    if optim is None:
        return []
    live = {
        tensor.untyped_storage().data_ptr()
        for _, tensor in plain_tensors(list(optim.state.values()), "")
        if tensor.numel()
    }
    return sorted(
        path
        for path, tensor in plain_tensors(saved, "")
        if tensor.numel() and tensor.untyped_storage().data_ptr() in live
    )
