"""Traversal of nested containers and state-dict key prefixes (the helpers of
``torch.distributed.utils`` that FSDP uses, with their semantics).

[Note: Applying a function to every tensor of a container]
``_apply_to_tensors(fn, container)`` reaches the tensors inside dataclasses
(frozen ones too), ``OrderedDict`` s, dicts, namedtuples, lists, tuples and
sets, at any depth, and gives back a container of the same type; anything else
is returned as it is. A ``PackedSequence`` is handed over by its ``.data``
(``fn`` works on it in place) and returned itself. A container none of whose
items ``fn`` changed is returned itself rather than rebuilt, so a module that
keeps or mutates the containers it is given sees the caller's objects (see
[Note: Forward inputs keep their identity] in fsdp._runtime).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_flatten, tree_unflatten


def _apply_to_tensors(fn: Callable[[Tensor], Any], container: Any) -> Any:
    """``fn`` applied to every tensor of ``container`` (see the module note)."""
    if isinstance(container, Tensor):
        return fn(container)
    if dataclasses.is_dataclass(container) and not isinstance(container, type):
        return _apply_to_dataclass(fn, container)
    if isinstance(container, PackedSequence):
        _apply_to_tensors(fn, container.data)
        return container
    if isinstance(container, dict):
        return _apply_to_mapping(fn, container)
    if _is_namedtuple(container):
        items = [_apply_to_tensors(fn, x) for x in container]
        return container if _same(items, container) else type(container)(*items)
    if isinstance(container, (list, tuple, set)):
        items = [_apply_to_tensors(fn, x) for x in container]
        return container if _same(items, container) else type(container)(items)
    return container


def _apply_to_dataclass(fn: Callable[[Tensor], Any], container: Any) -> Any:
    names = [f.name for f in dataclasses.fields(container) if f.init]
    old = [getattr(container, name) for name in names]
    new = [_apply_to_tensors(fn, value) for value in old]
    if _same(new, old):
        return container
    return dataclasses.replace(container, **dict(zip(names, new)))


def _apply_to_mapping(fn: Callable[[Tensor], Any], container: dict[Any, Any]) -> dict[Any, Any]:
    items = {key: _apply_to_tensors(fn, value) for key, value in container.items()}
    if _same(list(items.values()), list(container.values())):
        return container
    if isinstance(container, OrderedDict):
        rebuilt = type(container)()
        rebuilt.update(items)
        return rebuilt
    return items


def _same(new: list[Any], old: Any) -> bool:
    return all(a is b for a, b in zip(new, old))


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_asdict") and hasattr(value, "_fields")


def cast_floats(dtype: torch.dtype, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """Casts the floating-point tensors of ``args`` and ``kwargs`` to ``dtype``
    (never integer ones, e.g. token ids): mixed precision's input cast, shared by
    the wrapper and ``fully_shard``."""

    def cast(t: Tensor) -> Tensor:
        return t.to(dtype) if torch.is_floating_point(t) and t.dtype != dtype else t

    cast_args, cast_kwargs = _apply_to_tensors(cast, (args, kwargs))
    return cast_args, cast_kwargs


def to_device(device: torch.device, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """``args`` and ``kwargs`` with their tensors on ``device``; a container none
    of whose tensors moved is returned itself (see [Note: Forward inputs keep
    their identity] in fsdp._runtime)."""

    def move(tree: Any) -> Any:
        leaves, spec = tree_flatten(tree)
        moved = [
            x.to(device) if isinstance(x, Tensor) and x.device != device else x for x in leaves
        ]
        if all(new is old for new, old in zip(moved, leaves)):
            return tree
        return tree_unflatten(moved, spec)

    return move(args), move(kwargs)


def _replace_by_prefix(state_dict: dict[str, Any], old_prefix: str, new_prefix: str) -> None:
    """Renames, in place, every key that starts with ``old_prefix`` to start with
    ``new_prefix`` instead (a key containing it elsewhere is left alone)."""
    if old_prefix == new_prefix:
        raise ValueError("old_prefix and new_prefix must be distinct")
    for key in [k for k in state_dict if k.startswith(old_prefix)]:
        state_dict[new_prefix + key[len(old_prefix) :]] = state_dict.pop(key)
