"""GPU leasing (harness._controller.leases), without GPUs: the lock files in
process, in processes killed while holding a lease, and in inner xdist sessions
whose tests lease fake GPUs (``harness_fake_gpus``)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import pytest

from harness._controller.leases import GpuLeases, LeaseState, read_journal, recorded_slots
from harness._controller.options import AUTO_SLOTS_MAX, gpu_slots
from tests.conftest import ROOT
from tests.harness.test_harness_runner import src

GPUS = ("g0", "g1")


def test_a_lease_waits_until_its_gpus_are_released(tmp_path: Path):
    first, second = GpuLeases(tmp_path, GPUS), GpuLeases(tmp_path, GPUS)
    lease = first.acquire(2, "first")
    assert lease.gpus == GPUS and first.state is LeaseState.HELD
    got: list[tuple[str, ...]] = []
    waiter = threading.Thread(target=lambda: got.append(second.acquire(1, "second").gpus))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not got  # both GPUs are leased: it waits
    first.release()
    waiter.join(5)
    # release() unlocks g0 then g1 while the waiter polls g0 then g1: either
    # may be the one it finds free first
    assert len(got) == 1 and len(got[0]) == 1 and got[0][0] in GPUS, got
    (left,) = set(GPUS) - set(got[0])
    assert first.acquire(1, "first again").gpus == (left,)  # the one left
    with pytest.raises(RuntimeError, match="leases are held"):
        first.acquire(1, "nested")  # one lease per process: a second could deadlock
    second.release()
    with pytest.raises(ValueError, match="cannot lease 3 of the 2 GPUs"):
        second.acquire(3, "too many")
    first.close()
    second.close()
    assert [entry["holder"] for entry in read_journal(tmp_path)] == [
        "first",
        "second",
        "first again",
    ]


def test_a_lease_prefers_the_gpus_of_kept_pools(tmp_path: Path):
    leases = GpuLeases(tmp_path, ("0", "1", "2", "3"))
    with leases.leased(2, "t", prefer=[("2", "3"), ("0", "1")]) as lease:
        assert lease.gpus == ("2", "3")
    other = GpuLeases(tmp_path, ("0", "1", "2", "3"))
    with other.leased(1, "holds 2", prefer=[("2",)]):
        with leases.leased(2, "t", prefer=[("2", "3"), ("1", "3")]) as lease:
            assert lease.gpus == ("1", "3")  # the first preferred set that is free
        with leases.leased(2, "t", prefer=[("2", "3")]) as lease:
            assert lease.gpus == ("0", "1")  # else the first free ones, in order


def test_slots_let_tests_share_a_gpu_but_never_a_slot(tmp_path: Path):
    """With two slots a GPU serves two leases at once, each lease still takes
    distinct GPUs, a third lease of both waits, and one-GPU leases spread over the
    GPUs before doubling up."""
    a, b, c = (GpuLeases(tmp_path, GPUS, slots=2) for _ in range(3))
    first, second = a.acquire(2, "a"), b.acquire(2, "b")
    assert first.gpus == second.gpus == GPUS
    assert set(zip(first.gpus, first.slots)).isdisjoint(zip(second.gpus, second.slots))
    got: list[tuple[str, ...]] = []
    waiter = threading.Thread(target=lambda: got.append(c.acquire(2, "c").gpus))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not got  # every slot of both GPUs is leased
    a.release()
    waiter.join(5)
    assert got == [GPUS]
    b.release()
    c.release()
    spread = [leases.acquire(1, name).gpus for leases, name in ((a, "a1"), (b, "b1"), (c, "c1"))]
    assert spread == [("g0",), ("g1",), ("g0",)]  # the least busy GPU first
    for leases in (a, b, c):
        leases.close()
    assert [e["slots"] for e in read_journal(tmp_path)][:3] == [[0, 0], [1, 1], [0, 0]]
    assert (tmp_path / "slots").read_text().strip() == "2"


def test_a_lease_directory_refuses_another_slot_count(tmp_path: Path):
    """Processes sharing a directory must count slots alike: one leasing a single
    slot of a GPU another believes has two would share it unknowingly."""
    with GpuLeases(tmp_path, GPUS, slots=2).leased(1, "two slots"):
        pass
    with pytest.raises(ValueError, match="leasing 2 slot.* this one leases 1: .*--gpu-slots"):
        GpuLeases(tmp_path, GPUS).acquire(1, "one slot")
    with pytest.raises(ValueError, match="at least 1 slot"):
        GpuLeases(tmp_path, GPUS, slots=0)


def test_a_lease_adopting_slots_takes_the_directorys_count(tmp_path: Path):
    """``adopt_slots`` (``--gpu-slots auto``) leases with the count the directory
    records, whatever this process would have chosen; before any lease it records
    its own."""
    assert recorded_slots(tmp_path) is None
    with GpuLeases(tmp_path, GPUS, slots=3, adopt_slots=True).leased(2, "first"):
        pass
    assert recorded_slots(tmp_path) == 3
    adopting = GpuLeases(tmp_path, GPUS, slots=1, adopt_slots=True)
    held = [GpuLeases(tmp_path, GPUS, slots=3) for _ in range(2)]
    for leases in held:
        leases.acquire(2, "holder")
    lease = adopting.acquire(2, "third")  # a third slot of each GPU: it counts three
    assert adopting.slots == 3 and lease.slots == (2, 2)
    for leases in (adopting, *held):
        leases.close()


HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    sys.path.insert(0, "harness/_controller")  # the module alone: no torch to import
    from leases import GpuLeases
    leases = GpuLeases(Path(sys.argv[1]), ("g0", "g1"))
    leases.acquire(int(sys.argv[2]), "holder")
    print("held", flush=True)
    time.sleep(600)
    """
)


def _holder(directory: Path, count: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory), str(count)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_killed_holders_lease_is_reclaimed(tmp_path: Path):
    holder = _holder(tmp_path, 2)
    leases = GpuLeases(tmp_path, GPUS)
    got: list[float] = []
    waiter = threading.Thread(target=lambda: got.append(leases.acquire(2, "t").waited_s))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive(), "acquired GPUs that a live process holds"
    killed_at = time.monotonic()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    waiter.join(10)
    assert got, "the killed process's lease was never released"
    assert time.monotonic() - killed_at < 5
    leases.close()


def test_waiting_processes_take_turns(tmp_path: Path):
    """Two processes that each want both GPUs alternate once both are queued."""
    loop = textwrap.dedent(
        """
        import os, sys, time
        from pathlib import Path
        sys.path.insert(0, "harness/_controller")  # the module alone: no torch to import
        from leases import GpuLeases
        leases = GpuLeases(Path(sys.argv[1]), ("g0", "g1"))
        print("ready", flush=True)
        while not os.path.exists(sys.argv[3]):
            time.sleep(0.001)
        for i in range(12):
            with leases.leased(2, f"{sys.argv[2]}-{i}"):
                time.sleep(0.02)
        """
    )
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", loop, str(tmp_path), name, str(go)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for name in ("a", "b")
    ]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    go.touch()
    for proc in procs:
        assert proc.wait(60) == 0
    owners = [str(e["holder"])[0] for e in sorted(read_journal(tmp_path), key=_acquired)]
    # From the first lease of the process that started later to the last lease of
    # the process that finished first, both were queued all the time.
    start = owners.index(owners[-1] if owners[0] != owners[-1] else _other(owners[0]))
    first_done = min(("a", "b"), key=lambda n: max(i for i, o in enumerate(owners) if o == n))
    end = max(i for i, owner in enumerate(owners) if owner == first_done)
    window = owners[start : end + 1]
    assert len(window) > 10 and all(x != y for x, y in zip(window, window[1:])), owners


def _other(name: str) -> str:
    return "b" if name == "a" else "a"


def _acquired(entry: dict[str, object]) -> float:
    return float(entry["acquired"])  # type: ignore[arg-type]


# -- inner sessions: tests lease fake GPUs under xdist --------------------------------

LEASED = src(
    """
    def note(self, test, started):
        entry = {
            "test": test,
            "worker": os.environ.get("PYTEST_XDIST_WORKER"),
            "rank": self.rank,
            "pid": os.getpid(),
            "gpus": os.environ.get("HARNESS_GPUS"),
            "device": str(self.device),
            "start": started,
            "end": time.time(),
        }
        with open(os.environ["PIDS_FILE"] + ".json", "a") as f:
            f.write(json.dumps(entry) + "\\n")

    def body(self, test):
        started = time.time()
        time.sleep(0.3)  # long enough that two tests sharing a GPU would overlap
        t = torch.ones(1, device=self.device)
        dist.all_reduce(t)
        assert t.item() == self.world_size
        note(self, test, started)

    class TestOneRank(DistributedTest):
        world_size = 1

        @pytest.mark.parametrize("i", range(4))
        def test_one(self, i):
            body(self, f"TestOneRank::test_one[{i}]")

    class TestTwoRanks(DistributedTest):
        world_size = 2

        @pytest.mark.parametrize("i", range(4))
        def test_two(self, i):
            body(self, f"TestTwoRanks::test_two[{i}]")

    class TestThreeRanks(DistributedTest):
        world_size = 3

        def test_three(self):
            body(self, "TestThreeRanks::test_three")
    """
).replace("import ctypes,", "import json, ctypes,")


def _notes(run) -> list[dict[str, object]]:
    path = run.path / "pids.txt.json"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _overlap(a: dict[str, object], b: dict[str, object]) -> bool:
    return float(a["acquired"]) < float(b["released"]) and float(b["acquired"]) < float(  # type: ignore[arg-type]
        a["released"]  # type: ignore[arg-type]
    )


def test_concurrent_tests_never_share_a_gpu(inner, tmp_path: Path):
    """Under -n 3 with two fake GPUs and ``--gpu-slots 1``: every 1- and 2-rank
    test runs on leased GPUs (none falls back to CPU), no two leases of one GPU
    overlap, leases of different workers do run at the same time, and a worker's pool on a set of GPUs is
    reused across its leases. Each test's report names the GPUs it leased; the
    3-rank test falls back to CPU ranks, said in its report and the summary."""
    lease_dir = tmp_path / "leases"
    run = inner(
        LEASED,
        "-n",
        "3",
        "-v",
        "--junitxml=junit.xml",
        "--device",
        "auto",
        "-o",
        "harness_fake_gpus=g0,g1",
        "--gpu-lease-dir",
        str(lease_dir),
        "--gpu-slots",
        "1",
    )
    run.result.assert_outcomes(passed=9)
    journal = read_journal(lease_dir)
    notes = _notes(run)

    by_test = {str(e["holder"]).split("::", 1)[1]: e for e in journal}
    assert len(journal) == len(by_test) == 8  # one lease per 1- or 2-rank test
    for note in notes:
        test = str(note["test"])
        if "TestThreeRanks" in test:
            assert note["gpus"] is None and note["device"] == "cpu"  # the fallback
            continue
        lease = by_test[test]
        assert note["gpus"] == ",".join(lease["gpus"])  # type: ignore[arg-type]
        assert len(lease["gpus"]) == (1 if "TestOneRank" in test else 2)  # type: ignore[arg-type]
        assert lease["acquired"] <= note["start"] <= note["end"] <= lease["released"]  # type: ignore[operator]

    for gpu in GPUS:
        held = sorted((e for e in journal if gpu in e["gpus"]), key=_acquired)  # type: ignore[operator]
        for a, b in zip(held, held[1:]):
            assert not _overlap(a, b), f"{gpu} leased twice at once: {a} and {b}"
    assert any(_overlap(a, b) for a in journal for b in journal if a["pid"] != b["pid"]), (
        "no two workers ever held leases at the same time"
    )

    ranks_of: dict[tuple[object, object, object], set[object]] = defaultdict(set)
    for note in notes:
        if note["gpus"] is not None:
            ranks_of[(note["worker"], note["gpus"], note["rank"])].add(note["pid"])
    assert all(len(pids) == 1 for pids in ranks_of.values()), ranks_of  # pools reused

    _assert_reports_name_the_leases(run, notes)


def _properties(run) -> dict[str, dict[str, str]]:
    """Each test's junit properties, by ``Class::test``."""
    root = ET.parse(run.path / "junit.xml").getroot()
    return {
        f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}": {
            p.get("name", ""): p.get("value", "") for p in case.iter("property")
        }
        for case in root.iter("testcase")
    }


def _assert_reports_name_the_leases(run, notes: list[dict[str, object]]) -> None:
    properties = _properties(run)
    for note in notes:
        props = properties[str(note["test"])]
        assert (props["dist_device"], props["dist_backend"]) == ("cpu", "gloo"), props
        if note["gpus"] is None:
            assert "dist_gpus" not in props, props
            assert props["dist_fallback"] == "needs 3 GPUs, 2 visible", props
        else:
            assert props["dist_gpus"] == note["gpus"], props  # the GPUs it leased
            assert "dist_fallback" not in props, props
    assert re.search(
        r"PASSED \(2 ranks, cpu/gloo, fake GPUs g0,g1\) \S*test_inner.py::TestTwoRanks", run.text
    ), run.text
    assert re.search(r"PASSED \(1 rank, cpu/gloo, fake GPUs g[01]\) \S*test_inner.py", run.text)
    assert re.search(
        r"PASSED \(3 ranks, cpu/gloo, cpu fallback: needs 3 GPUs, 2 visible\) "
        r"\S*test_inner.py::TestThreeRanks::test_three",
        run.text,
    ), run.text
    lines = [line for line in run.text.splitlines() if re.match(r"\d-rank tests: ", line)]
    assert lines == [
        "1-rank tests: 4 on cpu/gloo",
        "2-rank tests: 4 on cpu/gloo",
        "3-rank tests: 1 on cpu/gloo (cpu fallback: needs 3 GPUs, 2 visible)",
    ], run.text


def test_device_cuda_leases_fake_gpus_and_errors_where_there_are_too_few(inner):
    """``--device cuda`` takes fake GPUs as GPUs: a 2-rank test leases them, and a
    3-rank test, which no number of waiting would place on two, errors at setup
    instead of running on CPU ranks (as ``--device auto`` would)."""
    run = inner(LEASED, "--device", "cuda", "-o", "harness_fake_gpus=g0,g1", "-k", "Two or Three")
    run.result.assert_outcomes(passed=4, errors=1)
    assert (
        "needs 3 GPUs but only 2 fake GPUs are visible [g0, g1] "
        "(--device cuda; --device auto would run it on CPU ranks)" in run.text
    ), run.text
    assert "cpu fallback" not in run.text
    assert [n["test"] for n in _notes(run) if n["gpus"] != "g0,g1"] == []


KILLS_ITS_WORKER = src(
    """
    @pytest.fixture
    def after_kill():
        # In the pytest process, before the test leases: wait for the first test's kill.
        for _ in range(600):
            if os.path.exists(os.environ["PIDS_FILE"]):
                with open(os.environ["PIDS_FILE"]) as f:
                    if "killed" in f.read():
                        return
            time.sleep(0.1)
        raise AssertionError("the first test never killed its worker")

    class TestTwoRanks(DistributedTest):
        world_size = 2

        def test_0_kills_its_worker(self):
            if self.rank == 0:
                with open(os.environ["PIDS_FILE"], "a") as f:
                    f.write(f"killed {time.time()}\\n")
                os.kill(os.getppid(), signal.SIGKILL)  # the xdist worker holding the lease
            time.sleep(60)

        @pytest.mark.parametrize("i", range(4))
        def test_after(self, i, after_kill):
            t = torch.ones(1, device=self.device)
            dist.all_reduce(t)
            with open(os.environ["PIDS_FILE"], "a") as f:
                f.write(f"ran {time.time()}\\n")
    """
)


def test_a_killed_workers_lease_is_reclaimed(inner, tmp_path: Path):
    """A worker killed while its test holds both fake GPUs: xdist reports the crash,
    and the tests that run after it lease the same GPUs."""
    lease_dir = tmp_path / "leases"
    run = inner(
        KILLS_ITS_WORKER,
        "-n",
        "2",
        "--device",
        "auto",
        "-o",
        "harness_fake_gpus=g0,g1",
        "--gpu-lease-dir",
        str(lease_dir),
    )
    run.result.assert_outcomes(failed=1, passed=4)
    assert "crashed while running" in run.text
    lines = (run.path / "pids.txt").read_text().split()
    killed_at = float(lines[lines.index("killed") + 1])
    journal = read_journal(lease_dir)
    assert len(journal) == 4  # the killed worker's lease was never released by it
    assert all(float(e["acquired"]) > killed_at for e in journal)  # type: ignore[arg-type]
    assert all(e["gpus"] == list(GPUS) for e in journal)


def test_gpu_slots_reach_the_leases_of_an_xdist_session(inner, tmp_path: Path):
    """``--gpu-slots 2`` under -n 2: every 2-rank test leases both fake GPUs, no
    slot of a GPU is held by two tests at once and no GPU by more than two; the
    directory records the count. ``--gpu-slots 0`` is a usage error."""
    lease_dir = tmp_path / "leases"
    args = ("-o", "harness_fake_gpus=g0,g1", "--gpu-lease-dir", str(lease_dir), "-k", "Two")
    run = inner(LEASED, "-n", "2", "--device", "auto", "--gpu-slots", "2", *args)
    run.result.assert_outcomes(passed=4)
    journal = read_journal(lease_dir)
    assert len(journal) == 4 and all(e["gpus"] == list(GPUS) for e in journal)
    for gpu in GPUS:
        held = [e for e in journal if gpu in e["gpus"]]  # type: ignore[operator]
        assert _most_at_once(held) <= 2
        for slot in (0, 1):
            on_slot = [e for e in held if e["slots"][e["gpus"].index(gpu)] == slot]  # type: ignore[attr-defined,index]
            assert _most_at_once(on_slot) <= 1, f"slot {slot} of {gpu} leased twice at once"
    assert (lease_dir / "slots").read_text().strip() == "2"
    assert "GPU slots: up to 2 test(s) on a GPU at once (--gpu-slots)" in run.text
    for bad in ("0", "two", "-1"):
        refused = inner(LEASED, "--gpu-slots", bad)
        assert refused.result.ret == pytest.ExitCode.USAGE_ERROR
        assert (
            f"--gpu-slots needs a whole number of at least 1 or 'auto', got '{bad}'"
            in refused.result.stderr.str()
        )


def test_gpu_slots_auto_gives_a_gpu_one_slot_per_worker(inner, tmp_path: Path):
    """The default, ``--gpu-slots auto`` ([Note: Slots by default]): under -n 3 on two
    fake GPUs a GPU holds up to three tests, and the summary says so; without -n one;
    where a shared lease directory records a count, auto takes it while an explicit
    other count is refused."""
    # --gpu-slots auto given: on a GPU machine the inner sessions get the outer's count
    fake = ("--device", "auto", "-o", "harness_fake_gpus=g0,g1", "-k", "not Three")
    fake += ("--gpu-slots", "auto")
    three = inner(LEASED, "-n", "3", *fake, "--gpu-lease-dir", str(tmp_path / "n3"))
    three.result.assert_outcomes(passed=8)
    assert recorded_slots(tmp_path / "n3") == 3
    assert "GPU slots: up to 3 test(s) on a GPU at once (--gpu-slots auto)" in three.text
    journal = read_journal(tmp_path / "n3")
    assert all(len(e["gpus"]) in (1, 2) for e in journal) and len(journal) == 8  # type: ignore[arg-type]
    alone = inner(LEASED, *fake, "--gpu-lease-dir", str(tmp_path / "alone"))
    alone.result.assert_outcomes(passed=8)
    assert recorded_slots(tmp_path / "alone") == 1
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "slots").write_text("2\n")
    adopted = inner(LEASED, *fake, "--gpu-lease-dir", str(shared))
    adopted.result.assert_outcomes(passed=8)
    assert recorded_slots(shared) == 2
    refused = inner(LEASED, *fake, "--gpu-lease-dir", str(shared), "--gpu-slots", "3")
    refused.result.assert_outcomes(failed=8)
    assert "this one leases 3: every session sharing a --gpu-lease-dir" in refused.text


def test_gpu_slots_auto_is_one_per_worker_up_to_four():
    """The rule itself, on the option values a worker sees."""

    class Config:
        def __init__(self, given: str, workers: int | None) -> None:
            self.given = given
            if workers is not None:
                self.workerinput = {"workercount": workers}

        def getoption(self, name: str) -> str:
            assert name == "gpu_slots"
            return self.given

    expected = {None: 1, 1: 1, 2: 2, 3: 3, 4: 4, 8: AUTO_SLOTS_MAX, 32: AUTO_SLOTS_MAX}
    for workers, slots in expected.items():
        assert gpu_slots(Config("auto", workers)) == slots, workers  # type: ignore[arg-type]
    assert gpu_slots(Config("1", 8)) == 1  # type: ignore[arg-type]
    assert gpu_slots(Config("6", None)) == 6  # type: ignore[arg-type]


def _most_at_once(leases: list[dict[str, object]]) -> int:
    """The most of ``leases`` held at one time (a release before an acquisition at
    the same instant)."""
    events = sorted(
        [(float(e["acquired"]), 1) for e in leases] + [(float(e["released"]), -1) for e in leases]  # type: ignore[arg-type]
    )
    held = most = 0
    for _, change in sorted(events, key=lambda ev: (ev[0], ev[1])):
        held += change
        most = max(most, held)
    return most
