"""A pytest-native runner for distributed tests: real processes, real process groups."""

from harness.parametrize import parametrize, subtest_name
from harness.testcase import DistributedTest, FSDPTest, current_device

__all__ = ["DistributedTest", "FSDPTest", "current_device", "parametrize", "subtest_name"]
