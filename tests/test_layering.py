"""The import graph points one way: fsdp (the implementation) and harness (the generic
runner) at the bottom, the FSDP test layer above the runner, models above the
layer, the upstream compatibility package above the models, suites on top; the rank
side of the runner never imports its controller side.

Imports are read with ``ast`` (function-level ones included, ``TYPE_CHECKING``
blocks excluded), so a cycle hidden behind a function-level import still fails.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("harness", "fsdp", "fsdptest", "models", "upstream", "suites")

# (importer prefix, forbidden prefix, why)
FORBIDDEN: tuple[tuple[str, str, str], ...] = (
    ("harness", "fsdp", "the runner is generic: it knows no FSDP implementation"),
    ("harness", "fsdptest", "the FSDP test layer registers through the runner's hooks"),
    ("harness", "models", "the runner knows no test model"),
    ("harness", "suites", "the runner knows no suite"),
    ("fsdp", "harness", "our FSDP is a library; the harness tests it from outside"),
    ("fsdp", "fsdptest", "our FSDP is a library"),
    ("fsdp", "models", "our FSDP is a library"),
    ("fsdp", "torch.distributed.fsdp", "torch's FSDP is the oracle, never a building block"),
    ("fsdp", "torch.distributed._composable", "torch's FSDP is the oracle"),
    ("fsdptest", "models", "models build on the test layer, not the other way round"),
    ("fsdptest", "suites", "suites are on top"),
    ("models", "suites", "suites are on top"),
    ("harness", "upstream", "the runner knows nothing of upstream's test utilities"),
    ("fsdp", "upstream", "our FSDP is a library"),
    ("fsdptest", "upstream", "the upstream compatibility package builds on the test layer"),
    ("models", "upstream", "the upstream compatibility package re-exports the models"),
    ("upstream", "suites", "suites are on top"),
    ("upstream", "fsdp", "upstream reaches the FSDP under test through the facade (fsdptest.api)"),
    (
        "upstream",
        "torch.distributed.fsdp",
        "upstream reaches the FSDP under test through the facade",
    ),
    ("harness._rank", "harness._controller", "the rank side never needs the controller side"),
)

_EVERY_SESSION = (
    "the plugin is in every pytest session of the environment; this needs torch or hypothesis"
)

# Function-level imports of project modules, and why each is not at the top.
LATE_IMPORTS: dict[tuple[str, str], str] = {
    ("fsdptest", "fsdptest.testcase"): "pytest imports the package with its plugin, before "
    "--fsdp-impl is known; FSDPTest imports the facade, which resolves the implementation "
    "when first imported",
    # The plugins load in every pytest session of the environment (pytest11 entry
    # points): torch, hypothesis and the pools are imported only where a session
    # uses them (see [Note: A plugin in every session] in harness.plugin).
    ("harness", "harness.testcase"): _EVERY_SESSION,
    ("harness", "harness.rank_calls"): _EVERY_SESSION,
    ("harness.plugin", "harness.testcase"): _EVERY_SESSION,
    ("harness.plugin", "harness.rank_calls"): _EVERY_SESSION,
    ("harness.plugin", "harness._controller.dispatch"): _EVERY_SESSION,
    ("harness.plugin", "harness._torchrun.session"): _EVERY_SESSION,
    ("harness.plugin", "harness._controller.schedule"): "it subclasses xdist's scheduler, and "
    "xdist is optional: imported only when xdist asks for a scheduler",
    ("fsdptest.plugin", "fsdptest.properties.search"): _EVERY_SESSION,
    ("fsdptest.plugin", "fsdptest.conformance.search"): _EVERY_SESSION,
    ("fsdptest.plugin", "fsdptest.conformance.scenario"): _EVERY_SESSION,
    ("fsdptest.plugin", "fsdptest.fsdp2search.search"): _EVERY_SESSION,
    ("fsdptest.plugin", "fsdptest.fsdp2search.program"): _EVERY_SESSION,
    ("upstream.plugin", "harness._rank.cuda_mapping"): _EVERY_SESSION,
    ("upstream.plugin", "harness.plugin"): _EVERY_SESSION,
}


class Import(NamedTuple):
    importer: str
    imported: str
    late: bool  # inside a function


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            hidden.update(id(child) for child in ast.walk(node))
    return hidden


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _imports_of(path: Path) -> Iterator[Import]:
    module = _module_name(path)
    tree = ast.parse(path.read_text())
    hidden = _type_checking_nodes(tree)
    late_nodes = {
        id(child)
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for child in ast.walk(fn)
    }
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        late = id(node) in late_nodes
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, alias.name, late)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node, path.name == "__init__.py")
            for alias in node.names:
                yield Import(module, f"{base}.{alias.name}", late)


def _all_imports() -> list[Import]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found.extend(_imports_of(path))
    return found


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _project_modules() -> set[str]:
    return {_module_name(p) for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def _resolve(name: str, modules: set[str]) -> str | None:
    """The project module ``name`` refers to (``pkg.mod.attr`` -> ``pkg.mod``)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


IMPORTS = _all_imports()
MODULES = _project_modules()


@pytest.mark.parametrize("importer,forbidden,why", FORBIDDEN, ids=lambda v: str(v)[:24])
def test_no_forbidden_direction(importer: str, forbidden: str, why: str) -> None:
    bad = sorted(
        f"{i.importer} imports {i.imported}"
        for i in IMPORTS
        if _within(i.importer, importer) and _within(i.imported, forbidden)
    )
    assert not bad, f"{importer} must not import {forbidden} ({why}):\n" + "\n".join(bad)


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for imp in IMPORTS:
        target = _resolve(imp.imported, MODULES)
        if target is not None and target != imp.importer:
            graph[imp.importer].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_import_cycles() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_cycle_detection_sees_a_cycle() -> None:
    """The check itself: a planted cycle through a late import is found."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_late_project_imports_are_explained() -> None:
    """A function-level import of project code is allowed only with a reason
    (never to break a cycle: the cycle test would see through it anyway)."""
    late = set()
    for imp in IMPORTS:
        target = _resolve(imp.imported, MODULES)
        if imp.late and target is not None and not imp.importer.startswith("suites"):
            late.add((imp.importer, target))
    unexplained = sorted(late - set(LATE_IMPORTS))
    stale = sorted(set(LATE_IMPORTS) - late)
    assert not unexplained, f"function-level imports without a reason: {unexplained}"
    assert not stale, f"LATE_IMPORTS entries that match nothing: {stale}"
