"""A run that checked nothing is never green: zero ranks, a ``--subtest`` filter
that selects nothing, ``--device cuda`` without GPUs, zero property examples, a
body that never runs and bad option values all end as errors or failures; and
every report says where its ranks ran, with each subtest a report of its own."""

from __future__ import annotations

import re
import textwrap
import xml.etree.ElementTree as ET
from typing import Any

import pytest
import torch

from tests.conftest import INNER_DEVICE

HEADER = textwrap.dedent(
    """
    import os
    import pytest, torch
    import torch.distributed as dist
    from harness import DistributedTest

    def record(name):
        with open(os.environ["PIDS_FILE"], "a") as f:
            f.write(f"{name} {os.getpid()}\\n")
    """
)

# Where the inner sessions' ranks run (a GPU machine may run them on NCCL, or on
# the CPU where it has fewer GPUs than the test has ranks, which the report names).
WHERE = (
    r"(cpu/gloo(, cpu fallback: needs \d+ GPUs, \d+ visible)?|cuda/nccl, GPUs [\d,]+)"
    if INNER_DEVICE != "cpu"
    else "cpu/gloo"
)


def src(body: str) -> str:
    return HEADER + textwrap.dedent(body)


def usage_error(run: Any) -> str:
    """The one-line usage error of an inner session that stopped before running."""
    assert run.result.ret == pytest.ExitCode.USAGE_ERROR, run.text
    err = run.result.stderr.str()
    assert "Traceback" not in err and "INTERNALERROR" not in err + run.text, err
    assert run.pids() == {}, "a test body ran"
    lines = [line for line in err.splitlines() if line.startswith("ERROR:")]
    assert len(lines) == 1, err
    return lines[0]


ASSERT_FALSE = src(
    """
    class TestFalse(DistributedTest):
        def test_false(self):
            record("false")
            assert False
    """
)


@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_world_size_below_one_is_a_usage_error(inner: Any, value: str) -> None:
    """``--world-size 0`` passed ``assert False`` (a pool of no ranks ran nothing);
    ``-1`` failed inside the pool's store."""
    run = inner(ASSERT_FALSE, "--world-size", value)
    assert usage_error(run) == f"ERROR: --world-size needs at least 1 rank, got {value}"


ZERO_RANK_CLASSES = src(
    """
    class TestNoRanks(DistributedTest):
        world_size = 0

        def test_false(self):
            record("no ranks")
            assert False

    class TestNoGpusHere(DistributedTest):
        @property
        def world_size(self):  # as upstream files write it; 0 on a machine without GPUs
            return min(0, 2)

        def test_false(self):
            record("no gpus")
            assert False
    """
)


def test_a_class_of_no_ranks_is_an_error_naming_the_class(inner: Any) -> None:
    run = inner(ZERO_RANK_CLASSES, "-rE")
    run.result.assert_outcomes(errors=2)
    assert "TestNoRanks.world_size is 0: a distributed test needs at least 1 rank" in run.text
    assert "TestNoGpusHere.world_size is 0" in run.text
    assert run.pids() == {}


SUBTESTS = src(
    """
    class TestFiltered(DistributedTest):
        def test_combinations(self):
            def body(strategy, prefetch):
                record(f"{strategy}-{prefetch}")
            self.run_subtests({"strategy": ["a", "b"], "prefetch": [True, False]}, body)

        def test_without_subtests(self):
            record("plain")
    """
)


@pytest.mark.parametrize(
    "wanted,why",
    [
        ("strategy=zzz", "no subtest has strategy=zzz"),
        ("stratgy=a", "no subtest has the key 'stratgy'"),
        ("strategy=a, prefetch=maybe", "no subtest has prefetch=maybe"),
    ],
)
def test_a_subtest_filter_that_selects_nothing_fails(inner: Any, wanted: str, why: str) -> None:
    """A value no combination has, or a misspelt key, passed with "0 subtests ran,
    4 deselected"; now the test fails, saying what is wrong and what exists. A
    test without subtests has nothing to select and runs as usual."""
    run = inner(SUBTESTS, "--subtest", wanted)
    run.result.assert_outcomes(failed=1, passed=1)
    report = run.section("test_combinations")
    assert report.splitlines()[0] == (
        f'--subtest "{wanted}" selected none of the 4 subtests of this test: {why}'
    )
    assert (
        report.splitlines()[1]
        == "its subtests' keys and values: strategy='a', 'b'; prefetch=True, False"
    )
    assert set(run.pids()) == {"plain"}


def test_device_cuda_without_a_gpu_is_a_usage_error(
    inner: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It skipped every test and exited 0."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    run = inner(ASSERT_FALSE, "--device", "cuda")
    assert usage_error(run) == (
        "ERROR: --device cuda: no GPU is visible to this process (CUDA_VISIBLE_DEVICES "
        "entries: []); use --device auto or cpu"
    )


TOO_MANY_RANKS = src(
    """
    import torch

    class TestTooMany(DistributedTest):
        world_size = torch.cuda.device_count() + 1

        def test_needs_more(self):
            record("too many")
    """
)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (a CUDA run of these tests)")
def test_device_cuda_and_a_test_needing_more_gpus_errors_instead_of_skipping(inner: Any) -> None:
    run = inner(TOO_MANY_RANKS, "--device", "cuda")
    run.result.assert_outcomes(errors=1)
    assert re.search(
        r"needs \d+ GPUs but only \d+ GPUs are visible \[.*\] \(--device cuda; --device auto "
        r"would run it on CPU ranks\)",
        run.text,
    ), run.text
    assert run.pids() == {}


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--dist-timeout", "-5"],
            "--dist-timeout must be a finite number of seconds, more than 0; got -5",
        ),
        (
            ["--dist-timeout", "inf"],
            "--dist-timeout must be a finite number of seconds, more than 0; got inf",
        ),
        (
            ["--fail-grace", "-1"],
            "--fail-grace must be a finite number of seconds, at least 0; got -1",
        ),
        (["--property-examples", "0"], "--property-examples needs at least 1 example, got 0"),
        (["--subtest", "strategy"], "--subtest expects key=value pairs separated by commas"),
        (
            ["--replay-example", "garbage"],
            "--replay-example 'garbage' is not a replay id that a property or conformance failure "
            "printed",
        ),
        (
            ["--gpu-lease-dir", "/dev/null/leases"],
            "--gpu-lease-dir /dev/null/leases: cannot create the directory (Not a directory)",
        ),
        (["--gpu-lease-dir", ""], "--gpu-lease-dir needs a directory, got an empty path"),
        (
            ["--rank-profile", "/dev/null/profiles"],
            "--rank-profile /dev/null/profiles: cannot create the directory (Not a directory)",
        ),
        (["-o", "harness_fake_gpus=g0,g1,g0"], "harness_fake_gpus names a GPU twice: 'g0,g1,g0'"),
    ],
    ids=lambda v: (v[1] if v[0] == "-o" else v[0]) if isinstance(v, list) else "",
)
def test_a_bad_option_value_is_a_one_line_usage_error(
    inner: Any, args: list[str], message: str
) -> None:
    """Negative deadlines and grace periods were accepted; a garbled replay id
    ended in a binascii traceback."""
    assert usage_error(inner(ASSERT_FALSE, *args)).startswith(f"ERROR: {message}")


NO_EXAMPLES = textwrap.dedent(
    """
    from hypothesis import given, strategies as st
    from harness import DistributedTest

    class Ranks(DistributedTest):
        def check(self, example):
            raise AssertionError("every example fails")

    @given(x=st.integers())
    def test_checks_no_example(property_search, x):
        if x == x:  # every drawn example is set aside before the ranks see it
            return
        property_search.check(Ranks, x)
    """
)


def test_a_property_test_that_checked_no_example_fails(inner: Any) -> None:
    """A property test whose body set every drawn example aside passed, although
    every example would fail (hypothesis itself skips a test it draws nothing for
    and fails one whose draws are all filtered out)."""
    run = inner(NO_EXAMPLES)
    run.result.assert_outcomes(failed=1)
    assert "no example was checked" in run.section("test_checks_no_example")


NEVER_RUN = src(
    """
    class TestNeverRun(DistributedTest):
        async def test_async(self):
            record("async")
            assert False

        def test_empty_configuration(self):
            def body(strategy):
                assert False
            self.run_subtests({"strategy": [], "prefetch": [True]}, body)
            record("after no subtests")

    def test_zero_ranks_by_call(rank_calls):
        with pytest.raises(ValueError, match="world_size must be a whole number of ranks, at least 1: 0"):
            rank_calls.run(TestNeverRun, "test_empty_configuration", 0)
    """
)


def test_a_body_that_never_ran_is_not_a_pass(inner: Any) -> None:
    """An async test method, a run_subtests configuration without combinations and
    a rank call on zero ranks all passed without running anything."""
    run = inner(NEVER_RUN)
    run.result.assert_outcomes(failed=2, passed=1)
    assert "TypeError: test_async returned a coroutine (async def), so its body never ran" in (
        run.section("test_async")
    )
    assert (
        "ValueError: run_subtests: 'strategy' has no values, so the configuration has no "
        "combination and the call would check nothing"
    ) in run.section("test_empty_configuration")
    assert run.pids() == {}


SKIPS_ON_SOME_RANKS = src(
    """
    class TestSomeRanksSkip(DistributedTest):
        def test_rank0_skips_every_subtest(self):
            def body(n):
                if self.rank == 0:
                    pytest.skip("not on rank 0")
            self.run_subtests({"n": [0, 1]}, body)

        def test_every_rank_skips_every_subtest(self):
            def body(n):
                pytest.skip("not here")
            self.run_subtests({"n": [0, 1]}, body)
    """
)


def test_subtests_skipped_on_some_ranks_fail_and_skipped_everywhere_skip(inner: Any) -> None:
    run = inner(SKIPS_ON_SOME_RANKS, "-rs")
    run.result.assert_outcomes(failed=1, skipped=1)
    assert "2 of 2 subtests failed" in run.section("test_rank0_skips_every_subtest")
    for n in (0, 1):
        section = run.subtest_section("test_rank0_skips_every_subtest", f"n={n}")
        assert "inconsistent skip: skipped on rank 0 (not on rank 0) but run on rank 1" in section
    assert "every subtest skipped; subtest 0: not here" in run.text


PLACES = src(
    """
    class TestTwo(DistributedTest):
        @pytest.mark.parametrize("i", range(3))
        def test_two(self, i):
            dist.barrier()

        def test_fails(self):
            assert self.rank == 0

    class TestOne(DistributedTest):
        world_size = 1

        def test_one(self):
            pass
    """
)


def test_every_report_says_where_its_ranks_ran(inner: Any) -> None:
    """In -v, in junit properties and in a summary line per world size."""
    junit = "junit.xml"
    run = inner(PLACES, "-v", f"--junitxml={junit}")
    run.result.assert_outcomes(passed=4, failed=1)
    assert re.search(rf"test_two\[0\] PASSED \(2 ranks, {WHERE}\)", run.text), run.text
    assert re.search(rf"test_fails FAILED \(2 ranks, {WHERE}\)", run.text)
    assert re.search(rf"test_one PASSED \(1 rank, {WHERE}\)", run.text)
    assert re.search(r"^1-rank tests: 1 on \w+/\w+", run.text, re.M)
    assert re.search(r"^2-rank tests: 4 on \w+/\w+", run.text, re.M)
    cases = {c.get("name"): c for c in ET.parse(run.path / junit).getroot().iter("testcase")}
    props = {p.get("name"): p.get("value") for p in cases["test_two[1]"].iter("property")}
    assert props["dist_world_size"] == "2"
    if props["dist_device"] == "cuda":
        assert props["dist_backend"] == "nccl" and props["dist_gpus"]
    else:
        assert (props["dist_device"], props["dist_backend"]) == ("cpu", "gloo")


def test_under_xdist_the_controller_counts_every_workers_tests(inner: Any) -> None:
    run = inner(PLACES, "-n", "2", "-v")
    run.result.assert_outcomes(passed=4, failed=1)
    assert re.search(r"^2-rank tests: 4 on \w+/\w+", run.text, re.M), run.text
    assert re.search(r"^1-rank tests: 1 on \w+/\w+", run.text, re.M)
    assert re.search(
        rf"PASSED \(2 ranks, {WHERE}\) test_inner.py::TestTwo::test_two\[2\]", run.text
    )


REPORTED_SUBTESTS = src(
    """
    class TestReported(DistributedTest):
        def test_matrix(self):
            def body(x, flag):
                if x == 2:
                    pytest.skip(f"x={x} does not apply")
                assert not (x == 1 and flag), f"x={x} flag={flag} is wrong on rank {self.rank}"
            self.run_subtests({"x": [0, 1, 2], "flag": [False, True]}, body)
    """
)


def _check_subtest_reports(run: Any) -> None:
    text = run.text
    for config in ("x=0, flag=False", "x=0, flag=True", "x=1, flag=False"):
        assert re.search(rf"SUBPASSED\[{config}\]", text), config
    assert "SUBFAILED[x=1, flag=True]" in text
    assert "SKIPPED (subtest [x=2, flag=False]: x=2 does not apply)" in text or (
        "subtest [x=2, flag=False]: x=2 does not apply" in text
    )
    assert "1 tests with subtests: 4 subtests ran, 1 failed, 2 skipped, 0 deselected" in text
    run.result.assert_outcomes(failed=1)  # the counts line counts tests, not subtests


def test_each_subtest_is_a_pytest_report(inner: Any) -> None:
    """-v and -rA list every subtest with its outcome; a failed subtest has a
    FAILURES section of its own; junit lists each with its outcome."""
    run = inner(REPORTED_SUBTESTS, "-v", "-rA", "--junitxml=junit.xml")
    _check_subtest_reports(run)
    assert re.search(r"test_matrix SUBPASSED\[x=0, flag=False\]", run.text), (
        "the -v line names the test and the subtest"
    )
    short = run.text.split("short test summary info")[1]
    assert "SUBPASSED[x=0, flag=True] test_inner.py::TestReported::test_matrix" in short
    assert "SUBFAILED[x=1, flag=True] test_inner.py::TestReported::test_matrix" in short
    assert "subtest [x=2, flag=True]: x=2 does not apply" in short
    section = run.subtest_section("test_matrix", "x=1, flag=True")
    assert "x=1 flag=True is wrong on rank 0" in section and "is wrong on rank 1" in section
    case = next(ET.parse(run.path / "junit.xml").getroot().iter("testcase"))
    listed = [p.get("value") for p in case.iter("property") if p.get("name") == "subtest"]
    assert listed == [
        "passed [x=0, flag=False]",
        "passed [x=0, flag=True]",
        "passed [x=1, flag=False]",
        "failed [x=1, flag=True]",
        "skipped [x=2, flag=False]",
        "skipped [x=2, flag=True]",
    ]
    failures = [f.get("message", "") for f in case.iter("failure")]
    assert any("subtest 3 [x=1, flag=True]: failed on rank 0, rank 1" in m for m in failures)


def test_subtest_reports_travel_from_xdist_workers(inner: Any) -> None:
    run = inner(REPORTED_SUBTESTS, "-n", "2", "-v", "-rA")
    _check_subtest_reports(run)
    assert "SUBFAILED[x=1, flag=True] test_inner.py::TestReported::test_matrix" in run.text
