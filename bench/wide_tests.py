"""A pytest plugin that keeps only the tests needing at least N ranks.

    python -m pytest -p bench.wide_tests --wide-tests 3 suites -n 2

On a machine with more GPUs than the usual CI runner, this runs the tests that
fall back to CPU ranks elsewhere (3- and 4-rank) without paying for the rest.
A test's ranks are what the harness gives it: a ``DistributedTest``'s world
size, or a function's ``world_size`` parameter (the conformance and property
searches). Deselected tests are reported as such by pytest; a session left
with no test fails (pytest's exit code 5), as any other empty session.
"""

from __future__ import annotations

import pytest

from harness.plugin import is_distributed, world_size_of


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--wide-tests",
        type=int,
        default=0,
        metavar="N",
        help="keep only the tests that run on at least N ranks (0: all)",
    )


def ranks_of(item: pytest.Item) -> int:
    """The ranks ``item`` runs on; 0 for a test the harness does not distribute."""
    if is_distributed(item):
        return world_size_of(item)
    callspec = getattr(item, "callspec", None)
    params = {} if callspec is None else callspec.params
    value = params.get("world_size")
    return value if isinstance(value, int) else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    least = int(config.getoption("wide_tests"))
    if least <= 0:
        return
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        (kept if ranks_of(item) >= least else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept
