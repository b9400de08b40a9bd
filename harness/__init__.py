"""A pytest-native runner for distributed tests: real processes, real process groups."""

from harness._controller.report import PoolLeakWarning
from harness.parametrize import parametrize, subtest_name
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
