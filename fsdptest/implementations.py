"""The FSDP implementations ``--fsdp-impl`` can name, and how a name resolves to a module.

[Note: Naming an FSDP implementation]
``--fsdp-impl`` takes one of:

- a built-in name: ``local`` (this project's ``fsdp``) or ``torch``
  (``torch.distributed.fsdp``);
- a name a package registered in the entry-point group ``fsdptest.implementations``
  (``example = "mypkg.fsdp"`` in its ``[project.entry-points."fsdptest.implementations"]``),
  whose value is a module path;
- an importable module path (``mypkg.fsdp``).

The module exposes the FSDP1 API (``FullyShardedDataParallel``, ``ShardingStrategy``,
``MixedPrecision``, ...; see ``fsdptest.api``). A name or entry point whose module
is ``fsdp`` or ``torch.distributed.fsdp`` is that built-in implementation, so the
suites' allowances for torch (its documented limitations) apply whatever it was
called. The plugin resolves the option once, in ``pytest_configure``, so an unknown
name is a usage error before anything is collected; the facade resolves the same
name again in every process (the ranks inherit it through ``FSDP_HARNESS_IMPL``).
This module imports neither implementation.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass

ENTRY_POINT_GROUP = "fsdptest.implementations"
BUILTIN_MODULES = {"local": "fsdp", "torch": "torch.distributed.fsdp"}


@dataclass(frozen=True)
class Implementation:
    """An FSDP implementation under test: the name it was given and its module."""

    name: str
    module: str
    origin: str
    """Where the name came from: ``built in``, ``entry point of <distribution>``,
    or ``module path``."""

    @property
    def kind(self) -> str:
        """``local`` or ``torch`` for the built-in modules, else the name as given."""
        builtin = {module: kind for kind, module in BUILTIN_MODULES.items()}
        return builtin.get(self.module, self.name)

    @property
    def is_builtin(self) -> bool:
        return self.kind in BUILTIN_MODULES

    def describe(self) -> str:
        return self.module if self.name == self.module else f"{self.name} = {self.module}"


class UnknownImplementation(ValueError):
    """A name that is neither built in, registered, nor an importable module."""


def registered() -> dict[str, Implementation]:
    """The built-in implementations and those registered through entry points."""
    found = {
        name: Implementation(name, module, "built in") for name, module in BUILTIN_MODULES.items()
    }
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = entry.dist.name if entry.dist is not None else "an unnamed distribution"
        found.setdefault(
            entry.name, Implementation(entry.name, entry.value, f"entry point of {dist}")
        )
    return found


def resolve(name: str) -> Implementation:
    """The implementation ``name`` names (see the module note)."""
    known = registered()
    if name in known:
        return known[name]
    if _importable(name):
        return Implementation(name, name, "module path")
    listing = ", ".join(f"{impl.name} ({impl.module})" for impl in known.values())
    raise UnknownImplementation(
        f"--fsdp-impl {name!r} is neither a known FSDP implementation nor an importable "
        f"module. Known: {listing}. A package registers one in the entry-point group "
        f"{ENTRY_POINT_GROUP!r}; any module exposing the FSDP1 API can be named by its path."
    )


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing, or an empty name
        return False
