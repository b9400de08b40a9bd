"""Hooks the harness plugin calls, for other plugins and conftest files to implement."""

from __future__ import annotations

import pytest

from harness._types import Placement


@pytest.hookspec(firstresult=True)
def pytest_harness_skip_reason(item: pytest.Item, placement: Placement) -> str | None:
    """Return a reason to skip ``item`` on ``placement`` before any rank starts,
    or None to let it run. The first non-None answer wins."""


@pytest.hookspec
def pytest_harness_isolated_modules(config: pytest.Config) -> list[str]:
    """Return package or module names whose module and class attributes the ranks
    restore after every test (a plugin adds the code it tests, e.g. ``["fsdp"]``).
    The answers of every implementation are combined."""
