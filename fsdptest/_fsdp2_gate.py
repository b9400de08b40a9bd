"""The plugin's part that keeps FSDP2 tests from passing, or a session from being
green, against an implementation without FSDP2.

[Note: A session of FSDP2 skips is not green]
A test needs FSDP2 when it is marked ``fsdp2`` or its module imported one of
``fsdptest.api``'s FSDP2 stand-ins (what an implementation without FSDP2 gets:
[Note: Which implementations provide FSDP2] in ``fsdptest.fsdp2``). Where the
implementation lacks FSDP2, such a test is skipped at collection, before any rank
starts, with ``fsdptest.api.FSDP2.missing`` as the reason (it names what the
implementation's module lacks). The facade is read only if a test module imported
it: this module imports neither it nor torch, as the plugin loads in every
session. A skip is not a pass, and a session in which no test passed but some
were skipped this way ends with ``TESTS_FAILED`` and a summary line saying why:
running FSDP2 tests against an implementation without FSDP2 checked nothing.
Under pytest-xdist the controller decides, from every worker's reports.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

FSDP2_MARKER = "fsdp2"
FSDP2_MARKER_HELP = (
    f"{FSDP2_MARKER}: the test needs the FSDP2 API (fully_shard, FSDPModule) of the FSDP "
    "under test; it is skipped, naming what is missing, where the implementation lacks it"
)
FSDP2_SKIP_PREFIX = "needs FSDP2 ("
"""How ``Fsdp2API.missing`` begins: a skip report with this reason is one of ours."""


class Fsdp2Gate:
    """Skips the tests that need FSDP2 where it is missing, and fails a session of
    nothing but such skips (see the module note). Registered as a plugin."""

    is_worker: bool
    passed: int
    skipped_for_fsdp2: int
    reason: str

    def __init__(self, *, is_worker: bool) -> None:
        self.is_worker = is_worker
        self.passed = 0
        self.skipped_for_fsdp2 = 0
        self.reason = ""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        api = sys.modules.get("fsdptest.api")
        if api is None or api.FSDP2.provided:
            return
        stand_ins = {id(value) for value in api.FSDP2.stand_ins.values()}
        for item in items:
            if _needs_fsdp2(item, stand_ins):
                item.add_marker(pytest.mark.skip(reason=api.FSDP2.missing))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" and report.passed:
            self.passed += 1
        elif report.skipped and FSDP2_SKIP_PREFIX in _skip_text(report):
            self.skipped_for_fsdp2 += 1
            self.reason = self.reason or _skip_text(report).removeprefix("Skipped: ")

    def verdict(self) -> str:
        """Why this session is not green, or ""."""
        if self.passed or not self.skipped_for_fsdp2:
            return ""
        return (
            f"no test passed: {self.skipped_for_fsdp2} test(s) that need FSDP2 were skipped "
            f"({self.reason.strip()}); a session that checked nothing is not green"
        )

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if not self.is_worker and exitstatus == pytest.ExitCode.OK and self.verdict():
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.is_worker and self.verdict():
            terminalreporter.write_line(self.verdict(), red=True, bold=True)


def _needs_fsdp2(item: pytest.Item, stand_ins: set[int]) -> bool:
    if item.get_closest_marker(FSDP2_MARKER) is not None:
        return True
    module = getattr(item, "module", None)
    return module is not None and any(id(value) in stand_ins for value in vars(module).values())


def _skip_text(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)
