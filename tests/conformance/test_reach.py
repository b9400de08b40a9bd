"""The reach table, ``docs/reach.md`` (see [Note: How reach is measured] in
fsdptest.reach): it lists every public argument, method, config field and
environment variable of both implementations; what it marks drawn, a fresh
sample draws; and each row no search draws names a reason and a test that
exists."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from functools import cache
from pathlib import Path

import hypothesis
import pytest

from fsdptest.reach import surface
from fsdptest.reach.table import COMMAND, build, render
from fsdptest.reach.undrawn import UNDRAWN

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "reach.md"
IMPLEMENTATIONS = ("fsdp", "torch.distributed.fsdp")
_ROW = re.compile(r"^\| `(?P<key>.*?)` \| (?P<marks>.*?) \| (?P<why>[^|]*) \|$")
_SAMPLE = re.compile(r"Sample: (?P<count>\d+) drawn .*? hypothesis (?P<version>[\w.]+)\.", re.S)


@cache
def _doc() -> str:
    assert DOC.exists(), f"{DOC} is missing: rebuild it with `{COMMAND}`"
    return DOC.read_text()


@cache
def _doc_rows() -> dict[str, tuple[bool, str]]:
    """Each row of the table: drawn by some search, and its why-not cell."""
    rows: dict[str, tuple[bool, str]] = {}
    for line in _doc().splitlines():
        match = _ROW.match(line)
        if match and match["key"] != "Row":
            key = match["key"].replace("\\|", "|")
            rows[key] = ("yes" in match["marks"].split(" | "), match["why"])
    return rows


def _module(name: str) -> object:
    return pytest.importorskip(name)


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_every_constructor_argument_is_a_row(name: str) -> None:
    fsdp_class = _module(name).FullyShardedDataParallel  # type: ignore[attr-defined]
    params = inspect.signature(fsdp_class.__init__).parameters
    rows = _doc_rows()
    plain = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    missing = [
        p.name
        for p in params.values()
        if p.name not in ("self", "module")
        and p.kind not in plain
        and not any(key.startswith(f"FSDP({p.name}=") for key in rows)
    ]
    assert not missing, f"{name}'s constructor arguments not in {DOC.name}: {missing}"


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_every_public_method_and_argument_is_a_row(name: str) -> None:
    fsdp_class = _module(name).FullyShardedDataParallel  # type: ignore[attr-defined]
    rows = _doc_rows()
    missing: list[str] = []
    for method, value in vars(fsdp_class).items():
        if method.startswith("_") or isinstance(value, property):
            continue
        function = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
        if not callable(function):
            continue
        wanted = [f"{method}()"]
        for p in inspect.signature(function).parameters.values():
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                wanted.append(f"{method}({p.name})")
        missing += [row for row in wanted if row not in rows]
    assert not missing, f"{name}'s public methods or arguments not in {DOC.name}: {missing}"


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_every_config_field_is_a_row(name: str) -> None:
    module = _module(name)
    rows = _doc_rows()
    missing: list[str] = []
    for cls_name in dir(module):
        cls = getattr(module, cls_name)
        fsdp1 = not cls_name.startswith("_") and cls_name not in surface.FSDP2_NAMES
        if not (fsdp1 and inspect.isclass(cls) and dataclasses.is_dataclass(cls)):
            continue
        for field in dataclasses.fields(cls):
            if not any(key.startswith(f"{cls_name}.{field.name}=") for key in rows):
                missing.append(f"{cls_name}.{field.name}")
    assert not missing, f"{name}'s config fields not in {DOC.name}: {missing}"


def test_every_environment_variable_is_a_row() -> None:
    names = surface.torch_environment_variables()
    assert names, "no environment variable found in torch's FSDP sources: the scan is broken"
    missing = [n for n in names if f"env {n}" not in _doc_rows()]
    assert not missing, f"environment variables torch's FSDP reads, not in {DOC.name}: {missing}"


def test_the_table_lists_the_surface() -> None:
    """The table's rows are today's surface, in order (a new argument or method
    of either implementation is a new row, and the table must be rebuilt)."""
    assert list(_doc_rows()) == [row.key for row in surface.all_rows()], (
        f"{DOC.name} does not list today's surface: rebuild it with `{COMMAND}`"
    )


def test_each_undrawn_row_has_a_reason_and_a_test() -> None:
    undrawn = [key for key, (drawn, _) in _doc_rows().items() if not drawn]
    without = [key for key in undrawn if key not in UNDRAWN]
    assert not without, f"rows no search draws, without a reason: {without}"
    stale = sorted(set(UNDRAWN) - set(undrawn))
    assert not stale, f"reasons given for rows that are drawn or not rows at all: {stale}"
    missing = [
        f"{key}: {UNDRAWN[key].test}" for key in undrawn if not _test_exists(UNDRAWN[key].test)
    ]
    assert not missing, "fixed tests that do not exist:\n" + "\n".join(missing)


def test_drawn_claims_hold_in_a_fresh_sample() -> None:
    """Rebuilt from a fresh sample of the recorded size, the table is the same."""
    match = _SAMPLE.search(_doc())
    assert match, f"{DOC.name} does not record its sample"
    if match["version"] != hypothesis.__version__:
        pytest.skip(
            f"{DOC.name} was sampled with hypothesis {match['version']}, this is "
            f"{hypothesis.__version__}: another version draws other samples"
        )
    fresh = render(build(int(match["count"])))
    assert fresh == _doc(), f"a fresh sample gives another table: rebuild it with `{COMMAND}`"


def _test_exists(node_id: str) -> bool:
    """``path``, ``path::test``, ``path::Class`` or ``path::Class::test``,
    with the names defined in the file (or inherited from a class defined there)."""
    path, *names = node_id.split("::")
    file = ROOT / path
    if not file.is_file():
        return False
    classes = {
        node.name: node
        for node in ast.parse(file.read_text()).body
        if isinstance(node, ast.ClassDef)
    }
    if not names:
        return True
    if len(names) == 1:
        return names[0] in classes or _defines(ast.parse(file.read_text()), names[0])
    return _class_defines(classes, names[0], names[1])


def _defines(tree: ast.Module, name: str) -> bool:
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body)


def _class_defines(classes: dict[str, ast.ClassDef], cls: str, name: str) -> bool:
    node = classes.get(cls)
    if node is None:
        return False
    if any(isinstance(n, ast.FunctionDef) and n.name == name for n in node.body):
        return True
    bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
    return any(_class_defines(classes, base, name) for base in bases)
