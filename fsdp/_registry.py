"""Which modules have FSDP applied (as a wrapper or with ``fully_shard``).

[Note: The registry holds nothing alive]
A weak mapping from module to a weak reference to its FSDP state. The module
owns its state (the wrapper's ``_state`` attribute, the composable form's
forward hooks), and the state refers back to its module. A registry that
held the state strongly would, through ``state.module``, keep the module
alive for ever (a ``WeakKeyDictionary`` whose value refers to its key never
drops the entry), and with it the unit's process groups, communicators and
device memory: a pooled test rank accumulated hundreds of gloo groups that way.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

_STATES: weakref.WeakKeyDictionary[nn.Module, weakref.ReferenceType[Any]] = (
    weakref.WeakKeyDictionary()
)


def register(module: nn.Module, state: Any) -> None:
    _STATES[module] = weakref.ref(state)


def state_of(module: nn.Module) -> Any | None:
    """The FSDP state of ``module``, or None if FSDP was not applied to it."""
    ref = _STATES.get(module)
    return ref() if ref is not None else None


def has_fsdp(module: nn.Module) -> bool:
    return state_of(module) is not None
