"""Hooks the harness plugin calls, for other plugins and conftest files to implement."""

from __future__ import annotations

import pytest

from harness._pool import Placement


@pytest.hookspec(firstresult=True)
def pytest_harness_skip_reason(item: pytest.Item, placement: Placement) -> str | None:
    """Return a reason to skip ``item`` on ``placement`` before any rank starts,
    or None to let it run. The first non-None answer wins."""
