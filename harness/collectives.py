"""Patch or record the collectives of whichever FSDP implementation is under test.

[Note: One patch point for both implementations and both torch versions]
Torch 2.13 renamed the single-tensor collectives (``reduce_scatter_single``,
``all_gather_single``) and kept the old names (``reduce_scatter_tensor``,
``all_gather_into_tensor``) as wrappers that call the new ones; torch 2.11 has
only the old names. Torch's FSDP calls whichever its version has, and our FSDP
(``fsdp._comm``) looks the function up on ``torch.distributed`` at call time.
So every patch here replaces *every* name present for a collective, and a
reentrancy guard (one per patch, so patches stack) makes a call that goes
through two patched names (old name -> new name) count and dispatch once.

[Note: Coalesced broadcasts]
Torch's FSDP (``sync_module_states``) and DDP's constructor broadcast a
module's states through ``dist._broadcast_coalesced(group, tensors,
bucket_size, src)``, which never calls ``dist.broadcast``: it flattens the
tensors into buckets in C++. ``Collective.BROADCAST`` patches that name too,
and the recorder records such a call as one broadcast per tensor, in order:
which tensors travel from which rank is what a user sees, the bucketing is not.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class Collective(enum.Enum):
    # The list forms (``all_gather(tensor_list, tensor)``) are included: torch's
    # FSDP uses them for CPU tensors.
    ALL_GATHER = ("all_gather_single", "all_gather_into_tensor", "_all_gather_base", "all_gather")
    REDUCE_SCATTER = (
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "_reduce_scatter_base",
        "reduce_scatter",
    )
    ALL_REDUCE = ("all_reduce",)
    BROADCAST = ("broadcast", "_broadcast_coalesced")

    def names(self) -> list[str]:
        return [name for name in self.value if hasattr(dist, name)]


def current(kind: Collective) -> Callable[..., Any]:
    """The function a caller reaches today for ``kind`` (the newest name)."""
    return getattr(dist, kind.names()[0])


@contextlib.contextmanager
def patch_collective(kind: Collective, handler: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """Routes every call of ``kind`` through ``handler(orig, *args, **kwargs)``.

    Yields the original function of the newest name. Calls nested inside the
    handler (the original calling another patched name) go straight through.
    """
    originals = {name: getattr(dist, name) for name in kind.names()}
    guard = threading.local()

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        def patched(*args: Any, **kwargs: Any) -> Any:
            if getattr(guard, "active", False):
                return orig(*args, **kwargs)
            guard.active = True
            try:
                return handler(orig, *args, **kwargs)
            finally:
                guard.active = False

        return patched

    for name, orig in originals.items():
        setattr(dist, name, make(orig))
    try:
        yield originals[kind.names()[0]]
    finally:
        for name, orig in originals.items():
            setattr(dist, name, orig)


def _replace(new_fn: Callable[..., Any]) -> Callable[..., Any]:
    return lambda _orig, *args, **kwargs: new_fn(*args, **kwargs)


def patch_reduce_scatter(
    new_reduce_scatter: Callable[..., Any],
) -> contextlib.AbstractContextManager[Any]:
    """Replaces the reduce-scatter with ``new_reduce_scatter(*args, **kwargs)``,
    which is expected to call the original (``current(Collective.REDUCE_SCATTER)``
    taken before entering)."""
    return patch_collective(Collective.REDUCE_SCATTER, _replace(new_reduce_scatter))


def patch_all_gather(new_all_gather: Callable[..., Any]) -> contextlib.AbstractContextManager[Any]:
    return patch_collective(Collective.ALL_GATHER, _replace(new_all_gather))


def patch_all_reduce(new_all_reduce: Callable[..., Any]) -> contextlib.AbstractContextManager[Any]:
    return patch_collective(Collective.ALL_REDUCE, _replace(new_all_reduce))


@dataclass(frozen=True)
class CollectiveCall:
    kind: Collective
    input_dtype: torch.dtype
    input_numel: int
    output_numel: int
    group_size: int
    group_ranks: tuple[int, ...]
    """The global ranks of the group, in group-rank order."""

    @property
    def group_stride(self) -> int:
        """The distance between consecutive global ranks of the group (1 for the world
        or an intra-node group, the node size for a replica group); 0 for one rank."""
        return self.group_ranks[1] - self.group_ranks[0] if len(self.group_ranks) > 1 else 0


def _operands(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, torch.Tensor] | None:
    """(output numel, input tensor) of a collective call: the output is the first
    operand (a tensor, or a list of tensors for the list forms), the input the
    last (for all-reduce the one tensor is both)."""
    operands = [
        x
        for x in (*args, *kwargs.values())
        if isinstance(x, torch.Tensor)
        or (isinstance(x, (list, tuple)) and x and all(isinstance(t, torch.Tensor) for t in x))
    ]
    if not operands:
        return None
    first, last = operands[0], operands[-1]
    out_numel = first.numel() if isinstance(first, torch.Tensor) else sum(t.numel() for t in first)
    inp = last if isinstance(last, torch.Tensor) else last[0]
    return out_numel, inp


def _each_operand(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[int, torch.Tensor]]:
    """(output numel, input tensor) of each collective a call stands for: one per
    tensor for a coalesced broadcast (see [Note: Coalesced broadcasts]), else
    ``_operands``' one (none for a call without tensors)."""
    if len(args) > 1 and isinstance(args[0], dist.ProcessGroup) and isinstance(args[1], list):
        return [(t.numel(), t) for t in args[1]]
    operands = _operands(args, kwargs)
    return [] if operands is None else [operands]


def _group(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dist.ProcessGroup:
    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    return group if group is not None else dist.group.WORLD


class CollectiveRecorder:
    """Records every all-gather, reduce-scatter, all-reduce and broadcast, in
    call order.

    See ``_operands`` for what counts as input and output.
    """

    def __init__(self, kinds: tuple[Collective, ...] = tuple(Collective)) -> None:
        self.kinds = kinds
        self.calls: list[CollectiveCall] = []
        self._stack = contextlib.ExitStack()

    def of(self, kind: Collective) -> list[CollectiveCall]:
        return [c for c in self.calls if c.kind is kind]

    def _handler(self, kind: Collective) -> Callable[..., Any]:
        def record(orig: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            group = _group(args, kwargs)
            ranks = tuple(dist.get_process_group_ranks(group))
            for out_numel, inp in _each_operand(args, kwargs):
                call = CollectiveCall(kind, inp.dtype, inp.numel(), out_numel, len(ranks), ranks)
                self.calls.append(call)
            return orig(*args, **kwargs)

        return record

    def __enter__(self) -> CollectiveRecorder:
        for kind in self.kinds:
            self._stack.enter_context(patch_collective(kind, self._handler(kind)))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
