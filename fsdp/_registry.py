"""Which modules have FSDP applied (as a wrapper or with ``fully_shard``).

A weak mapping from module to its FSDP state: nothing is stored on the modules.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

_STATES: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def register(module: nn.Module, state: Any) -> None:
    _STATES[module] = state


def state_of(module: nn.Module) -> Any | None:
    """The FSDP state of ``module``, or None if FSDP was not applied to it."""
    return _STATES.get(module)


def has_fsdp(module: nn.Module) -> bool:
    return module in _STATES
