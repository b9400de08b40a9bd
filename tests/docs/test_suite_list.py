"""``docs/suites.md`` is the suite list the tree gives (``bench/suite_list.py``),
made again from ``suites/`` on every run, so a suite added or changed without
``python bench/suite_list.py --write`` fails here."""

from __future__ import annotations

import ast
import difflib
import importlib.util
from pathlib import Path
from types import ModuleType

from tests.docs.doc_text import ROOT


def suite_list() -> ModuleType:
    """``bench/suite_list.py`` as a module (``bench/`` is not a package)."""
    spec = importlib.util.spec_from_file_location("suite_list", ROOT / "bench" / "suite_list.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_suites_md_is_what_the_tree_gives() -> None:
    """``docs/suites.md`` equals what ``bench/suite_list.py`` makes of the tree now."""
    written = (ROOT / "docs" / "suites.md").read_text()
    made = suite_list().render()
    diff = "".join(
        difflib.unified_diff(
            written.splitlines(keepends=True),
            made.splitlines(keepends=True),
            "docs/suites.md",
            "the tree",
            n=1,
        )
    )
    assert written == made, f"run: python bench/suite_list.py --write\n{diff}"


def test_every_suite_file_is_listed() -> None:
    """Each ``suites/**/test_*.py`` has its row, linked to the file."""
    written = (ROOT / "docs" / "suites.md").read_text()
    missing = [
        path.relative_to(ROOT).as_posix()
        for path in sorted((ROOT / "suites").rglob("test_*.py"))
        if f"](../{path.relative_to(ROOT).as_posix()})" not in written
    ]
    assert not missing, f"suite files docs/suites.md does not list: {missing}"


def test_the_list_follows_a_change_of_the_tree(tmp_path: Path) -> None:
    """A suite added to a tree changes the list made from it: the count line, and
    a row with the suite's first sentence and its classes and tests."""
    module = suite_list()
    root = tmp_path / "suites"
    root.mkdir()
    (root / "test_one.py").write_text(
        '"""One suite. More."""\n\nclass TestA:\n    def test_x(self): ...\n\ndef test_y(): ...\n'
    )
    before = module.suite_files(root)
    (root / "test_two.py").write_text('"""Another suite."""\n')
    after = module.suite_files(root)
    assert [(f.summary, f.classes, f.tests) for f in before] == [("One suite.", 1, 2)]
    assert [f.path.name for f in after] == ["test_one.py", "test_two.py"]
    assert module.summary(ast.get_docstring(ast.parse('"""A | b. C."""'))) == "A \\| b."
