"""Calls to pooled ranks from a test that runs in the pytest process.

[Note: Tests that drive the ranks]
The body of a ``DistributedTest`` runs on the ranks. Some tests are better
driven from the pytest process: a property-based test draws its examples and
shrinks a failing one there, and hands each example to the ranks on its own.
``rank_calls`` (a session fixture) runs a method of a ``DistributedTest``
subclass with keyword arguments on every rank of a pool of ``world_size`` ranks
exactly as the harness runs a test method: ``setUp``/``tearDown`` around it,
the ranks restored and reseeded after it, a failing rank's peers stopped with
their stacks, a dead or hung pool replaced before the next call. It returns the
verdict instead of failing the calling test, so the caller decides what a
failure means (hypothesis shrinks it). A call counts as a distributed test in
the pools' summary line.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from harness._controller.dispatch import PoolManager, TestRequest, run
from harness._controller.report import PoolLeakWarning
from harness._protocol import RunTest, Status
from harness._types import Placement, PoolKey
from harness.testcase import DistributedTest


@dataclass(frozen=True)
class CallOutcome:
    """What the ranks did with one call: ``report`` is the harness's failure
    report (every failing rank's traceback, stacks of stopped ranks) or the skip
    reason; ``outputs`` are the ranks' captured outputs, by rank."""

    status: Status
    report: str
    outputs: dict[int, str]

    @property
    def passed(self) -> bool:
        return self.status is Status.PASSED

    @property
    def failed(self) -> bool:
        return self.status is Status.FAILED


@dataclass(frozen=True)
class CallSettings:
    """How the pytest process dispatches calls (from its options)."""

    manager: PoolManager
    timeout_s: float
    grace_s: float
    rewrite_asserts: bool
    seed: int


class RankCalls:
    """Runs methods of ``DistributedTest`` subclasses on pooled ranks (see the note)."""

    def __init__(
        self,
        settings: CallSettings,
        placement_of: Callable[[int], Placement | str],
        on_call: Callable[[], None] = lambda: None,
    ) -> None:
        self._settings = settings
        self._placement_of = placement_of
        self._on_call = on_call

    def device_type(self, world_size: int) -> str | None:
        """Where ``world_size`` ranks would run (``"cpu"``, ``"cuda"``), or None
        when they cannot run here."""
        placement = self._placement_of(world_size)
        return None if isinstance(placement, str) else placement.device_type

    def run(
        self,
        test_class: type[DistributedTest],
        method: str,
        world_size: int,
        timeout_s: float | None = None,
        **kwargs: object,
    ) -> CallOutcome:
        """Runs ``test_class().method(**kwargs)`` on ``world_size`` ranks, as a test
        method runs (``setUp`` and ``tearDown`` around it); ``test_class`` is
        defined at module level in an importable file, ``kwargs`` are pickled to
        the ranks. ``timeout_s`` bounds the ranks' time (default:
        ``--dist-timeout``). Fails the calling test when the ranks cannot run
        here (``--device cuda`` without enough GPUs), as a ``DistributedTest``
        would fail."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(
                f"world_size must be a whole number of ranks, at least 1: {world_size!r}"
            )
        placement = self._placement_of(world_size)
        if isinstance(placement, str):
            pytest.fail(placement, pytrace=False)
        self._on_call()
        request = TestRequest(
            key=PoolKey(world_size, placement.device_type),
            placement=placement,
            message=_message(test_class, method, kwargs, self._settings),
            fresh_pool=False,
            timeout_s=self._settings.timeout_s if timeout_s is None else timeout_s,
            grace_s=self._settings.grace_s,
        )
        verdict = run(self._settings.manager, request)
        for text in verdict.warnings:
            warnings.warn(PoolLeakWarning(text), stacklevel=2)
        return CallOutcome(verdict.status, verdict.full_text(), verdict.outputs)


def _message(
    test_class: type[DistributedTest],
    method: str,
    kwargs: dict[str, object],
    settings: CallSettings,
) -> RunTest:
    if not (isinstance(test_class, type) and issubclass(test_class, DistributedTest)):
        raise TypeError(f"{test_class!r} is not a DistributedTest subclass")
    if "<locals>" in test_class.__qualname__:
        raise TypeError(f"{test_class.__qualname__} is not defined at module level")
    if not callable(getattr(test_class, method, None)):
        raise TypeError(f"{test_class.__qualname__} has no method {method!r}")
    module = sys.modules[test_class.__module__]
    return RunTest(
        nodeid=f"{module.__name__}::{test_class.__qualname__}::{method}",
        module_name=module.__name__,
        module_file=str(module.__file__),
        class_qualname=test_class.__qualname__,
        method_name=method,
        kwargs=dict(kwargs),
        seed=settings.seed,
        sys_path=tuple(sys.path),
        rewrite_asserts=settings.rewrite_asserts,
        subtest_filter=(),
        resume_after=-1,
    )
