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
the harness releases a test's or subtest's groups (``GroupTracker.destroy_since``).
``new_group`` and ``split_group`` are replaced in ``torch.distributed``'s modules
once, when the pool starts (before the baseline of [Note: What a test may leak,
and how it is undone] is taken, so the baseline keeps the replacement).

The ranks decide together. Torch requires every rank of the default group to
call ``new_group`` (the group's ranks only under ``use_local_synchronization``;
every rank of the parent for ``split_group``), but not with the same arguments
everywhere: upstream's mixture of experts asks ``new_group([rank])`` on each
rank. So one rank may hold a group for a call while its peer holds none for its
own call (rank 0 kept ``new_group([0])`` from the experts, rank 1 kept
``new_group([1])``, and a later test asks both for ``new_group([0])``). On gloo
a rank outside a new group does nothing, so that went unseen; on NCCL with the
default group bound to a device the rank outside splits the default
communicator with "no colour", which waits for every rank to split: a rank that
skipped the call (a hit) and one that made it (a miss) hung there (run 67,
docs/runs/gpu-runs.md). So each call's participants tell each other, through the
default group's store, whether they hold a live group for it: they reuse only if
every one of them does, else every one of them calls torch, and a group that
call displaces is destroyed with the cache. A test that destroys a group of
some of the ranks and asks for it again is the same case (its members miss, the
others hit): it too creates the group again everywhere.

What else could make the ranks' caches disagree is handled where all ranks see it:
- a test destroys a group it was handed (``destroy_process_group``): its member
  ranks notice at the end of the test (the group left ``_world.pg_map``) and say
  so in ``TestFinished.groups_dirty``; the controller then sends ``Probe`` to
  every rank, and every rank empties its cache before probing;
- a test that did not pass cleanly may leave a collective pending on a cached
  group, or its ranks may have made different numbers of calls: the controller
  probes after it too, so the cache is emptied the same way (an NCCL group with a
  pending collective may hang in its destruction: the probe's timeout then
  replaces the pool).
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
from collections.abc import Callable, Hashable, Iterable
from typing import Any, NamedTuple

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
        self._displaced: list[object] = []  # live groups a call replaced, until clear()
        self._agreement = Agreement()

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
            call = _call(name, signature, args, kwargs)
            if call is None:
                return original(*args, **kwargs)
            return self._hand_out(call, lambda: original(*args, **kwargs))

        return cached

    def _hand_out(self, call: Call, create: Callable[[], object]) -> object:
        kept = self._groups.setdefault(call.key, [])
        n = self._handed[call.key]
        self._handed[call.key] += 1
        holds = n < len(kept) and _alive(kept[n])
        if self._agreement.every_participant_holds(call, holds):
            return kept[n]
        group = create()
        if n < len(kept):
            if holds:
                self._displaced.append(kept[n])  # a peer held none: see the note
            kept[n] = group
        else:
            kept.append(group)
        return group

    # -- what the rank asks ---------------------------------------------------

    def rewind(self) -> None:
        """A test or subtest ended: the next one is handed the same groups again."""
        self._handed.clear()

    def _all(self) -> list[object]:
        return [g for kept in self._groups.values() for g in kept] + self._displaced

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
        groups, self._groups, self._displaced = self._all(), {}, []
        self._handed.clear()
        self._agreement.restart()
        for group in groups:
            if isinstance(group, dist.ProcessGroup) and _alive(group):
                dist.destroy_process_group(group)


class Agreement:
    """Whether every participant of a call holds a live group for it, told
    through the default group's store (see the note): each call of a set of
    participants is numbered, and every participant makes the same calls."""

    def __init__(self) -> None:
        self._epoch = 0  # restarts with the cache, on every rank at once
        self._calls: collections.Counter[tuple[int, ...]] = collections.Counter()

    def every_participant_holds(self, call: Call, holds: bool) -> bool:
        me, participants = dist.get_rank(), call.participants
        if me not in participants or len(participants) == 1:
            return holds
        number = self._calls[participants]
        self._calls[participants] += 1
        prefix = f"harness/group-cache/{self._epoch}/{_joined(participants)}/{number}"
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{prefix}/{me}", b"1" if holds else b"0")
        peers = {rank: f"{prefix}/{rank}" for rank in participants if rank != me}
        try:
            store.wait(list(peers.values()), _PEERS_WAIT)
        except RuntimeError as error:  # DistStoreError: a peer never made the call
            missing = [rank for rank, key in peers.items() if not store.check([key])]
            raise RuntimeError(
                f"rank {me} called {call.name} (call {number} of ranks {_joined(participants)} "
                f"in this pool), and rank(s) {_joined(missing)} did not within "
                f"{_PEERS_WAIT.total_seconds():.0f} s: torch requires every rank of the "
                f"default group to call {call.name} (only the group's ranks under "
                "use_local_synchronization=True), and the harness's reuse of groups "
                "relies on it; mark the test fresh_pool or run with --fresh-groups if "
                "its ranks must differ"
            ) from error
        return holds and all(store.get(key) == b"1" for key in peers.values())

    def restart(self) -> None:
        self._epoch += 1
        self._calls.clear()


_PEERS_WAIT = datetime.timedelta(seconds=60)


class Call(NamedTuple):
    """A cacheable call: what it asked for, and which ranks make it."""

    name: str
    key: Hashable
    participants: tuple[int, ...]


def _joined(ranks: Iterable[int]) -> str:
    return ",".join(str(rank) for rank in ranks)


def _call(
    name: str, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Call | None:
    """The call to cache, or None when it must not be cached."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None  # the original raises the user's error
    bound.apply_defaults()
    key = _key(name, bound.arguments)
    if key is None:
        return None
    return Call(name, key, _participants(name, bound.arguments))


def _participants(name: str, arguments: dict[str, Any]) -> tuple[int, ...]:
    """The ranks torch requires to make the call."""
    if name == "new_group" and arguments.get("use_local_synchronization"):
        ranks = arguments.get("ranks")
        if ranks:
            return tuple(sorted(int(r) for r in ranks))
    parent = arguments.get("parent_pg") if name == "split_group" else None
    if parent is not None:
        return tuple(sorted(dist.get_process_group_ranks(parent)))
    return tuple(range(dist.get_world_size()))


def _key(name: str, arguments: dict[str, Any]) -> Hashable | None:
    """The cache key of a call's arguments, or None when the call must not be cached."""
    parts: list[Hashable] = [name]
    for arg, value in arguments.items():
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
