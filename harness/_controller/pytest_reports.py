"""What pytest shows of distributed tests: each subtest as a report of its own,
where every test's ranks ran, and the session's summary lines.

[Note: Subtests as pytest reports]
After a test's ranks are done, each of its subtests becomes a report of its own
(``RankSubtestReport``: pytest's ``SubtestReport`` from pytest 9 on, a
``TestReport`` before) with the test's node id, sent through
``pytest_runtest_logreport`` before the test's own call report. Sharing the node
id keeps ``--lf``, ``--sw``, xdist and the progress counter about tests, as
pytest's own subtests do; the subtest's configuration is in the word:

- ``-v`` prints ``test_x.py::TestX::test_y SUBPASSED[a=1, b=2]``; a failed subtest
  is ``SUBFAILED[...]`` with its own section under FAILURES (its ranks'
  tracebacks, the stacks of ranks stopped in it, the line that re-runs it); a
  skipped one is ``SKIPPED (subtest [a=1, b=2]: reason)`` (pytest folds the skip
  lines of ``-rs`` under the first skip's word, so a subtest skip uses pytest's).
- ``-rA`` lists every subtest with its outcome (the category is pytest's
  ``passed``/``failed``/``skipped``, so the short summary shows it).
- The closing counts line stays about tests (``count_towards_summary`` is
  False); the ``subtests`` section of the summary gives the subtest totals.
- junit: pytest writes one ``<testcase>`` per node id, so subtests land in their
  test's: each failed one adds its ``<failure>``, each skipped one its
  ``<skipped>`` (message ``subtest [...]: reason``), and every subtest is listed
  as a ``subtest`` property with its outcome (``passed [a=1, b=2]``).
- Their duration is 0: the test's call report already counts their time (junit
  adds every report's duration to the test case).

Under xdist the reports travel to the controller through
``pytest_report_to_serializable``; the class is rebuilt there, so the counts
line and the short summary treat them the same on both sides.

[Note: What ran where]
Every distributed test's call report carries its placement as user properties
(``dist_world_size``, ``dist_device``, ``dist_backend``; ``dist_gpus``: the GPUs
its ranks ran on, as ``CUDA_VISIBLE_DEVICES`` entries: those its run leased
(see [Note: GPUs under pytest-xdist] in ``harness._controller.devices``), the
fake ids of ``harness_fake_gpus`` on CPU ranks, or under torchrun each rank's
GPU, prefixed by its host when the ranks span hosts; and ``dist_fallback``: why
a test that would have run on GPUs ran on CPU ranks), so junit has them;
``-v`` adds them to the outcome word of a test that passed or failed
(``PASSED (2 ranks, cuda/nccl, GPUs 0,1)``, ``PASSED (3 ranks, cpu/gloo, cpu
fallback: needs 3 GPUs, 2 visible)``; a skip keeps pytest's word, see above).
The session summary counts tests per world size and placement, a CPU fallback
named with its reason where the device split is ("2-rank tests: 480 on
cuda/nccl", "3-rank tests: 12 on cpu/gloo (cpu fallback: needs 3 GPUs, 2
visible)"), from the reports, so that under xdist the controller counts every
worker's tests. Below them each pytest process says what it started: its pools,
or, under torchrun, the rank it is.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import pytest

from harness._controller.report import InterruptedTest, SubtestOutcome
from harness._protocol import Status, SubtestCounts
from harness._types import Placement

_NativeSubtestReport: Any = getattr(pytest, "SubtestReport", None)
if _NativeSubtestReport is not None:
    from _pytest.subtests import SubtestContext  # the type of the native report's `context`
_BASE: Any = _NativeSubtestReport or pytest.TestReport

WORLD_SIZE, DEVICE, BACKEND = "dist_world_size", "dist_device", "dist_backend"
GPUS, FALLBACK = "dist_gpus", "dist_fallback"
_PLACEMENT = (WORLD_SIZE, DEVICE, BACKEND, GPUS, FALLBACK)
SUBTEST, DESELECTED = "subtest", "subtests_deselected"


class RankSubtestReport(_BASE):  # type: ignore[misc]
    """One subtest of a distributed test (see [Note: Subtests as pytest reports])."""

    subtest_index: int
    subtest_config: str

    @classmethod
    def build(
        cls, item: pytest.Item, outcome: SubtestOutcome, keywords: dict[str, int]
    ) -> RankSubtestReport:
        longrepr: Any = None
        if outcome.status is Status.FAILED:
            longrepr = outcome.text
        elif outcome.status is Status.SKIPPED:
            path, lineno, _ = item.reportinfo()
            line = (lineno or 0) + 1
            longrepr = (str(path), line, f"Skipped: subtest [{outcome.config}]: {outcome.text}")
        plain = pytest.TestReport(
            item.nodeid,
            item.location,
            keywords,
            outcome.status.value,  # type: ignore[arg-type]
            longrepr,
            "call",
            duration=0.0,
            start=outcome.started,
            stop=outcome.started + outcome.duration_s,
        )
        return cls._adopt(plain, outcome.index, outcome.config)

    @classmethod
    def _adopt(cls, plain: pytest.TestReport, index: int, config: str) -> RankSubtestReport:
        report = cls.__new__(cls)
        report.__dict__.update(plain.__dict__)
        report.subtest_index = index
        report.subtest_config = config
        if _NativeSubtestReport is not None:
            report.context = SubtestContext(msg=config, kwargs={})
        return report

    @property
    def head_line(self) -> str:
        domain = self.location[2] if self.location else ""
        return f"{domain} [{self.subtest_config}]"

    @property
    def count_towards_summary(self) -> bool:
        return False

    def serialized(self) -> dict[str, Any]:
        data = pytest.TestReport._to_json(self)  # the base's: no native subtest context
        data.pop("context", None)
        data["$report_type"] = "TestReport"
        return data

    @classmethod
    def deserialized(cls, data: dict[str, Any]) -> RankSubtestReport | None:
        if "subtest_config" not in data or data.get("$report_type") != "TestReport":
            return None
        plain = pytest.TestReport._from_json(data)
        return cls._adopt(plain, int(data["subtest_index"]), str(data["subtest_config"]))

    def status(self) -> tuple[str, str, str]:
        if self.passed:
            return "passed", "", f"SUBPASSED[{self.subtest_config}]"
        if self.failed:
            return "failed", "u", f"SUBFAILED[{self.subtest_config}]"
        return "skipped", "-", "SKIPPED"


def placement_properties(
    world_size: int, placement: Placement, gpus: Sequence[str]
) -> list[tuple[str, object]]:
    """``gpus``: those the test's ranks ran on (see [Note: What ran where])."""
    properties: list[tuple[str, object]] = [
        (WORLD_SIZE, world_size),
        (DEVICE, placement.device_type),
        (BACKEND, placement.backend),
    ]
    if gpus:
        properties.append((GPUS, ",".join(gpus)))
    if placement.fallback:
        properties.append((FALLBACK, placement.fallback))
    return properties


def report_subtests(item: pytest.Item, outcomes: Sequence[SubtestOutcome], deselected: int) -> None:
    """Lists the subtests in the test's properties and reports each (see the note)."""
    for outcome in outcomes:
        item.user_properties.append((SUBTEST, f"{outcome.status.value} [{outcome.config}]"))
    if deselected:
        item.user_properties.append((DESELECTED, deselected))
    if not outcomes:
        return
    keywords = dict.fromkeys(item.keywords, 1)
    reports = [RankSubtestReport.build(item, outcome, keywords) for outcome in outcomes]
    capture = item.config.pluginmanager.getplugin("capturemanager")
    quiet = capture.global_and_fixture_disabled() if capture else contextlib.nullcontext()
    with quiet:  # the terminal writes around the test's captured output
        for report in reports:
            item.ihook.pytest_runtest_logreport(report=report)


class _Where(NamedTuple):
    """A report's placement, read back from its properties."""

    world_size: int
    device: str
    backend: str
    gpus: str
    fallback: str

    def place(self) -> str:
        return f"{self.device}/{self.backend}"

    def describe(self) -> str:
        """``cuda/nccl, GPUs 0,1``, ``cpu/gloo, fake GPUs g0,g1`` or ``cpu/gloo, cpu
        fallback: needs 3 GPUs, 2 visible``."""
        parts = [self.place()]
        if self.gpus:
            parts.append(("GPUs " if self.device == "cuda" else "fake GPUs ") + self.gpus)
        if self.fallback:
            parts.append(f"cpu fallback: {self.fallback}")
        return ", ".join(parts)


def _placement_of(report: pytest.TestReport) -> _Where | None:
    found: dict[str, Any] = {}
    for entry in report.user_properties:
        if len(entry) == 2 and entry[0] in _PLACEMENT:
            found[entry[0]] = entry[1]
    if WORLD_SIZE not in found:
        return None
    return _Where(
        int(found[WORLD_SIZE]),
        str(found[DEVICE]),
        str(found[BACKEND]),
        str(found.get(GPUS, "")),
        str(found.get(FALLBACK, "")),
    )


# Skips keep pytest's word: -rs folds skip lines under the first skip's word.
_WORDS = {"passed": ("passed", ".", "PASSED"), "failed": ("failed", "F", "FAILED")}


def _placement_word(report: pytest.TestReport) -> tuple[str, str, str] | None:
    placement = _placement_of(report)
    if placement is None or report.outcome not in _WORDS or hasattr(report, "wasxfail"):
        return None
    category, letter, word = _WORDS[report.outcome]
    n = placement.world_size
    ranks = f"{n} rank{'s' if n != 1 else ''}"
    return category, letter, f"{word} ({ranks}, {placement.describe()})"


class SessionReporter:
    """Subtest and placement bookkeeping of a session, from reports (also those
    xdist workers send), and the lines it adds to the terminal summary."""

    _config: pytest.Config
    _process_lines: Callable[[], list[str]]  # what this process started ("rank pools: ...")
    subtests: dict[str, Counter[str]]  # by test: ran, failed, skipped, deselected
    placements: Counter[tuple[int, str, str]]  # (world size, "device/backend", fallback) -> tests

    def __init__(self, config: pytest.Config, process_lines: Callable[[], list[str]]) -> None:
        self._config = config
        self._process_lines = process_lines
        self.subtests: dict[str, Counter[str]] = {}
        self.placements: Counter[tuple[int, str, str]] = Counter()

    @pytest.hookimpl(tryfirst=True)
    def pytest_report_teststatus(self, report: pytest.TestReport) -> tuple[str, str, str] | None:
        if report.when != "call":
            return None
        if isinstance(report, RankSubtestReport):
            return report.status()
        if not report.user_properties:
            return None
        return _placement_word(report)

    @pytest.hookimpl(tryfirst=True)
    def pytest_report_to_serializable(self, report: object) -> dict[str, Any] | None:
        return report.serialized() if isinstance(report, RankSubtestReport) else None

    @pytest.hookimpl(tryfirst=True)
    def pytest_report_from_serializable(self, data: dict[str, Any]) -> RankSubtestReport | None:
        return RankSubtestReport.deserialized(data)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call":
            return
        if isinstance(report, RankSubtestReport):
            counts = self.subtests.setdefault(report.nodeid, Counter())
            counts["ran" if not report.skipped else "skipped"] += 1
            counts["failed"] += report.failed
            return
        placement = _placement_of(report) if report.user_properties else None
        if placement is not None:
            self.placements[(placement.world_size, placement.place(), placement.fallback)] += 1
        for name, value in report.user_properties:
            if name == DESELECTED:
                self.subtests.setdefault(report.nodeid, Counter())["deselected"] += int(value)

    def totals(self) -> SubtestCounts:
        fields = ("ran", "failed", "skipped", "deselected")
        return SubtestCounts(**{f: sum(c[f] for c in self.subtests.values()) for f in fields})

    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        """See [Note: An interrupted test says where its ranks were]."""
        if not isinstance(excinfo.value, InterruptedTest):
            return
        text = excinfo.value.describe()
        terminal = self._config.pluginmanager.get_plugin("terminalreporter")
        if hasattr(self._config, "workerinput") or terminal is None:
            worker = getattr(self._config, "workerinput", {}).get("workerid", "")
            os.write(2, f"\n[{worker}] {text}\n".encode() if worker else f"\n{text}\n".encode())
            return
        terminal.write_sep("!", "where the interrupted test's ranks were")
        terminal.write_line(text)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        tr = terminalreporter
        if self.subtests:
            tr.section("subtests")
            if self._config.getoption("verbose") > 0:
                for nodeid, c in self.subtests.items():
                    tr.write_line(
                        f"{nodeid}: {c['ran']} ran, {c['failed']} failed, {c['skipped']} "
                        f"skipped, {c['deselected']} deselected"
                    )
            t = self.totals()
            tr.write_line(
                f"{len(self.subtests)} tests with subtests: {t.ran} subtests ran, {t.failed} "
                f"failed, {t.skipped} skipped, {t.deselected} deselected"
            )
        lines = [*self.placement_lines(), *self._process_lines()]
        if lines:
            tr.section("distributed tests")
            for line in lines:
                tr.write_line(line)

    def placement_lines(self) -> list[str]:
        """One line per world size, CPU fallbacks with their reason: "2-rank tests:
        480 on cuda/nccl", "3-rank tests: 12 on cpu/gloo (cpu fallback: needs 3
        GPUs, 2 visible)"."""
        lines = []
        for world_size in sorted({key[0] for key in self.placements}):
            where = [
                (n, place, fallback)
                for (ws, place, fallback), n in self.placements.items()
                if ws == world_size
            ]
            parts = ", ".join(
                f"{n} on {place}" + (f" (cpu fallback: {fallback})" if fallback else "")
                for n, place, fallback in sorted(where, reverse=True)
            )
            lines.append(f"{world_size}-rank tests: {parts}")
        return lines
