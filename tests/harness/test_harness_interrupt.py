"""A session interrupted while a test hangs (Ctrl-C, a CI job's limit, ``timeout
-s INT``) says where each of the test's ranks was, and leaves no rank behind
(see [Note: An interrupted test says where its ranks were] in
``harness._controller.pool``), with and without xdist."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, alive

HANGING = textwrap.dedent(
    """
    import os, time
    from harness import DistributedTest

    def stuck_here():
        time.sleep(600)

    class TestHang(DistributedTest):
        def test_hang(self):
            with open(os.environ["STARTED_FILE"], "a") as f:
                f.write(f"{self.rank} {os.getpid()}\\n")
            stuck_here()
    """
)


def started(path: Path) -> list[int]:
    """The pids of the ranks that reached the test body."""
    if not path.exists():
        return []
    return [int(line.split()[1]) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("xdist", [False, True], ids=["one-process", "xdist"])
def test_an_interrupted_session_says_where_every_rank_was(
    pytester: pytest.Pytester, xdist: bool
) -> None:
    pytester.makepyfile(test_hang=HANGING)
    marker = pytester.path / "started.txt"
    env = {
        **os.environ,
        "STARTED_FILE": str(marker),
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_ADDOPTS"):
        env.pop(name, None)
    # A shell without job control starts background commands with SIGINT ignored,
    # and Python then never raises KeyboardInterrupt: the session gets SIGINT's
    # default disposition, as under a terminal, whatever started this one.
    default_sigint = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    )
    args = [sys.executable, "-c", default_sigint, "-m", "pytest"]
    args += ["-p", "harness.plugin", "-p", "no:cacheprovider"]
    args += ["--device", "cpu", "--dist-timeout", "300", "test_hang.py"]
    args += ["-n", "2"] if xdist else []
    session = subprocess.Popen(
        args, cwd=pytester.path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while len(started(marker)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(started(marker)) == 2, "the ranks never reached the test body"
        os.killpg(session.pid, signal.SIGINT)  # as a terminal's Ctrl-C does
        out, err = session.communicate(timeout=90)
    finally:
        if session.poll() is None:
            os.killpg(session.pid, signal.SIGKILL)
            session.communicate()
    assert session.returncode == pytest.ExitCode.INTERRUPTED, out + err
    text = err if xdist else out
    assert "interrupted while test_hang.py::TestHang::test_hang ran" in text, out + err
    for rank in (0, 1):
        block = text.split(f"rank {rank} was here:", 1)[1].split("rank ", 1)[0]
        assert "in stuck_here" in block and "in test_hang" in block, text
    if not xdist:
        assert "where the interrupted test's ranks were" in out
    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in started(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in started(marker)), "a rank outlived the session"
