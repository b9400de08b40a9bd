"""The list of suites, ``docs/suites.md``, made from the tree: every file under
``suites/`` (subfolders included) with the first sentence of its module docstring
and how many test classes and test functions it defines; then what each suite
imports from ``fsdptest.api`` (what an implementation under ``--fsdp-impl`` must
provide for it).

Usage (from the checkout root)::

    python bench/suite_list.py            # print the list
    python bench/suite_list.py --write    # write docs/suites.md
    python bench/suite_list.py --check    # exit 1 when docs/suites.md is not what the tree gives

[Note: Suite counts as written]
The counts, and the names each suite imports from ``fsdptest.api``, are read
from the source with ``ast``, without importing anything:
classes named ``Test*`` and functions named ``test_*`` (in those classes,
inherited from classes of the same module as pytest collects them, or at the
module's top level), as written. A ``parametrize`` or a ``run_subtests``
multiplies a function into many tests or subtests; those collected counts
depend on the implementation and the machine, and are kept with their run in
``docs/runs/suite-counts.md``. Reading the source keeps the list cheap to check
on every run and the same on every machine.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
SUITES = ROOT / "suites"
OUTPUT = ROOT / "docs" / "suites.md"
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`(\[])")


class SuiteFile(NamedTuple):
    """One Python file under ``suites/``: what its docstring says, what it defines."""

    path: Path
    summary: str
    classes: int
    tests: int
    api_names: frozenset[str]

    @property
    def is_suite(self) -> bool:
        return self.path.name.startswith("test_")


def summary(docstring: str | None) -> str:
    """The first sentence of a docstring's first paragraph, on one line, in Markdown."""
    if not docstring:
        return "(no docstring)"
    paragraph = " ".join(docstring.split("\n\n")[0].split())
    sentence = _SENTENCE_END.split(paragraph, maxsplit=1)[0]
    return sentence.replace("``", "`").replace("|", "\\|")


def _test_names(cls: ast.ClassDef, classes: dict[str, ast.ClassDef]) -> set[str]:
    """The test methods pytest collects from ``cls``: its own and those it inherits
    from classes of the same module."""
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    names = {n.name for n in cls.body if isinstance(n, functions) and n.name.startswith("test_")}
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in classes and base.id != cls.name:
            names |= _test_names(classes[base.id], classes)
    return names


def read(path: Path) -> SuiteFile:
    """What ``path`` defines ([Note: Suite counts as written])."""
    module = ast.parse(path.read_text(), filename=str(path))
    classes = {node.name: node for node in module.body if isinstance(node, ast.ClassDef)}
    collected = [c for name, c in classes.items() if name.startswith("Test")]
    methods = sum(len(_test_names(c, classes)) for c in collected)
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    tops = sum(isinstance(n, functions) and n.name.startswith("test_") for n in module.body)
    docstring = summary(ast.get_docstring(module))
    return SuiteFile(path, docstring, len(collected), methods + tops, api_imports(module))


def api_imports(module: ast.Module) -> frozenset[str]:
    """The names ``module`` imports from ``fsdptest.api``, anywhere in it."""
    return frozenset(
        alias.name
        for node in ast.walk(module)
        if isinstance(node, ast.ImportFrom) and node.module == "fsdptest.api"
        for alias in node.names
    )


def _literal(path: Path, name: str) -> object:
    """The value of the module-level constant ``name`` of ``path`` (a literal)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(isinstance(t, ast.Name) and t.id == name for t in targets) and node.value:
                return ast.literal_eval(node.value)
    raise LookupError(f"{path.relative_to(ROOT)} has no literal {name}")


class NameKinds(NamedTuple):
    """The kinds of names ``fsdptest.api`` gives, read from where they are listed."""

    public: frozenset[str]
    private: frozenset[str]
    fsdp2: frozenset[str]

    @classmethod
    def read(cls) -> NameKinds:
        layer = ROOT / "fsdptest"
        public = _literal(layer / "api.py", "PUBLIC_NAMES")
        assert isinstance(public, dict)
        private = _literal(layer / "adapters.py", "PRIVATE_NAMES")
        fsdp2 = _literal(layer / "fsdp2.py", "FSDP2_NAMES")
        assert isinstance(private, tuple) and isinstance(fsdp2, tuple)
        names = frozenset(n for group in public.values() for n in group)
        return cls(names, frozenset(private), frozenset(fsdp2))

    def row(self, names: frozenset[str]) -> list[str]:
        """The cells of one suite: public, private, FSDP2, and the facade's own names."""
        kinds = (self.public, self.private, self.fsdp2)
        own = names - self.public - self.private - self.fsdp2
        return [_names(names & kind) for kind in kinds] + [_names(own)]


def _names(names: frozenset[str]) -> str:
    return ", ".join(f"`{name}`" for name in sorted(names, key=str.lower))


def suite_files(root: Path = SUITES) -> list[SuiteFile]:
    """Every Python file under ``root``, folder by folder, in name order."""
    paths = sorted(root.rglob("*.py"), key=lambda p: (p.parent.relative_to(root).parts, p.name))
    return [read(path) for path in paths if "__pycache__" not in path.parts]


def _folder_section(folder: Path, files: list[SuiteFile]) -> list[str]:
    name = folder.relative_to(ROOT).as_posix()
    lines = [f"## `{name}/`", ""]
    package = [f for f in files if f.path.name == "__init__.py" and f.summary != "(no docstring)"]
    lines += [package[0].summary, ""] if package else []
    lines += ["| file | classes | tests | what it pins down |", "|---|---|---|---|"]
    for f in files:
        if f.is_suite:
            link = f"[`{f.path.name}`](../{f.path.relative_to(ROOT).as_posix()})"
            lines.append(f"| {link} | {f.classes} | {f.tests} | {f.summary} |")
    helpers = [f for f in files if not f.is_suite and f.path.name != "__init__.py"]
    for f in helpers:
        lines += ["", f"Shared by the folder: `{f.path.relative_to(ROOT).as_posix()}`, {f.summary}"]
    return [*lines, ""]


def _needs_section(files: list[SuiteFile]) -> list[str]:
    kinds = NameKinds.read()
    lines = [
        "## What each suite takes from `fsdptest.api`",
        "",
        "What an implementation named by `--fsdp-impl` must provide for each suite:",
        "its public FSDP1 names, the private parts (which fall back or skip the",
        "test that uses them: `docs/guide/your-fsdp.md`), its FSDP2 names (stand-ins",
        "that skip where it has none), and the facade's own names (`FSDP` is",
        "`FullyShardedDataParallel`; `ADAPTER` answers what the implementation cannot",
        "do). The models import `fsdptest.api` too: "
        + _names(api_imports_of(ROOT / "models"))
        + ".",
        "",
        "| suite | public | private | FSDP2 | the facade's |",
        "|---|---|---|---|---|",
    ]
    for f in files:
        if f.is_suite and f.api_names:
            name = f.path.relative_to(SUITES).as_posix()
            lines.append(f"| `{name}` | " + " | ".join(kinds.row(f.api_names)) + " |")
    return [*lines, ""]


def api_imports_of(folder: Path) -> frozenset[str]:
    """What the modules of ``folder`` import from ``fsdptest.api``."""
    modules = (ast.parse(path.read_text()) for path in sorted(folder.rglob("*.py")))
    return frozenset().union(*(api_imports(module) for module in modules))


def render(root: Path = SUITES) -> str:
    """``docs/suites.md`` as the tree under ``root`` gives it."""
    files = suite_files(root)
    suites = [f for f in files if f.is_suite]
    folders = sorted({f.path.parent for f in files}, key=lambda p: p.relative_to(root).parts)
    lines = [
        "# The suites",
        "",
        "Made from the tree by `python bench/suite_list.py --write`; do not edit by hand",
        "(`tests/docs/test_suite_list.py` fails when this file and the tree differ).",
        f"{len(suites)} suite files, {sum(f.classes for f in suites)} test classes,",
        f"{sum(f.tests for f in suites)} test functions as written: `parametrize` and",
        "`run_subtests` multiply them ([Note: Suite counts as written] in",
        "`bench/suite_list.py`). What the suites share and how they choose world sizes",
        "and tolerances: `docs/guide/suites.md`; collected counts of a run:",
        "`docs/runs/suite-counts.md`.",
        "",
    ]
    for folder in folders:
        lines += _folder_section(folder, [f for f in files if f.path.parent == folder])
    lines += _needs_section(files)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help=f"write {OUTPUT.relative_to(ROOT)}")
    action.add_argument("--check", action="store_true", help="exit 1 when it is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        OUTPUT.write_text(text)
    elif args.check:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        if current != text:
            print(
                f"{OUTPUT.relative_to(ROOT)} is out of date: run python bench/suite_list.py --write"
            )
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
