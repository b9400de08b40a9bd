"""Per-test isolation inside a reused rank process.

[Note: What a test may leak, and how it is undone]
A pooled rank runs many tests. Before each one the rank returns to a baseline
captured when the pool started (and extended as modules are imported):

- ``os.environ`` is restored key by key (a test that sets
  ``FSDP_USE_FULL_PREC_IN_EVAL`` cannot change the next test's behaviour);
- the default dtype and grad mode are reset;
- every module attribute and class attribute of tracked modules (ours, the test
  modules, ``torch.distributed``) is restored by identity, which undoes a
  monkeypatch that was never reverted (``FlatParamHandle._use_unsharded_views = f``);
- process groups created by the test are destroyed, dynamo caches are reset and
  the RNGs are reseeded.

If a test destroyed the default process group the rank reports itself unhealthy
and the pool is replaced instead of patched up.
"""

from __future__ import annotations

import os
import random
import sys
import types
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# Namespaces we own: every attribute except submodules is restored.
_OWNED_PREFIXES: tuple[str, ...] = (
    "fsdp",
    "models",
    "suites",
    "harness.fsdp_api",
    "harness.collectives",
)
# Namespaces torch owns: only functions and classes are restored (what a
# monkeypatch replaces); plain values there are torch's own runtime state.
_FOREIGN_PREFIXES: tuple[str, ...] = ("torch.distributed",)


def _matches(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _restorable(value: object, owned: bool) -> bool:
    if isinstance(value, types.ModuleType):
        return False
    if owned:
        return True
    return callable(value) or isinstance(value, (staticmethod, classmethod, property))


@dataclass
class _NamespaceSnapshot:
    """Identity snapshot of one namespace (a module or a class)."""

    owner: object
    owned: bool
    items: dict[str, object]

    @classmethod
    def of(cls, owner: object, owned: bool) -> _NamespaceSnapshot:
        items = {k: v for k, v in vars(owner).items() if _restorable(v, owned)}
        return cls(owner, owned, items)

    def restore(self) -> int:
        current = vars(self.owner)
        changed = 0
        for name in [n for n in current if n not in self.items]:
            value = current[name]
            if name.startswith("__") or not _restorable(value, self.owned):
                continue
            delattr(self.owner, name)
            changed += 1
        for name, value in self.items.items():
            if current.get(name, _MISSING) is not value:
                setattr(self.owner, name, value)
                changed += 1
        return changed


_MISSING = object()


@dataclass
class StateBaseline:
    """The state every test starts from, in one rank process."""

    environ: dict[str, str]
    default_dtype: torch.dtype
    namespaces: dict[int, _NamespaceSnapshot] = field(default_factory=dict)
    extra_modules: set[str] = field(default_factory=set)

    @classmethod
    def capture(cls) -> StateBaseline:
        baseline = cls(dict(os.environ), torch.get_default_dtype())
        baseline.track_new_modules()
        return baseline

    def track_module(self, name: str) -> None:
        """Also track ``name`` (a test module outside the tracked packages)."""
        self.extra_modules.add(name)
        self.track_new_modules()

    def track_new_modules(self) -> None:
        with warnings.catch_warnings():  # deprecated torch attributes warn on access
            warnings.simplefilter("ignore")
            self._track_new_modules()

    def _track_new_modules(self) -> None:
        for name, module in list(sys.modules.items()):
            if not isinstance(module, types.ModuleType):
                continue
            if id(module) in self.namespaces:
                continue
            owned = name in self.extra_modules or _matches(name, _OWNED_PREFIXES)
            if not owned and not _matches(name, _FOREIGN_PREFIXES):
                continue
            self.namespaces[id(module)] = _NamespaceSnapshot.of(module, owned)
            for value in list(vars(module).values()):
                if isinstance(value, type) and value.__module__ == name:
                    self.namespaces.setdefault(id(value), _NamespaceSnapshot.of(value, owned))

    def restore(self, seed: int) -> int:
        """Return to the baseline; returns how many attributes were restored."""
        self._restore_environ()
        torch.set_default_dtype(self.default_dtype)
        torch.set_grad_enabled(True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            restored = sum(snapshot.restore() for snapshot in self.namespaces.values())
        _reset_dynamo()
        _reseed(seed)
        return restored

    def _restore_environ(self) -> None:
        for key in [k for k in os.environ if k not in self.environ]:
            del os.environ[key]
        for key, value in self.environ.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


def _reset_dynamo() -> None:
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()


def _reseed(seed: int) -> None:
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed)
    torch.manual_seed(seed)


class GroupTracker:
    """Destroys the process groups a test created (subgroups leak otherwise)."""

    def __init__(self) -> None:
        self._before: set[int] = set()

    def start(self) -> None:
        self._before = {id(pg) for pg in _live_groups()}

    def destroy_new_groups(self) -> None:
        default = _default_group()
        for pg in _live_groups():
            if id(pg) not in self._before and pg is not default:
                dist.destroy_process_group(pg)


def _live_groups() -> list[dist.ProcessGroup]:
    if not dist.is_initialized():
        return []
    return list(dist.distributed_c10d._world.pg_map.keys())


def _default_group() -> dist.ProcessGroup | None:
    if not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_group()


def default_group_alive() -> bool:
    return dist.is_initialized()
