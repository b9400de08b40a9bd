"""--launcher torchrun: two torchrun agents on this machine ("two nodes", one rank
each, CPU and gloo) run planted cases and a few tests of a suite, reported as the
harness's own pools report them (placement, subtests as reports, no green for a
subtest filter that selects nothing)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

CASES = "tests/harness/torchrun_cases.py"
SUITE = ("suites/test_core.py::TestAutograd", "suites/test_core.py::TestParamInit")


def _free_port() -> int:
    # torchrun's c10d rendezvous binds the port itself; the window between this
    # probe and its bind is the agents' start.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _two_agents(tmp_path: Path, *args: str) -> list[tuple[int, str]]:
    port = _free_port()
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"localhost:{port}",
        "--rdzv-id",
        f"harness-{port}",
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "--launcher",
        "torchrun",
        "--device",
        "cpu",
        *args,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    logs = [tmp_path / f"agent{i}.log" for i in range(2)]
    agents = [
        subprocess.Popen(command, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
        for log in logs
    ]
    codes = [agent.wait(timeout=240) for agent in agents]
    return [(code, log.read_text()) for code, log in zip(codes, logs)]


def _section(text: str, test: str) -> str:
    start = text.index(f" {test} _")  # the test's own section, or with [config] a subtest's
    end = text.find("\n___", start + 1)
    return text[start : end if end != -1 else len(text)]


@pytest.mark.timeout(300)
def test_two_torchrun_agents_report_the_failing_rank(tmp_path: Path):
    """Every agent fails (rank 0's exit status), and each prints the same reports:
    the failing rank named with its traceback, the stack of the rank that another's
    failure left blocked, the failing subtest (a report of its own); the session
    goes on after them (the default group created anew), counts the test whose
    world size torchrun did not start, and the suite's tests pass. Each test says
    where its ranks ran, and the summary counts them."""
    agents = _two_agents(tmp_path, CASES, *SUITE, "-rs", "-v")
    for code, text in agents:
        assert code != 0, text
        assert "rank 0 of 2" in text or "rank 1 of 2" in text, text
        b = _section(text, "TestPlanted.test_b_fails_on_rank_1")
        assert "1 of 2 ranks failed: rank 1 (world_size=2, device=cpu, backend=gloo)" in b, b
        assert "=== rank 1: AssertionError ===" in b and "assert 1 == 0" in b, b
        assert "=== rank 0" not in b, b
        c = _section(text, "TestPlanted.test_c_rank_1_fails_rank_0_blocks")
        assert "1 of 2 ranks failed: rank 1" in c and "rank 1 gives up" in c, c
        assert "=== rank 0: stopped after another rank failed; it was blocked here ===" in c, c
        assert 'torchrun_cases.py", line' in c.split("it was blocked here ===")[1], c
        d = _section(text, "TestPlanted.test_d_subtests")
        assert "1 of 3 subtests failed (3 ran, 1 failed, 0 skipped, 0 deselected)" in d, d
        assert 'subtest 1 [x=2] failed on rank 1; re-run it alone with: --subtest "x=2"' in d
        d2 = _section(text, "TestPlanted.test_d_subtests [x=2]")
        assert "=== subtest 1 [x=2]: failed on rank 1 ===" in d2, d2
        assert "planted in subtest x=2 on rank 1" in d2, d2
        assert "test_d_subtests SUBFAILED[x=2]" in text and "SUBPASSED[x=3]" in text, text
        assert "test_a_all_reduce PASSED (2 ranks, cpu/gloo)" in text, text
        assert "test_b_fails_on_rank_1 FAILED (2 ranks, cpu/gloo)" in text, text
        assert re.search(r"^2-rank tests: 8 on cpu/gloo$", text, re.M), text
        assert "the default group was created anew 1 times" in text, text
        assert (
            "1 distributed tests skipped, their world size is not WORLD_SIZE=2 "
            "(1 needing 3 ranks)" in text
        ), text
    rank0 = next(text for _, text in agents if "rank 0 of 2" in text)
    rank1 = next(text for _, text in agents if "rank 1 of 2" in text)
    # rank 0 also ran the test that is not distributed; rank 1 deselected it
    assert "3 failed, 6 passed, 1 skipped" in rank0, rank0
    assert "3 failed, 5 passed, 1 skipped, 1 deselected" in rank1, rank1


@pytest.mark.timeout(300)
def test_a_subtest_filter_that_selects_nothing_fails_under_torchrun(tmp_path: Path):
    """The no-vacuous-pass check of a pooled run holds for torchrun's ranks: a
    --subtest value that no combination has fails the test that has subtests
    (listing those it has), and a test without subtests runs as usual."""
    tests = [f"{CASES}::TestPlanted::{name}" for name in ("test_a_all_reduce", "test_d_subtests")]
    for code, text in _two_agents(tmp_path, *tests, "-v", "--subtest", "x=7"):
        assert code != 0, text
        d = _section(text, "TestPlanted.test_d_subtests")
        assert d.splitlines()[1] == (
            '--subtest "x=7" selected none of the 3 subtests of this test: no subtest has x=7'
        ), d
        assert d.splitlines()[2] == "its subtests' keys and values: x=1, 2, 3", d
        assert "test_a_all_reduce PASSED (2 ranks, cpu/gloo)" in text, text
        assert "1 failed, 1 passed" in text, text


@pytest.mark.parametrize(
    "args, error",
    [
        ((), "--launcher torchrun needs the environment torchrun gives its workers; RANK,"),
        (("-n", "2"), "--launcher torchrun runs one pytest session per rank: leave out -n"),
    ],
)
def test_launcher_torchrun_outside_torchrun_is_a_usage_error(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...], error: str
):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--launcher", "torchrun", *args
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {error}*"])
