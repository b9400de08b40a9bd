"""Under ``pytest -n`` the longest tests start first, by durations known from a
durations file or from pytest's cache (see [Note: Longest tests first] in
``harness._controller.schedule``); xdist's own order is kept where asked for,
where another ``--dist`` mode is chosen and where nothing is known."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from harness._controller.durations import longest_first

pytest.importorskip("xdist")

SOURCE = textwrap.dedent(
    """
    import os, time

    def started(name, seconds=0.0):
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(os.environ["ORDER_LOG"], "a") as f:
            f.write(f"{worker} {name}\\n")
        time.sleep(seconds)

    def test_a(): started("a")
    def test_b(): started("b")
    def test_c(): started("c")
    def test_d(): started("d")
    def test_e(): started("e", 0.4)
    def test_f(): started("f", 0.2)
    """
)
KNOWN = {"e": 9.0, "f": 8.0, "c": 3.0, "b": 2.0, "a": 1.0}  # d: unknown
LONGEST_FIRST = ["d", "e", "f", "c", "b", "a"]


def nodeid(name: str) -> str:
    return f"test_sched.py::test_{name}"


@pytest.fixture
def session(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    pytester.makepyfile(test_sched=SOURCE)
    log = pytester.path / "order.log"
    monkeypatch.setenv("ORDER_LOG", str(log))

    def run(*args: str) -> tuple[pytest.RunResult, dict[str, list[str]]]:
        log.unlink(missing_ok=True)
        result = pytester.runpytest_subprocess("-p", "harness.plugin", "-n", "2", *args)
        started: dict[str, list[str]] = {}
        for line in log.read_text().splitlines() if log.exists() else ():
            worker, name = line.split()
            started.setdefault(worker, []).append(name)
        return result, started

    return run


def in_order(started: dict[str, list[str]], order: list[str]) -> bool:
    """Whether every worker started its tests in ``order`` (each took them from
    the head of one pending list)."""
    return all(names == [n for n in order if n in names] for names in started.values())


def write_durations(path: Path, names: dict[str, float]) -> None:
    path.write_text(json.dumps({nodeid(n): s for n, s in names.items()}))


def test_longest_first_puts_unknown_tests_first_then_the_longest() -> None:
    collection = [nodeid(n) for n in "abcdef"]
    order = longest_first(collection, {nodeid(n): s for n, s in KNOWN.items()})
    assert [collection[i] for i in order] == [nodeid(n) for n in LONGEST_FIRST]
    assert longest_first(collection, {}) == list(range(6))
    ties = {nodeid("a"): 1.0, nodeid("b"): 1.0, nodeid("c"): 2.0}
    assert longest_first(collection[:3], ties) == [2, 0, 1]


def test_a_durations_file_starts_the_longest_tests_first(
    pytester: pytest.Pytester, session
) -> None:
    write_durations(pytester.path / "durations.json", KNOWN)
    pytester.makeini("[pytest]\nharness_durations = durations.json\n")
    result, started = session("-p", "no:cacheprovider")
    result.assert_outcomes(passed=6)
    result.stdout.fnmatch_lines(["scheduled longest first: the durations of 5 of 6 tests known"])
    assert sorted(started) == ["gw0", "gw1"], started
    assert {names[0] for names in started.values()} == {"d", "e"}, started
    assert in_order(started, LONGEST_FIRST), started


def test_xdist_order_where_asked_where_another_mode_or_nothing_known(
    pytester: pytest.Pytester, session
) -> None:
    write_durations(pytester.path / "durations.json", KNOWN)
    pytester.makeini("[pytest]\nharness_durations = durations.json\n")
    for args in (("--dist-schedule", "xdist"), ("--dist", "loadfile")):
        result, started = session("-p", "no:cacheprovider", *args)
        result.assert_outcomes(passed=6)
        assert "scheduled longest first" not in result.stdout.str()
        assert in_order(started, list("abcdef")), (args, started)
    (pytester.path / "durations.json").unlink()
    result, started = session("-p", "no:cacheprovider")
    result.assert_outcomes(passed=6)
    assert "scheduled longest first" not in result.stdout.str()
    assert in_order(started, list("abcdef")), started


ONE_DISTRIBUTED = textwrap.dedent(
    """
    from harness import DistributedTest

    class TestRanks(DistributedTest):
        world_size = 1

        def test_rank(self):
            assert self.rank == 0
    """
)


def test_the_cache_remembers_durations_for_the_next_session(
    pytester: pytest.Pytester, session
) -> None:
    pytester.makepyfile(test_zdist=ONE_DISTRIBUTED)
    result, started = session("--device", "cpu")
    result.assert_outcomes(passed=7)
    assert "scheduled longest first" not in result.stdout.str()
    cached = json.loads((pytester.path / ".pytest_cache/v/harness/durations").read_text())
    assert set(cached) == {nodeid(n) for n in "abcdef"} | {"test_zdist.py::TestRanks::test_rank"}
    assert cached[nodeid("e")] > cached[nodeid("f")] > max(cached[nodeid(n)] for n in "abcd")
    (pytester.path / "test_zdist.py").unlink()
    result, started = session()
    result.stdout.fnmatch_lines(["scheduled longest first: the durations of 6 of 6 tests known"])
    assert {names[0] for names in started.values()} == {"e", "f"}, started


def test_a_session_without_distributed_tests_leaves_the_cache_alone(
    pytester: pytest.Pytester, session
) -> None:
    """A foreign project's sessions load the plugin too: their order stays xdist's."""
    for _ in range(2):
        result, started = session()
        result.assert_outcomes(passed=6)
        assert "scheduled longest first" not in result.stdout.str()
    assert not (pytester.path / ".pytest_cache/v/harness/durations").exists()


def test_record_durations_merges_the_session_into_the_file(
    pytester: pytest.Pytester, session
) -> None:
    path = pytester.path / "d.json"
    path.write_text(json.dumps({"gone.py::test_kept": 7.0}))
    result, _ = session(
        "-p", "no:cacheprovider", "--dist-durations", "d.json", "--dist-record-durations"
    )
    result.assert_outcomes(passed=6)
    written = json.loads(path.read_text())
    assert set(written) == {"gone.py::test_kept", *(nodeid(n) for n in "abcdef")}
    assert written["gone.py::test_kept"] == 7.0 and written[nodeid("e")] >= 0.4


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        (None, ("--dist-record-durations",), "--dist-record-durations needs a file"),
        ("[1, 2]", ("--dist-durations", "d.json"), "not an object of test ids to seconds"),
        ('{"t": "slow"}', ("--dist-durations", "d.json"), "not an object of test ids to seconds"),
        ("{", ("--dist-durations", "d.json"), "not readable JSON"),
    ],
)
def test_a_bad_durations_option_is_a_usage_error(
    pytester: pytest.Pytester, session, content: str | None, args: tuple[str, ...], message: str
) -> None:
    if content is not None:
        (pytester.path / "d.json").write_text(content)
    result, started = session("-p", "no:cacheprovider", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    assert message in result.stderr.str(), result.stderr.str()
    assert started == {}


class FakeWorker:
    """What xdist's schedulers use of a worker: its id, the tests sent, shutdown."""

    def __init__(self, name: str) -> None:
        self.gateway = type("Gateway", (), {"id": name})()
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


class FakeConfig:
    """What xdist's load scheduler reads of a config: two workers, no chunk limit."""

    def getvalue(self, name: str) -> object:
        assert name == "tx"
        return ["2*popen"]

    def getoption(self, name: str) -> object:
        assert name == "maxschedchunk"
        return None


def test_each_worker_holds_two_tests_and_gets_the_longest_pending_next() -> None:
    from harness._controller.durations import DurationLog
    from harness._controller.schedule import LongestFirstScheduling

    names = [f"t{i}" for i in range(9)]
    log = DurationLog.__new__(DurationLog)
    log.known = {nodeid(n): float(i) for i, n in enumerate(names)}  # t8 the longest
    scheduler = LongestFirstScheduling(FakeConfig(), None, log)
    workers = [FakeWorker("gw0"), FakeWorker("gw1")]
    for worker in workers:
        scheduler.add_node(worker)
    for worker in workers:
        scheduler.add_node_collection(worker, [nodeid(n) for n in names])
    scheduler.schedule()
    assert [w.sent for w in workers] == [[8, 6], [7, 5]]
    assert log.scheduled == (9, 9)
    scheduler.mark_test_complete(workers[1], 7)
    assert workers[1].sent == [7, 5, 4] and scheduler.node2pending[workers[1]] == [5, 4]
    for index in (8, 6, 3, 2):  # gw0 finishes its tests
        scheduler.mark_test_complete(workers[0], index)
        assert len(scheduler.node2pending[workers[0]]) <= 2
    assert workers[0].sent == [8, 6, 3, 2, 1, 0] and not scheduler.pending
    assert not workers[0].shutting_down
    scheduler.mark_test_complete(workers[0], 1)  # nothing left to send: it stops after test 0
    assert workers[0].shutting_down and not workers[1].shutting_down
