"""Seed-style parametrization on top of ``pytest.mark.parametrize``.

The upstream FSDP tests name parametrized cases through a mapping from values to
short names (``subtest_name``). Here the same mapping produces pytest ids joined
by ``-``, e.g. ``test_mixed_precision_e2e_full_shard[mp_fp16-offload_true-fp32-none]``,
so ``-k`` and node ids read like the configuration.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest

from harness.subtests import render_value


def value_id(value: object) -> str:
    """A pytest id part: ``none``, a string as is, anything else as ``render_value``."""
    if value is None:
        return "none"
    return value if isinstance(value, str) else render_value(value)


def subtest_name(test_name_mapping: Mapping[str, str], *args: object) -> str:
    """The seeds' naming function: each value through the mapping, ``None`` as ``none``."""
    return "-".join(test_name_mapping[str(a)] if a is not None else "none" for a in args)


def parametrize(
    argnames: str,
    argvalues: Sequence[Any],
    name_fn: Callable[..., str] | None = None,
) -> pytest.MarkDecorator:
    """``@parametrize("a,b", [(1, 2), ...], name_fn)`` as in the upstream tests."""
    names = [n.strip() for n in argnames.split(",")]
    rows = [v if len(names) > 1 else (v,) for v in argvalues]
    if name_fn is not None:
        ids = [name_fn(*row) for row in rows]
    else:
        ids = ["-".join(value_id(v) for v in row) for row in rows]
    if len(names) == 1:
        return pytest.mark.parametrize(names[0], [row[0] for row in rows], ids=ids)
    return pytest.mark.parametrize(names, [tuple(row) for row in rows], ids=ids)
