"""What the docs name exists: every repository path ([Note: What counts as a cited
path] in ``tests/docs/doc_text.py``), every module path of the project's packages,
every ``[Note: Title]``; and no doc cites a file outside the repository."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

from tests.docs import doc_text
from tests.docs.doc_text import ROOT, Citation

DOCS = doc_text.doc_files()
# A note block: its title alone on a line (after ``#`` or a docstring's opening
# quotes), or opening a docstring's sentence as ``[Note: Title]: ...``.
_NOTE_BLOCK = re.compile(
    r'^\s*(?:#\s*|[rb]?"""\s*)?\[Note: ([^\]]+)\]\s*$|^\s*[rb]?"""[^\n]*?\[Note: ([^\]]+)\]:',
    re.M,
)
_ELLIPSIS = ("…", "...", "Title")  # "design notes are [Note: …] blocks": no title


def _ids(docs: list[Path]) -> list[str]:
    return [str(doc.relative_to(ROOT)) for doc in docs]


def _report(what: str, citations: list[Citation]) -> str:
    return f"{len(citations)} {what}:\n" + "\n".join(c.where() for c in citations)


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_cited_path_exists(doc: Path) -> None:
    """Each repository path the doc names is in the tree (a glob matches something)."""
    stale = [c for c in doc_text.cited_paths(doc) if not doc_text.path_exists(c.text)]
    assert not stale, _report("paths that are not in the repository", stale)


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_no_file_outside_the_repository_is_cited(doc: Path) -> None:
    """The docs speak of the repository only: a reader has no ``../shared``."""
    outside = doc_text.outside_citations(doc)
    assert not outside, _report("citations of files outside the repository", outside)


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_module_path_resolves(doc: Path) -> None:
    """Each ``package.module.name`` in backticks names a module of the tree, and a
    name that module binds (statically: no import)."""
    wrong = [c for c in doc_text.dotted_names(doc) if not resolves(c.text)]
    assert not wrong, _report("module paths that name nothing", wrong)


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_cited_note_exists(doc: Path) -> None:
    """Each ``[Note: Title]`` the doc points to is a note block somewhere in the code."""
    titles = defined_notes()
    cited = [c for c in doc_text.note_titles(doc) if c.text not in _ELLIPSIS]
    missing = [c for c in cited if " ".join(c.text.split()) not in titles]
    assert not missing, _report("notes no module defines", missing)


@cache
def defined_notes() -> frozenset[str]:
    """The titles of every note block in the project's Python files."""
    titles: set[str] = set()
    for folder in (*doc_text.PACKAGES, "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            for found in _NOTE_BLOCK.findall(path.read_text()):
                titles.update(" ".join(t.split()) for t in found if t)
    return frozenset(titles)


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a module of the tree, or a module and a name it binds
    (a class's attribute after it too)."""
    if re.search(r"\.(md|py|json|toml|txt)$", dotted):
        return True  # a file name (``suites.md``), which the path check covers
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        source = _module_source(parts[:end])
        if source is not None:
            return end == len(parts) or _binds(source, parts[end:])
    return False


def _module_source(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _binds(source: Path, names: list[str]) -> bool:
    module = ast.parse(source.read_text())
    bound = _bound_names(module.body)
    if names[0] not in bound:
        return "__getattr__" in bound  # a module that makes its names on demand
    if len(names) == 1:
        return True
    classes = [n for n in module.body if isinstance(n, ast.ClassDef) and n.name == names[0]]
    return not classes or names[1] in _bound_names(classes[0].body)


def _bound_names(body: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.If | ast.Try):
            names.update(_bound_names(node.body + node.orelse))
    return names


def test_the_path_check_fails_on_a_stale_path(tmp_path: Path) -> None:
    """A doc naming a file that is not there, or a folder outside the repository,
    is caught: the checks above can fail."""
    doc = ROOT / "docs" / "guide" / "layout.md"
    text = "See `suites/test_no_such_suite.py`, `harness/nothing/` and ../shared/STYLE.md.\n"
    fake = tmp_path / "fake.md"
    fake.write_text(text)
    cited = [c.text for c in doc_text.cited_paths(fake)]
    assert cited == ["suites/test_no_such_suite.py", "harness/nothing/"]
    assert not any(doc_text.path_exists(c) for c in cited)
    assert [c.text for c in doc_text.outside_citations(fake)] == ["../shared/STYLE.md"]
    assert doc_text.path_exists("suites/test_<name>.py") and doc.exists()
    assert not resolves("models.no_such_module") and not resolves("fsdp._comm.no_such_name")
    assert resolves("fsdptest.parity") and resolves("harness.expect.assert_expected_inline")
