from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness._controller.options import gpu_slots
from harness.plugin import device_plan, lease_directory

ROOT = Path(__file__).resolve().parents[1]
# The device the inner sessions of the harness's black-box tests use: the CPU by
# default; `HARNESS_TEST_INNER_DEVICE=auto` on a GPU machine runs them on NCCL.
INNER_DEVICE = os.environ.get("HARNESS_TEST_INNER_DEVICE", "cpu")


def inner_gpus() -> int:
    """How many GPUs the inner sessions' ranks may lease: a test of more ranks runs
    on CPU ranks (the named fallback of ``--device auto``)."""
    if INNER_DEVICE == "cpu":
        return 0
    from harness._controller.devices import visible_gpus

    return len(visible_gpus())


class Run:
    """The outcome of an inner pytest session, split into one report per test."""

    def __init__(self, result: pytest.RunResult, pids_file: Path) -> None:
        self.result = result
        self.path = pids_file.parent
        self.text = result.stdout.str()
        self._pids_file = pids_file

    def section(self, test: str) -> str:
        """The failure report of one test (the text under its ``____ name ____`` header)."""
        return self._section(rf"^_+ \S*{re.escape(test)}(\[\S*\])? _+$", test)

    def subtest_section(self, test: str, config: str) -> str:
        """The failure report of one subtest (``____ name [config] ____``)."""
        header = rf"^_+ \S*{re.escape(test)}(\[\S*\])? \[{re.escape(config)}\] _+$"
        return self._section(header, f"{test} [{config}]")

    def _section(self, header: str, what: str) -> str:
        match = re.compile(header, re.M).search(self.text)
        assert match, f"no report section for {what} in:\n{self.text}"
        rest = self.text[match.end() :]
        end = re.search(r"^(_+ .+ _+|={8,} .* ={8,}|rank pools: .*)$", rest, re.M)
        return (rest[: end.start()] if end else rest).strip("\n")

    def report(self, test: str) -> str:
        """``section(test)`` normalised for a golden text (see ``normalise``)."""
        return normalise(self.section(test), self.path)

    def subtest_report(self, test: str, config: str) -> str:
        return normalise(self.subtest_section(test, config), self.path)

    def pids(self) -> dict[str, list[int]]:
        """PIDs the inner tests recorded, by test name."""
        seen: dict[str, list[int]] = {}
        if not self._pids_file.exists():
            return seen
        for line in self._pids_file.read_text().splitlines():
            name, pid = line.split()
            seen.setdefault(name, []).append(int(pid))
        return seen


@pytest.fixture
def inner(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[object]:
    """Runs an inner pytest session in a subprocess with the harness plugin. On a
    GPU machine (``HARNESS_TEST_INNER_DEVICE=auto``) it leases GPUs with the outer
    session, from its lease directory."""
    pids_file = pytester.path / "pids.txt"
    lease_args: tuple[str, ...] = ()
    if INNER_DEVICE != "cpu":
        # The inner session leases the outer session's GPUs from its lease directory.
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(device_plan(request.config).gpus))
        lease_args = (
            "--gpu-lease-dir",
            str(lease_directory(request.config).path),
            "--gpu-slots",
            str(gpu_slots(request.config)),
        )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("PIDS_FILE", str(pids_file))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)

    def run(source: str, *args: str, cpu: bool = False) -> Run:
        """``cpu``: the inner session's ranks run on CPU + gloo with the GPUs hidden,
        for tests of what does not depend on the device (see [Note: Searches
        shrink on CPU ranks])."""
        pytester.makepyfile(test_inner=source)
        if cpu:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        device = ("--device", "cpu") if cpu else ("--device", INNER_DEVICE, *lease_args)
        result = pytester.runpytest_subprocess(
            "-p", "harness.plugin", "-p", "no:cacheprovider", *device, *args
        )
        return Run(result, pids_file)

    yield run


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


_FRAME = re.compile(r'^(?P<indent>\s*)File "(?P<path>[^"]+)", line \d+,? in \S+$')
_CARETS = re.compile(r"^\s*[\^~]+\s*$")


def normalise(report: str, tmp: Path) -> str:
    """A report with what changes between runs and machines replaced: thread and object
    addresses (``0xADDR``), pids, durations with decimals, local ports, the inner
    session's directory (``<tmp>``), the device and
    backend, and each run of frames outside the test file (torch's, the harness's, the
    standard library's: their lines and number differ between versions) collapsed
    into one ``(frames elsewhere)`` line. Caret lines of tracebacks are dropped."""
    text = report.replace(str(tmp), "<tmp>")
    text = re.sub(r"0x[0-9a-fA-F]{6,}", "0xADDR", text)
    text = re.sub(r"\bpid[ =]\d+", "pid PID", text)
    text = re.sub(r"\b\d+\.\d+ s\b", "SECONDS s", text)
    text = re.sub(r"(127\.0\.0\.1|localhost)(\]?):\d+", r"\1\2:PORT", text)
    text = re.sub(r"device=\w+, backend=\w+", "device=<device>, backend=<backend>", text)
    out: list[str] = []
    hidden = False  # in a run of frames outside the test file
    hidden_indent = ""
    for line in text.splitlines():
        frame = _FRAME.match(line)
        if frame and not frame["path"].startswith("<tmp>"):
            hidden, hidden_indent = True, frame["indent"]
            continue
        if hidden and line.startswith(hidden_indent + "  "):
            continue  # the source line of a hidden frame
        if hidden:
            out.append(f"{hidden_indent}(frames elsewhere)")
            hidden = False
        if not _CARETS.match(line):
            out.append(line)
    if hidden:
        out.append(f"{hidden_indent}(frames elsewhere)")
    return "\n".join(out) + "\n"
