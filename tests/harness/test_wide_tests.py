"""``bench/wide_tests.py``: ``--wide-tests N`` keeps the tests that run on at
least N ranks (a ``DistributedTest``'s world size, a function's ``world_size``
parameter), and a session left with none does not pass."""

from __future__ import annotations

import textwrap
from typing import Any

SOURCE = textwrap.dedent(
    """
    import pytest
    from harness import DistributedTest

    class TestTwo(DistributedTest):
        world_size = 2

        def test_two(self):
            pass

    class TestThree(DistributedTest):
        world_size = 3

        def test_three(self):
            pass

    @pytest.mark.parametrize("world_size", [2, 4])
    def test_function(world_size):
        pass

    def test_plain():
        pass
    """
)


def test_keeps_the_tests_of_at_least_n_ranks(inner: Any) -> None:
    run = inner(SOURCE, "-p", "bench.wide_tests", "--wide-tests", "3", "--collect-only", "-q")
    lines = run.result.stdout.lines
    # node ids are relative to the inner session's rootdir, which an ini file above the
    # temporary directory can move (on a GPU host: "pytest-of-root/.../test_inner.py::...")
    kept = sorted(
        line.split("test_inner.py::", 1)[1] for line in lines if "test_inner.py::" in line
    )
    assert kept == ["TestThree::test_three", "test_function[4]"], lines
    run.result.stdout.fnmatch_lines(["*2/5 tests collected (3 deselected)*"])


def test_none_kept_is_not_a_pass(inner: Any) -> None:
    run = inner(SOURCE, "-p", "bench.wide_tests", "--wide-tests", "5")
    assert run.result.ret != 0, run.result.stdout.str()
    run.result.stdout.fnmatch_lines(["*5 deselected*"])
