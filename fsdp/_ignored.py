"""What a unit leaves alone: ignored modules and parameters.

[Note: Ignored modules and parameters]
``ignored_modules`` (modules, with their subtrees) or ``ignored_states`` (all
parameters, or all modules; not both arguments) name what a unit must not
flatten, shard, move or reduce. A unit also ignores what the units nested in
it ignore, so that ranks whose nested units ignore different modules still
build the same flat parameters. Flat parameters of nested units are never
"ignored parameters" (they belong to their unit). The checks and messages are
torch's.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import NamedTuple

from torch import nn

from fsdp import _registry
from fsdp._storage import FlatParameter


class Ignored(NamedTuple):
    """What a unit leaves alone: ignored modules (with their subtrees) and
    parameters. A unit also ignores what the units nested in it ignore."""

    modules: frozenset[nn.Module]
    params: frozenset[nn.Parameter]

    @classmethod
    def resolve(
        cls,
        root: nn.Module,
        ignored_modules: Iterable[nn.Module] | None,
        ignored_states: Iterable[nn.Parameter] | Iterable[nn.Module] | None,
    ) -> Ignored:
        """From the constructor arguments, with torch's checks and messages."""
        if ignored_modules is not None and ignored_states is not None:
            raise ValueError(
                "Cannot pass both ignored_modules and ignored_states at the same time. "
                "Please just pass ignored_states."
            )
        roots, params = _split_ignored(ignored_modules, ignored_states)
        modules = _ignored_subtrees(root, roots)
        params |= {p for m in modules for p in m.parameters() if not _is_flat(p)}
        for submodule in root.modules():
            nested = _registry.state_of(submodule)
            if nested is not None:
                modules |= nested.ignored.modules
                params |= nested.ignored.params
        return cls(frozenset(modules), frozenset(params))


def _split_ignored(
    ignored_modules: Iterable[nn.Module] | None,
    ignored_states: Iterable[nn.Parameter] | Iterable[nn.Module] | None,
) -> tuple[list[nn.Module], set[nn.Parameter]]:
    """(ignored root modules, ignored parameters) from either argument."""
    if ignored_states is None:
        modules = list(ignored_modules) if ignored_modules is not None else []
        if not all(isinstance(m, nn.Module) for m in modules):
            raise ValueError(
                f"ignored_modules expects nn.Module list elements but got types {_types(modules)}"
            )
        return modules, set()
    states = list(ignored_states)
    if all(isinstance(s, nn.Parameter) for s in states):
        return [], {p for p in states if not _is_flat(p)}  # type: ignore[misc]
    if all(isinstance(s, nn.Module) for s in states):
        return states, set()  # type: ignore[return-value]
    raise ValueError(
        "ignored_states expects all nn.Parameter or all nn.Module list elements but got "
        f"types {_types(states)}"
    )


def _types(items: list[object]) -> list[type]:
    return sorted({type(item) for item in items}, key=repr)


def _is_flat(param: nn.Parameter) -> bool:
    return isinstance(param, FlatParameter)


def _ignored_subtrees(root: nn.Module, roots: list[nn.Module]) -> set[nn.Module]:
    for module in roots:
        if _registry.has_fsdp(module):
            raise ValueError("`ignored_modules` should not include FSDP modules")
    modules = {m for r in roots for m in r.modules() if not _registry.has_fsdp(m)}
    if root in modules:
        warnings.warn(
            "Trying to ignore the top-level module passed into the FSDP constructor itself will "
            f"result in all parameters being ignored and is not well-supported: {root}",
            stacklevel=4,
        )
    return modules
