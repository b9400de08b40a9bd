"""A pytest-native runner for distributed tests: real processes, real process groups."""

from harness.parametrize import parametrize, subtest_name
from harness.testcase import DistributedTest, FSDPTest

__all__ = ["DistributedTest", "FSDPTest", "parametrize", "subtest_name"]
