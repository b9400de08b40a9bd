"""A pytest-native runner for distributed tests: real processes, real process groups.

The names that need torch are imported on first use: the package's pytest
plugin (``harness.plugin``) loads in every pytest session of the environment,
and importing the package must not import torch for sessions that never run a
distributed test (see [Note: A plugin in every session] in harness.plugin).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from harness._controller.report import PoolLeakWarning
from harness.parametrize import parametrize, subtest_name

if TYPE_CHECKING:
    from harness.rank_calls import CallOutcome, RankCalls
    from harness.testcase import DistributedTest, current_device, current_device_type

__all__ = [
    "CallOutcome",
    "DistributedTest",
    "PoolLeakWarning",
    "RankCalls",
    "current_device",
    "current_device_type",
    "parametrize",
    "subtest_name",
]


def __getattr__(name: str) -> Any:
    if name in ("DistributedTest", "current_device", "current_device_type"):
        from harness import testcase

        return getattr(testcase, name)
    if name in ("CallOutcome", "RankCalls"):
        from harness import rank_calls

        return getattr(rank_calls, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
