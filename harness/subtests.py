"""Subtests: the cartesian product of a configuration, run inside the same ranks.

[Note: Subtests keep going, and the ranks stay in step]
``run_subtests`` runs every combination even after one fails. After each
combination every rank reports to the pytest process and waits for its reply
(see ``harness._protocol``), so all ranks agree on which combination comes next
and on whether it failed. If a rank fails while another is stuck in a collective
waiting for it, the pytest process stops the stuck rank, replaces the pool and
re-runs the test from the next combination (``resume_after``): one bad
combination never hides the results of the others.

Combinations are rendered as ``key=value`` pairs (enum members by name, classes
and functions by ``__name__``); ``--subtest "key=value,..."`` accepts the same
text, so a failing combination from a report can be pasted back to re-run it.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple


class Combination(NamedTuple):
    index: int
    kwargs: dict[str, object]

    def render(self) -> str:
        return render_config(self.kwargs)


def combinations(config: Mapping[str, Sequence[object]]) -> Iterator[Combination]:
    keys = list(config)
    for index, values in enumerate(itertools.product(*(config[k] for k in keys))):
        yield Combination(index, dict(zip(keys, values)))


def render_value(value: object) -> str:
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, type) or callable(value) and hasattr(value, "__name__"):
        return str(getattr(value, "__name__", repr(value)))
    return repr(value)


def render_config(kwargs: Mapping[str, object]) -> str:
    return ", ".join(f"{key}={render_value(value)}" for key, value in kwargs.items())


def parse_filter(text: str | None) -> tuple[tuple[str, str], ...]:
    """Parses ``--subtest "a=1,b=FULL_SHARD"`` into ``(("a", "1"), ("b", "FULL_SHARD"))``."""
    if not text:
        return ()
    pairs: list[tuple[str, str]] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"--subtest expects key=value pairs separated by commas, got {part!r}")
        pairs.append((key.strip(), value.strip()))
    return tuple(pairs)


def _spellings(value: object) -> set[str]:
    spellings = {render_value(value), repr(value), str(value)}
    if isinstance(value, enum.Enum):
        spellings.add(f"{type(value).__name__}.{value.name}")
    return {s.lower() for s in spellings}


def matches(kwargs: Mapping[str, object], wanted: Sequence[tuple[str, str]]) -> bool:
    """Whether a combination is selected by a ``--subtest`` filter.

    A key the combination does not have cannot match: the filter names a
    configuration, and a test without that key is not it.
    """
    for key, text in wanted:
        if key not in kwargs or text.lower() not in _spellings(kwargs[key]):
            return False
    return True
