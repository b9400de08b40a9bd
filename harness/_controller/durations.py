"""Test durations: measured in a session, known from earlier ones (see
[Note: Longest tests first] in ``harness._controller.schedule``)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from harness._controller.pytest_reports import WORLD_SIZE

CACHE_KEY = "harness/durations"


def longest_first(collection: Sequence[str], durations: Mapping[str, float]) -> list[int]:
    """Indices of ``collection``: tests of unknown duration in collection order,
    then the known ones, longest first (ties in collection order)."""
    unknown = [i for i, nodeid in enumerate(collection) if nodeid not in durations]
    known = [i for i, nodeid in enumerate(collection) if nodeid in durations]
    known.sort(key=lambda i: -durations[collection[i]])
    return unknown + known


def read_file(path: Path) -> dict[str, float]:
    """A durations file's entries; a missing file has none. A file that is not a
    JSON object of numbers is a usage error naming it."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise pytest.UsageError(f"durations file {path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in data.values()
    ):
        raise pytest.UsageError(f"durations file {path}: not an object of test ids to seconds")
    return {str(k): float(v) for k, v in data.items()}


def write_file(path: Path, durations: Mapping[str, float]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    ordered = {k: round(durations[k], 2) for k in sorted(durations)}
    path.write_text(json.dumps(ordered, indent=0) + "\n")


class DurationLog:
    """This session's test durations, and those known before it (see
    [Note: Longest tests first]). Registered in the controller (or the one
    process without xdist), which sees every report."""

    def __init__(self, config: pytest.Config, path: Path | None, record: bool) -> None:
        self._config = config
        self._path = path
        self._record = record
        self.measured: dict[str, float] = {}
        self.distributed_seen = False  # only such sessions record (see the Note)
        self.known: dict[str, float] = read_file(path) if path is not None else {}
        self.known.update(self._cached())
        self.scheduled: tuple[int, int] | None = None  # tests of known duration, tests

    def _cached(self) -> dict[str, float]:
        """The durations in pytest's cache (none without the cache plugin)."""
        cache = getattr(self._config, "cache", None)
        data = cache.get(CACHE_KEY, {}) if cache is not None else {}
        if not isinstance(data, dict):
            return {}
        return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))}

    def note_scheduled(self, collection: Sequence[str]) -> None:
        self.scheduled = (sum(nodeid in self.known for nodeid in collection), len(collection))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.measured[report.nodeid] = self.measured.get(report.nodeid, 0.0) + report.duration
        if not self.distributed_seen:
            self.distributed_seen = any(name == WORLD_SIZE for name, _ in report.user_properties)

    def pytest_sessionfinish(self) -> None:
        if not self.measured:
            return
        cache = getattr(self._config, "cache", None)
        if cache is not None and self.distributed_seen:
            measured = {k: round(v, 2) for k, v in self.measured.items()}
            cache.set(CACHE_KEY, {**self._cached(), **measured})
        if self._record and self._path is not None:
            write_file(self._path, {**read_file(self._path), **self.measured})

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.scheduled is not None:
            known, total = self.scheduled
            terminalreporter.write_line(
                f"scheduled longest first: the durations of {known} of {total} tests known"
            )
