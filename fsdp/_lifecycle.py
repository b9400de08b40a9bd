"""Checked lifecycles: an enum value plus the table of transitions it allows.

[Note: One lifecycle per object]
Each object with a lifecycle (``FSDPState`` and ``FlatParamHandle``) holds it
in one ``Lifecycle``: the current value of one enum and a table, written out
next to the enum, of the values each one may move to. Every change goes
through ``Lifecycle.move``, which raises on a move the table does not list, and
only methods of the owning object call it; everyone else reads ``state``. A
move to the value already held is listed explicitly where it is allowed (an
idempotent transition), never implied.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Generic, TypeVar

E = TypeVar("E", bound=enum.Enum)

__all__ = ["Lifecycle", "Transitions"]

Transitions = Mapping[E, frozenset[E]]


class Lifecycle(Generic[E]):
    """The state of one object and the moves its table allows."""

    __slots__ = ("_allowed", "_next", "_owner", "state")

    state: E
    _allowed: Transitions[E]
    _next: frozenset[E]  # _allowed[state], looked up once per move
    _owner: str

    def __init__(self, initial: E, allowed: Transitions[E], owner: str) -> None:
        missing = set(type(initial)) - set(allowed)
        if missing:
            raise ValueError(
                f"{owner}: no transitions listed for {sorted(m.name for m in missing)}"
            )
        self.state = initial
        self._allowed = allowed
        self._next = allowed[initial]
        self._owner = owner

    def move(self, new: E) -> None:
        """Changes the state to ``new``; raises ``AssertionError`` (torch's type for
        a broken FSDP invariant) when the table does not allow the move."""
        if new not in self._next:
            raise AssertionError(
                f"{self._owner}: {self.state.name} -> {new.name} is not an allowed transition"
            )
        self.state = new
        self._next = self._allowed[new]
