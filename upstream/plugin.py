"""The ``upstream`` package's pytest plugin: the ranks restore its modules after every test.

Registered as a ``pytest11`` entry point, so an installed checkout loads it in
every session; ``-p upstream.plugin`` loads it explicitly.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(optionalhook=True)  # the runner's hook: absent under -p no:harness.plugin
def pytest_harness_isolated_modules(config: pytest.Config) -> list[str]:
    return ["upstream"]
