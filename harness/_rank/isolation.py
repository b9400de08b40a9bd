"""Per-test isolation inside a reused rank process.

[Note: What a test may leak, and how it is undone]
A pooled rank runs many tests. After each one the rank returns to a baseline
captured when the pool started (and extended as modules are imported):

- ``os.environ`` is restored key by key (a test that sets
  ``FSDP_USE_FULL_PREC_IN_EVAL`` cannot change the next test's behaviour);
- the default dtype and grad mode are reset, and torch function modes the test
  left pushed are popped;
- every module attribute and class attribute of tracked modules (ours, the test
  modules, ``torch.distributed``) is restored by identity, which undoes a
  monkeypatch that was never reverted (``FlatParamHandle._use_unsharded_views = f``);
- process groups created by the test are destroyed and dynamo caches are reset;
  the RNGs are reseeded before the next test.

If a test destroyed the default process group the rank reports itself unhealthy
and the pool is replaced instead of patched up.

[Note: Leaks the rank cannot undo]
``destroy_process_group`` unregisters a group but does not stop it: a gloo
group's threads and sockets (three threads and five descriptors per group of
two) and an NCCL group's memory live until the last Python reference to the
group is gone. A model, an optimizer, a closure or a traceback kept past the
test keeps its groups alive, and every later collective of the pool pays for
them. So after each test the rank collects garbage (cycles such as module ->
hook -> state -> module are normal), then checks that every group the test
created is gone, and that its thread count, open descriptors and device memory
are back within a small margin of the pool's start. If not, it reports what is
left and who holds it; the pool is replaced and the test is named in a warning.

The collection is cheap because the rank freezes the garbage collector's view
after each check (``gc.freeze``): the next collection only scans objects the
next test created, a few milliseconds instead of the ~170 ms a full pass over
torch's own objects takes. Every ``_FULL_COLLECT_EVERY`` tests the frozen
objects are collected too, so garbage among them is reclaimed.
"""

from __future__ import annotations

import collections
import functools
import gc
import os
import random
import sys
import types
import warnings
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from harness._rank import group_cache
from harness._rank.cuda_mapping import pop_function_modes
from harness.seeding import manual_seed

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
    owned_prefixes: tuple[str, ...] = ()
    unmanaged_environ: tuple[str, ...] = ()  # variables a test may leave as they are
    namespaces: dict[int, _NamespaceSnapshot] = field(default_factory=dict)
    extra_modules: set[str] = field(default_factory=set)
    _modules_seen: int = 0

    @classmethod
    def capture(
        cls, owned_prefixes: tuple[str, ...], unmanaged_environ: tuple[str, ...] = ()
    ) -> StateBaseline:
        """``owned_prefixes``: packages whose every module and class attribute is
        restored (``harness.plugin.isolated_modules``); ``unmanaged_environ``:
        variables left alone (pytest's own, where the test runs in its process)."""
        baseline = cls(
            dict(os.environ), torch.get_default_dtype(), owned_prefixes, unmanaged_environ
        )
        baseline.track_new_modules()
        return baseline

    def track_module(self, name: str) -> None:
        """Also track ``name`` (a test module outside the tracked packages)."""
        if name not in self.extra_modules:
            self.extra_modules.add(name)
            self._modules_seen = 0
        self.track_new_modules()

    def track_new_modules(self) -> None:
        if len(sys.modules) == self._modules_seen:
            return  # nothing imported since the last call
        with warnings.catch_warnings():  # deprecated torch attributes warn on access
            warnings.simplefilter("ignore")
            self._track_new_modules()
        self._modules_seen = len(sys.modules)

    def _track_new_modules(self) -> None:
        for name, module in list(sys.modules.items()):
            if not isinstance(module, types.ModuleType):
                continue
            if id(module) in self.namespaces:
                continue
            owned = name in self.extra_modules or _matches(name, self.owned_prefixes)
            if not owned and not _matches(name, _FOREIGN_PREFIXES):
                continue
            self.namespaces[id(module)] = _NamespaceSnapshot.of(module, owned)
            for value in list(vars(module).values()):
                if isinstance(value, type) and value.__module__ == name:
                    self.namespaces.setdefault(id(value), _NamespaceSnapshot.of(value, owned))

    def restore(self) -> int:
        """Return to the baseline; returns how many attributes were restored."""
        self._restore_environ()
        torch.set_default_dtype(self.default_dtype)
        torch.set_grad_enabled(True)
        pop_function_modes()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            restored = sum(snapshot.restore() for snapshot in self.namespaces.values())
        _reset_dynamo()
        _clear_dtensor_caches()
        return restored

    @staticmethod
    def reseed(seed: int) -> None:
        random.seed(seed)
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed(seed)
        manual_seed(seed)

    def _restore_environ(self) -> None:
        for key in [k for k in os.environ if k not in self.environ]:
            if key not in self.unmanaged_environ:
                del os.environ[key]
        for key, value in self.environ.items():
            if key not in self.unmanaged_environ and os.environ.get(key) != value:
                os.environ[key] = value


def _reset_dynamo() -> None:
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()


def _clear_dtensor_caches() -> None:
    """DTensor memoises sharding propagation and redistribution plans per device
    mesh (``functools`` caches in ``torch.distributed.tensor`` and a C++ cache).
    A mesh holds its process groups, so without this a test whose DTensors used
    a group it created would keep the group alive and be reported as leaking it;
    and meshes of the same shape compare equal, so a cached plan would name a
    destroyed group in the next test or subtest ("Could not resolve the process
    group registered under the name N")."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    for cached in _dtensor_lru_caches():
        cached.cache_clear()
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    getattr(redistribute, "clear_redistribute_planner_cache", lambda: None)()
    torch._C._clear_DTensor_sharding_propagator_cache()


_LRU_CACHES: dict[int, list[functools._lru_cache_wrapper[object]]] = {}


def _dtensor_lru_caches() -> list[functools._lru_cache_wrapper[object]]:
    """The ``functools`` caches of the loaded ``torch.distributed.tensor`` modules,
    searched again only when modules were imported since (the search over every
    module attribute took 5 ms, and it ran after every subtest)."""
    found = _LRU_CACHES.get(len(sys.modules))
    if found is None:
        _LRU_CACHES.clear()
        loaded = [
            name
            for name, module in list(sys.modules.items())
            if module is not None and name.startswith("torch.distributed.tensor")
        ]
        found = _LRU_CACHES[len(sys.modules)] = [c for n in loaded for c in _lru_caches_of(n)]
    return found


def _lru_caches_of(module_name: str) -> list[functools._lru_cache_wrapper[object]]:
    caches = []
    for value in list(vars(sys.modules[module_name]).values()):
        members = list(vars(value).values()) if isinstance(value, type) else []
        for cached in (value, *members):
            cached = getattr(cached, "__func__", cached)  # staticmethod
            if isinstance(cached, functools._lru_cache_wrapper):
                caches.append(cached)
    return caches


class GroupTracker:
    """Destroys the process groups created since a point (the start of a test or
    of a subtest) and remembers them weakly, so that the leak check can tell
    whether they are really gone."""

    def __init__(self) -> None:
        self.destroyed: list[weakref.ReferenceType[dist.ProcessGroup]] = []

    @staticmethod
    def live() -> set[int]:
        return {id(pg) for pg in _live_groups()}

    def destroy_since(self, before: set[int]) -> int:
        """Destroys the groups created since ``before``, except those the group cache
        keeps for later tests (see [Note: Process groups reused across tests]);
        returns how many."""
        default, cache = _default_group(), group_cache.active()
        doomed = [
            pg
            for pg in _live_groups()
            if id(pg) not in before and pg is not default and not (cache and cache.holds(pg))
        ]
        forget_meshes_of({pg.group_name for pg in doomed})
        if cache is not None:
            cache.rewind()
        for pg in doomed:
            dist.destroy_process_group(pg)
            self.destroyed.append(weakref.ref(pg))
        return len(doomed)

    def release_since(self, before: set[int]) -> None:
        """After a subtest: its groups are destroyed and, once its objects are
        collected, their threads and sockets are gone. A subtest that created no
        group is not collected after (a full collection costs about 100 ms on a
        loaded machine, paid by every subtest otherwise); the test's own leak
        check collects at its end. DTensor's caches go in every case: they are
        keyed by device meshes, which compare equal across subtests (by shape
        and ranks, not by group), so the next subtest's mesh would be handed
        plans naming the destroyed groups (see ``_clear_dtensor_caches``)."""
        destroyed = self.destroy_since(before)
        _clear_dtensor_caches()
        if destroyed:
            gc.collect()


def forget_meshes_of(group_names: set[str]) -> None:
    """Drops the device meshes over ``group_names`` from ``_mesh_resources``.

    Torch before 2.13 keeps meshes in dicts of ``_mesh_resources`` (a sliced mesh
    to its root, a root to its flattened meshes, ...) and in its stack of active
    meshes; meshes compare by shape and ranks, so a mesh the next test or subtest
    slices would be mapped to one whose groups are destroyed."""
    module = sys.modules.get("torch.distributed.device_mesh")
    resources = getattr(module, "_mesh_resources", None)
    if resources is None or not group_names:
        return
    for value in vars(resources).values():
        if isinstance(value, dict):
            for key in [
                k for k, v in value.items() if _over(k, group_names) or _over(v, group_names)
            ]:
                del value[key]
        elif isinstance(value, list):
            value[:] = [mesh for mesh in value if not _over(mesh, group_names)]


def _over(value: object, group_names: set[str]) -> bool:
    """Whether ``value`` (a mesh, or a dict of meshes) is over one of ``group_names``."""
    if isinstance(value, dict):
        return any(_over(v, group_names) for v in value.values())
    names = getattr(value, "_dim_group_names", None)  # torch 2.9 and later
    if names is None:  # older: (tag, ranks, name) per dimension
        names = [info[-1] for info in getattr(value, "_dim_group_infos", ())]
    return any(name in group_names for name in names)


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


_FULL_COLLECT_EVERY = 64
_THREAD_SLACK = 16
_FD_SLACK = 32
_DEVICE_BYTES_SLACK = 16 << 20


class Resources(NamedTuple):
    """What a rank holds that a leaked process group or model would grow."""

    threads: collections.Counter[str]  # thread names (``/proc/self/task/*/comm``)
    fds: int
    device_bytes: int  # tensors alive on the rank's CUDA device

    @classmethod
    def measure(cls, device: torch.device) -> Resources:
        return cls(_thread_names(), len(os.listdir("/proc/self/fd")), _device_bytes(device))

    def excess_over(self, base: Resources) -> list[str]:
        """What exceeds ``base`` by more than the margins of the module note."""
        problems = []
        extra_threads = sum(self.threads.values()) - sum(base.threads.values())
        if extra_threads > _THREAD_SLACK:
            grown = self.threads - base.threads
            names = ", ".join(f"{n} x{c}" for n, c in grown.most_common(4))
            problems.append(f"{extra_threads} more threads than at the pool's start ({names})")
        if self.fds - base.fds > _FD_SLACK:
            problems.append(f"{self.fds - base.fds} more open file descriptors")
        if self.device_bytes - base.device_bytes > _DEVICE_BYTES_SLACK:
            grown_mib = (self.device_bytes - base.device_bytes) / 2**20
            problems.append(f"{grown_mib:.0f} MiB more device memory allocated")
        return problems


def _thread_names() -> collections.Counter[str]:
    names: collections.Counter[str] = collections.Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names[f.read().strip()] += 1
        except FileNotFoundError:
            pass  # the thread ended while we looked
    return names


def _device_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    # cuBLAS keeps a workspace per stream in the caching allocator: not a leak.
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    return torch.cuda.memory_allocated(device)


class LeakCheck:
    """After each test: collect garbage, then compare with the pool's start (see
    [Note: Leaks the rank cannot undo]).

    The groups the rank keeps for later tests ([Note: Process groups reused
    across tests]) are the pool's own: after a test that added groups to the
    cache, what the rank holds is the new baseline (their threads and sockets),
    and that one test is checked for groups kept alive only."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        gc.collect()
        gc.freeze()
        self._base = Resources.measure(device)
        self._tests = 0
        self._cached = 0

    def check(self, destroyed: list[weakref.ReferenceType[dist.ProcessGroup]]) -> str:
        """Returns what the test left behind that cannot be released, or ''."""
        self._tests += 1
        self._collect()
        problems = []
        alive = [ref for ref in destroyed if ref() is not None]
        if alive:
            problems.append(
                f"{len(alive)} process group(s) it created are still referenced "
                f"(the first held by {describe_holders(alive[0])})"
            )
        now, cache = Resources.measure(self._device), group_cache.active()
        cached = cache.size() if cache is not None else 0
        if cached > self._cached:
            self._base = Resources(
                self._base.threads | now.threads,
                max(self._base.fds, now.fds),
                max(self._base.device_bytes, now.device_bytes),
            )
        else:
            problems += now.excess_over(self._base)
        self._cached = cached
        return "; ".join(problems)

    def _collect(self) -> None:
        if self._tests % _FULL_COLLECT_EVERY == 0:
            gc.unfreeze()
        gc.collect()
        gc.freeze()


def describe_holders(target: weakref.ReferenceType[object]) -> str:
    """Who refers to the object behind ``target``: ``Class.attribute`` for
    instance attributes."""
    gc.unfreeze()  # frozen objects are invisible to get_referrers
    names: set[str] = set()
    try:
        obj = target()
        if obj is not None:  # collected since the caller looked
            for ref in gc.get_referrers(obj):  # a loop: a comprehension's cell would refer to obj
                names.add(_holder_name(ref, obj))
                del ref  # no reference may outlive the loop (it may have had no iteration)
        del obj
    finally:
        gc.freeze()
    names.discard("")
    return ", ".join(sorted(names)[:4]) or "an object the garbage collector does not track"


def _holder_name(ref: object, obj: object) -> str:
    if isinstance(ref, types.FrameType):
        return ""
    if isinstance(ref, dict):
        key = next((k for k, v in ref.items() if v is obj), "?")
        owners = [o for o in gc.get_referrers(ref) if getattr(o, "__dict__", None) is ref]
        if owners:
            return f"{type(owners[0]).__qualname__}.{key}"
        return f"a dict under the key {key!r}"
    if isinstance(ref, (list, tuple, set)):
        return f"a {type(ref).__name__}"
    return type(ref).__qualname__
