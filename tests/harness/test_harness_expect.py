"""``assertExpectedInline`` inside rank processes: ``EXPECTTEST_ACCEPT=1`` rewrites the
right literals of the test file even when processes of several pools edit it in
turn, a plain run then passes, and a changed text fails with a readable diff."""

from __future__ import annotations

import ast
import re
import textwrap
from typing import Any

import pytest

from harness.expect import _first_line

SOURCE = textwrap.dedent(
    '''
    import os
    from harness import DistributedTest

    def text(ranks, label):
        lines = [f"{label}: line {i} of {ranks}" for i in range(ranks)]
        return "\\n".join(lines) + "\\n" + os.environ.get("EXTRA", "")

    class TestTwoRanks(DistributedTest):
        def test_a(self):
            self.assertExpectedInline(text(self.world_size, "a"), """""")

        def test_nested(self):
            def check():
                self.assertExpectedInline(text(self.world_size, "nested"), """""")
            check()

    class TestThreeRanks(DistributedTest):
        world_size = 3

        def test_b(self):
            self.assertExpectedInline(text(self.world_size, "b"), """""")

    class TestTwoRanksAgain(DistributedTest):
        def test_c(self):
            self.assertExpectedInline(text(self.world_size, "c"), """""")
    '''
)


def _literals(source: str) -> list[str]:
    """The expected literals of the file's assertExpectedInline calls, in source order."""
    calls = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "assertExpectedInline"
    ]
    calls.sort(key=lambda call: call.lineno)
    return [ast.literal_eval(call.args[1]) for call in calls]


def test_accept_rewrites_the_literals_from_every_pool(inner: Any, monkeypatch: pytest.MonkeyPatch):
    """The ranks of a two-rank pool edit test_a and test_nested, a three-rank pool then
    edits test_b below them, and the two-rank pool (its line numbers now stale by the
    other pool's edit) edits test_c: every literal gets its own text, written once."""
    monkeypatch.setenv("EXPECTTEST_ACCEPT", "1")
    run = inner(SOURCE, "-v")
    run.result.assert_outcomes(passed=4)
    source = (run.path / "test_inner.py").read_text()
    assert _literals(source) == [
        "a: line 0 of 2\na: line 1 of 2\n",
        "nested: line 0 of 2\nnested: line 1 of 2\n",
        "b: line 0 of 3\nb: line 1 of 3\nb: line 2 of 3\n",
        "c: line 0 of 2\nc: line 1 of 2\n",
    ]
    emptied = re.sub(r'"""\\\n.*?"""', '""""""', source, flags=re.S)
    assert emptied.strip() == SOURCE.strip(), "lines other than the literals changed"

    monkeypatch.delenv("EXPECTTEST_ACCEPT")
    again = inner(source)
    again.result.assert_outcomes(passed=4)

    monkeypatch.setenv("EXTRA", "a line more\n")
    changed = inner(source, "-k", "test_b")
    changed.result.assert_outcomes(failed=1)
    report = changed.section("test_b")
    assert report.splitlines()[0].startswith("3 of 3 ranks failed: rank 0, rank 1, rank 2")
    assert "Mismatch between actual and expect strings:" in report
    assert " b: line 2 of 3\n+a line more\n" in report
    assert "re-run the test with EXPECTTEST_ACCEPT=1" in report


def test_first_line_finds_methods_nested_functions_and_decorators() -> None:
    tree = ast.parse(
        textwrap.dedent(
            """
            class A:
                @staticmethod
                @other
                def f():
                    with x:
                        def g():
                            pass
            def h():
                pass
            """
        )
    )
    assert _first_line(tree, "A.f") == 3
    assert _first_line(tree, "A.f.<locals>.g") == 7
    assert _first_line(tree, "h") == 9
    assert _first_line(tree, "A") is None
    assert _first_line(tree, "missing") is None


def test_plain_assert_shows_a_unified_diff() -> None:
    from harness.assertions import Assertions

    with pytest.raises(AssertionError) as error:
        Assertions().assertExpectedInline("x\ny\n", """x\nz\n""")
    assert "-z\n+y\n" in str(error.value)
