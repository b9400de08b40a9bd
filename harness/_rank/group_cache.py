"""Process groups a pooled rank hands out again to later tests.

[Note: Process groups reused across tests]
A test or an FSDP under test that asks for a process group (``new_group``,
``new_subgroups``, a ``DeviceMesh``, hybrid sharding) gets a new communicator,
and the harness destroys it when the test (or subtest) ends. On NCCL that is the
dominant cost of a small test: measured on two H200s (torch 2.11, NCCL 2.28, the
default group bound to the device), ``new_group`` of both ranks takes 40 ms, its
first all-reduce 136 ms and ``destroy_process_group`` 500 ms, against 0.3 ms for
an all-reduce on a group that exists (``bench/nccl_test_cost.py micro``). Gloo
groups cost threads, sockets and a rendezvous each.

So a pooled rank keeps the groups it created and, when a later test asks for a
group with the same arguments (ranks, backend, timeout, description, options
absent), hands out the one it has: the n-th call with some arguments in a test
(or subtest) gets the n-th group created with them, so that groups a test asks
for separately stay distinct, as without the cache. The count starts again when
the harness releases a test's or subtest's groups (``GroupTracker.destroy_since``). ``new_group`` and ``split_group`` are
replaced in ``torch.distributed``'s modules once, when the pool starts (before
the baseline of [Note: What a test may leak, and how it is undone] is taken, so
the baseline keeps the replacement). Every rank runs the same tests in the same
order and makes the same calls, so every rank hits or misses together: a miss
creates the group collectively, as without the cache.

What could make the ranks' caches disagree is handled where all ranks see it:
- a test destroys a group it was handed (``destroy_process_group``): its member
  ranks notice at the end of the test (the group left ``_world.pg_map``) and say
  so in ``TestFinished.groups_dirty``; the controller then sends ``Probe`` to
  every rank, and every rank empties its cache before probing;
- a test that did not pass cleanly may leave a collective pending on a cached
  group: the controller probes after it too, so the cache is emptied the same
  way (an NCCL group with a pending collective may hang in its destruction: the
  probe's timeout then replaces the pool).
One case stays out of reach: a test that destroys a group of some of the ranks
and asks for the same group again in a later subtest; the ranks outside the
group hold no group to see destroyed, so they would skip the creation their
peers repeat. Such a test needs the ``fresh_pool`` marker or ``--fresh-groups``.
Groups created with ``pg_options`` (or an argument this module does not know)
are never cached. ``--fresh-groups`` turns the cache off: every test then
creates and destroys its groups, and the leak check sees each of them.
"""

from __future__ import annotations

import collections
import datetime
import functools
import inspect
import sys
from collections.abc import Callable, Hashable
from typing import Any

import torch.distributed as dist

_REPLACED = ("new_group", "split_group")
_KNOWN = {
    "new_group": {"ranks", "timeout", "backend", "use_local_synchronization", "group_desc"},
    "split_group": {"parent_pg", "split_ranks", "timeout", "group_desc", "backend"},
}
_ABSENT = (None, False, True)  # a default other than these makes the call uncacheable


class GroupCache:
    """The groups this rank created, by the arguments that created them."""

    def __init__(self) -> None:
        self._groups: dict[Hashable, list[object]] = {}
        self._handed: collections.Counter[Hashable] = collections.Counter()

    # -- installing -----------------------------------------------------------

    def install(self) -> None:
        """Replaces ``new_group``/``split_group`` wherever torch.distributed's
        modules bound them."""
        c10d = dist.distributed_c10d
        for name in _REPLACED:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            replacement = self._caching(name, original)
            for module in list(sys.modules.values()):
                if getattr(module, "__name__", "").startswith("torch.distributed") and (
                    vars(module).get(name) is original
                ):
                    setattr(module, name, replacement)

    def _caching(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def cached(*args: Any, **kwargs: Any) -> Any:
            key = _key(name, signature, args, kwargs)
            if key is None:
                return original(*args, **kwargs)
            return self._hand_out(key, lambda: original(*args, **kwargs))

        return cached

    def _hand_out(self, key: Hashable, create: Callable[[], object]) -> object:
        kept = self._groups.setdefault(key, [])
        n = self._handed[key]
        self._handed[key] += 1
        if n < len(kept) and _alive(kept[n]):
            return kept[n]
        group = create()
        if n < len(kept):
            kept[n] = group  # in place of one the test destroyed
        else:
            kept.append(group)
        return group

    # -- what the rank asks ---------------------------------------------------

    def rewind(self) -> None:
        """A test or subtest ended: the next one is handed the same groups again."""
        self._handed.clear()

    def _all(self) -> list[object]:
        return [g for kept in self._groups.values() for g in kept]

    def size(self) -> int:
        """How many process groups the cache keeps."""
        return sum(isinstance(g, dist.ProcessGroup) for g in self._all())

    def holds(self, group: object) -> bool:
        return any(group is g for g in self._all())

    def dirty(self) -> bool:
        """Whether a group this cache handed out was destroyed by someone else."""
        return any(not _alive(g) for g in self._all())

    def clear(self) -> None:
        """Destroys the cached groups still alive and forgets them all (on every
        rank at the same point: see the note)."""
        groups, self._groups = self._all(), {}
        self._handed.clear()
        for group in groups:
            if isinstance(group, dist.ProcessGroup) and _alive(group):
                dist.destroy_process_group(group)


def _key(
    name: str, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Hashable | None:
    """The cache key of a call, or None when the call must not be cached."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None  # the original raises the user's error
    bound.apply_defaults()
    parts: list[Hashable] = [name]
    for arg, value in bound.arguments.items():
        if arg not in _KNOWN[name]:
            if not any(value is absent for absent in _ABSENT) and value != "":
                return None  # pg_options, device_id, ...: not cached
            continue
        normal = _normal(arg, value)
        if normal is _UNCACHEABLE:
            return None
        parts.append((arg, normal))
    return tuple(parts)


_UNCACHEABLE = object()


def _normal(arg: str, value: Any) -> Hashable:
    if value is None or isinstance(value, (bool, str, int, datetime.timedelta)):
        return value
    if arg == "ranks":
        return tuple(int(r) for r in value)
    if arg == "split_ranks":
        return tuple(tuple(int(r) for r in part) for part in value)
    if arg == "parent_pg" and isinstance(value, dist.ProcessGroup):
        return ("pg", value.group_name) if _alive(value) else _UNCACHEABLE
    if isinstance(value, dist.Backend) or type(value).__name__ == "Backend":
        return str(value)
    return _UNCACHEABLE


def _alive(group: object) -> bool:
    """A group is alive while registered; ``new_group``'s marker for ranks outside
    the group (and ``split_group``'s None) stand for a group of other ranks, which
    the cache keeps as it keeps the group (so that every rank skips the call)."""
    if not isinstance(group, dist.ProcessGroup):
        return True
    return dist.is_initialized() and group in dist.distributed_c10d._world.pg_map


_CACHE: GroupCache | None = None


def install() -> GroupCache:
    global _CACHE
    _CACHE = GroupCache()
    _CACHE.install()
    return _CACHE


def active() -> GroupCache | None:
    return _CACHE
