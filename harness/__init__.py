"""A pytest-native runner for distributed tests: real processes, real process groups."""

from harness._controller.report import PoolLeakWarning
from harness.parametrize import parametrize, subtest_name
from harness.testcase import DistributedTest, current_device, current_device_type

__all__ = [
    "DistributedTest",
    "PoolLeakWarning",
    "current_device",
    "current_device_type",
    "parametrize",
    "subtest_name",
]
