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
import functools
import itertools
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

import pytest


class Combination(NamedTuple):
    index: int
    kwargs: dict[str, object]

    def render(self) -> str:
        return render_config(self.kwargs)


def combinations(config: Mapping[str, Sequence[object]]) -> Iterator[Combination]:
    keys = list(config)
    for index, values in enumerate(itertools.product(*(config[k] for k in keys))):
        yield Combination(index, dict(zip(keys, values)))


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def render_value(value: object) -> str:
    """One readable text for a value, the same in every process: enum members by
    name, dtypes without ``torch.``, classes and functions by name, partials as
    ``partial(f, args)``, memory addresses dropped from any repr."""
    if isinstance(value, enum.Enum):
        return value.name
    torch = sys.modules.get("torch")  # a dtype exists only where torch was imported
    if torch is not None and isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, functools.partial):
        args = [render_value(value.func), *map(render_value, value.args)]
        args += [f"{k}={render_value(v)}" for k, v in value.keywords.items()]
        return f"partial({', '.join(args)})"
    if isinstance(value, type) or (callable(value) and hasattr(value, "__name__")):
        return str(getattr(value, "__name__", repr(value)))
    return _ADDRESS.sub("", repr(value))


def render_config(kwargs: Mapping[str, object]) -> str:
    return ", ".join(f"{key}={render_value(value)}" for key, value in kwargs.items())


def parse_filter(text: str | None, option: str = "--subtest") -> tuple[tuple[str, str], ...]:
    """Parses ``--subtest "a=1, b=MixedPrecision(param_dtype=float16, ...)"`` into
    ``(key, value)`` pairs. Commas and ``=`` inside brackets or quotes belong to
    the value, so a configuration pasted from a report parses back. A malformed
    filter is a usage error naming the option (as ``option`` spells it) and the
    part that is wrong."""
    if not text:
        return ()
    pairs: list[tuple[str, str]] = []
    for part in _split_top_level(text, ","):
        part = part.strip()
        if not part:
            continue
        key_and_value = _split_top_level(part, "=", maxsplit=1)
        key = key_and_value[0].strip()
        if len(key_and_value) != 2 or not key.isidentifier():
            raise pytest.UsageError(
                f"{option} expects key=value pairs separated by commas, as a failure report "
                f'prints them (e.g. {option} "use_orig_params=True, sharding_strategy='
                f'FULL_SHARD"); this part is not one: {part!r}'
            )
        pairs.append((key, key_and_value[1].strip()))
    return tuple(pairs)


_OPEN, _CLOSE = "([{<", ")]}>"


def _split_top_level(text: str, sep: str, maxsplit: int = -1) -> list[str]:
    """Splits ``text`` at ``sep`` outside brackets and quotes."""
    parts, depth, quote, start = [], 0, "", 0
    for i, char in enumerate(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in _OPEN:
            depth += 1
        elif char in _CLOSE:
            depth = max(0, depth - 1)
        elif char == sep and depth == 0 and (maxsplit < 0 or len(parts) < maxsplit):
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _normal(text: str) -> str:
    return "".join(_ADDRESS.sub("", text).split()).lower()


def _spellings(value: object) -> set[str]:
    spellings = {render_value(value), repr(value), str(value)}
    if isinstance(value, enum.Enum):
        spellings.add(f"{type(value).__name__}.{value.name}")
    return {_normal(s) for s in spellings}


def matches(kwargs: Mapping[str, object], wanted: Sequence[tuple[str, str]]) -> bool:
    """Whether a combination is selected by a ``--subtest`` filter.

    A key the combination does not have cannot match: the filter names a
    configuration, and a test without that key is not it.
    """
    for key, text in wanted:
        if key not in kwargs or _normal(text) not in _spellings(kwargs[key]):
            return False
    return True
