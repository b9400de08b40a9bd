"""What a test body sees of its rank: identity, device and the subtest gate."""

from __future__ import annotations

import traceback
import unittest
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection

import pytest
import torch

from harness import subtests
from harness._frames import is_harness_file
from harness._protocol import Proceed, Status, SubtestFinished, SubtestStarted
from harness._rank.isolation import GroupTracker


class SubtestsFailed(AssertionError):
    """Raised by ``run_subtests`` after the last combination if any failed.

    The per-combination errors were already sent to the pytest process, which
    reports them; this exception only stops the rest of the test body.
    """


SKIP_EXCEPTIONS: tuple[type[BaseException], ...] = (unittest.SkipTest, pytest.skip.Exception)


def format_exception(exc: BaseException) -> str:
    """The traceback without the harness's own frames above the test code."""
    tb = exc.__traceback__
    while tb is not None and is_harness_file(tb.tb_frame.f_code.co_filename):
        if tb.tb_next is None:
            break
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def skip_reason(exc: BaseException) -> str:
    if isinstance(exc, pytest.skip.Exception):
        return str(exc.msg)
    return str(exc)


class SubtestSpace:
    """What the ``run_subtests`` calls of one test offered a ``--subtest`` filter:
    each key with its values (as reports print them), and which pairs of the
    filter matched some combination. Kept only while a filter is active."""

    wanted: tuple[tuple[str, str], ...]
    values: dict[str, dict[str, None]]  # key -> its rendered values, in order
    hits: list[bool]

    def __init__(self, wanted: tuple[tuple[str, str], ...]) -> None:
        self.wanted = wanted
        self.values: dict[str, dict[str, None]] = {}
        self.hits = [False] * len(wanted)

    def add(self, config: Mapping[str, Sequence[object]]) -> None:
        for key, values in config.items():
            seen = self.values.setdefault(key, {})
            for value in values:
                seen[subtests.render_value(value)] = None
                for i, pair in enumerate(self.wanted):
                    self.hits[i] = self.hits[i] or subtests.matches({key: value}, (pair,))

    def offered(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        return tuple((key, tuple(values)) for key, values in self.values.items())


@dataclass
class RankContext:
    """The harness state of one rank for the test that is running."""

    rank: int
    world_size: int
    device: torch.device
    backend: str
    conn: Connection
    groups: GroupTracker
    subtest_filter: tuple[tuple[str, str], ...] = ()
    resume_after: int = -1
    next_index: int = 0
    deselected: int = 0
    any_subtest_failed: bool = False
    space: SubtestSpace | None = None  # under a --subtest filter only

    def run_subtests(
        self,
        config: Mapping[str, Sequence[object]],
        fn: Callable[..., object],
        args: tuple[object, ...],
        kwargs: dict[str, object],
    ) -> None:
        config = _checked_config(config)
        if self.subtest_filter:
            self.space = self.space or SubtestSpace(self.subtest_filter)
            self.space.add(config)
        failed_here = False
        for combo in subtests.combinations(config):
            index = self.next_index
            self.next_index += 1
            if index <= self.resume_after:
                continue
            if not subtests.matches(combo.kwargs, self.subtest_filter):
                self.deselected += 1
                continue
            failed_here |= self._run_one(index, combo, fn, args, kwargs)
        if failed_here:
            raise SubtestsFailed("one or more subtests failed; see the subtest report")

    def _run_one(
        self,
        index: int,
        combo: subtests.Combination,
        fn: Callable[..., object],
        args: tuple[object, ...],
        kwargs: dict[str, object],
    ) -> bool:
        rendered = combo.render()
        self.conn.send(SubtestStarted(self.rank, index, rendered, self.deselected))
        status, text = Status.PASSED, ""
        before = self.groups.live()
        try:
            fn(*args, **kwargs, **combo.kwargs)
        except SKIP_EXCEPTIONS as exc:
            status, text = Status.SKIPPED, skip_reason(exc)
        except Exception as exc:
            status, text = Status.FAILED, format_exception(exc)
        self.groups.release_since(before)
        self.conn.send(SubtestFinished(self.rank, index, rendered, status, text))
        reply = self.conn.recv()
        assert isinstance(reply, Proceed) and reply.index == index, reply
        self.any_subtest_failed |= reply.any_failed
        return reply.any_failed


def _checked_config(config: Mapping[str, Sequence[object]]) -> dict[str, list[object]]:
    """The configuration with its values listed; one whose product is empty is an
    error, not zero subtests that pass (a key without values checks nothing)."""
    listed = {key: list(values) for key, values in config.items()}
    empty = [key for key, values in listed.items() if not values]
    if empty:
        names = ", ".join(repr(key) for key in empty)
        raise ValueError(
            f"run_subtests: {names} {'has' if len(empty) == 1 else 'have'} no values, so the "
            "configuration has no combination and the call would check nothing"
        )
    return listed


_CURRENT: RankContext | None = None


def current() -> RankContext:
    if _CURRENT is None:
        raise RuntimeError(
            "No rank context: this is only available inside a test body running in a rank "
            "process of the harness."
        )
    return _CURRENT


def current_or_none() -> RankContext | None:
    return _CURRENT


def activate(context: RankContext | None) -> None:
    global _CURRENT
    _CURRENT = context
