"""One rank's side of a torchrun session: its process group, its rank thread, and
the pytest hooks that keep the ranks in step (see the package note)."""

from __future__ import annotations

import contextlib
import datetime
import gc
import hashlib
import os
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness._controller import options
from harness._controller.dispatch import TestRequest
from harness._controller.report import Verdict, compose
from harness._protocol import Status, TestFinished, WorkerSpec
from harness._rank.isolation import LeakCheck, StateBaseline
from harness._rank.profiling import profiled
from harness._rank.runner import one_thread_per_rank, probe_default_group, run_test
from harness._torchrun.env import TorchrunEnv
from harness._torchrun.exchange import Exchange, Heartbeat
from harness._torchrun.rank_thread import RankThread
from harness._torchrun.supervisor import RankEnd, Supervisor
from harness._types import Placement, PoolSettings

_SETUP_S = 300.0  # the other ranks' start, collection, and end of session
_RECOVER_S = 15.0
_HEARTBEAT_S = 1.0
_DEAD_S = 15.0
_PYTEST_ENV = ("PYTEST_CURRENT_TEST",)  # pytest sets and pops it around each phase


class TorchrunSession:
    """This process is one rank of the session (see the note in ``harness._torchrun``)."""

    def __init__(
        self, env: TorchrunEnv, settings: PoolSettings, is_distributed: Callable[[Any], bool]
    ) -> None:
        self.env = env
        self._settings = settings
        self._is_distributed = is_distributed
        self.device = torch.device("cpu")
        self.backend = "gloo"
        self.gpus: tuple[str, ...] = ()  # every rank's GPU, in rank order (CUDA only)
        self.thread = RankThread()
        self._rdzv_store: dist.Store | None = None
        self.exchange: Exchange | None = None
        self.heartbeat: Heartbeat | None = None
        self._baseline: StateBaseline | None = None
        self._leaks: LeakCheck | None = None
        self._distributed: set[str] = set()
        self._generation = 0
        self.tests_run = 0
        self.wrong_world_size: Counter[int] = Counter()
        self.wedged = ""
        self._exitstatus = 0

    @classmethod
    def start(
        cls,
        config: pytest.Config,
        settings: PoolSettings,
        is_distributed: Callable[[Any], bool],
    ) -> TorchrunSession:
        """Joins the other ranks; ``harness._controller.options`` has checked that
        torchrun's environment is there and ``-n`` is not."""
        session = cls(TorchrunEnv.read(), settings, is_distributed)
        session._connect(
            str(config.getoption("dist_device")), options.spelling(config, options.DEVICE)
        )
        return session

    # -- setting up -----------------------------------------------------------------

    def _connect(self, requested: str, device_option: str) -> None:
        timeout = datetime.timedelta(seconds=_SETUP_S)
        self._rdzv_store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
        client = dist.TCPStore(
            self.env.master_addr, self.env.master_port, is_master=False, timeout=timeout
        )
        prefix = f"harness/{self.env.run_id}/{self.env.restart}"
        self.exchange = Exchange(
            dist.PrefixStore(prefix, client), self.env.rank, self.env.world_size
        )
        self.heartbeat = Heartbeat(self.exchange.scope("hb"), _HEARTBEAT_S, _DEAD_S)
        self.heartbeat.start()
        self._choose_device(requested, device_option)
        self.thread.call(self._prepare_thread)
        self.thread.call(lambda: self._init_group(0))
        self._baseline = self.thread.call(
            lambda: StateBaseline.capture(self._settings.isolated_modules, _PYTEST_ENV)
        )
        self._leaks = self.thread.call(lambda: LeakCheck(self.device))

    def _choose_device(self, requested: str, device_option: str) -> None:
        """CUDA and NCCL when every rank has a GPU for its local rank (``auto``).
        Every rank learns every rank's GPU, for the reports' ``dist_gpus``."""
        assert self.exchange is not None
        if requested == "cpu":
            # CPU ranks do not see the host's GPUs, as the spawn launcher's CPU ranks do
            # not: an FSDP given a module on the CPU and no device_id would compute on
            # cuda:0 where CUDA is available. Nothing has initialised CUDA yet here.
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        local = torch.cuda.is_available() and torch.cuda.device_count() > self.env.local_rank
        mine = _gpu_name(self.env.local_rank) if requested != "cpu" and local else None
        self.exchange.put_mine("cuda", (socket.gethostname(), mine))
        answers = self.exchange.gather("cuda", time.monotonic() + _SETUP_S)
        without = sorted(
            r for r in range(self.env.world_size) if r not in answers or answers[r][1] is None
        )
        if requested == "cuda" and without:
            raise pytest.UsageError(
                f"{device_option} cuda: rank(s) {without} have no GPU for their local rank"
            )
        if not without:
            self.device, self.backend = torch.device("cuda", self.env.local_rank), "nccl"
            self.gpus = _gpu_names([answers[r] for r in range(self.env.world_size)])

    def _prepare_thread(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            one_thread_per_rank()

    def _init_group(self, generation: int) -> None:
        """The default group of ``generation`` (a new one after a blocked test)."""
        assert self._rdzv_store is not None
        with contextlib.suppress(Exception):  # an aborted group may be half gone
            dist.destroy_process_group()
        gc.collect()
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore(f"harness/pg/{generation}", self._rdzv_store),
            rank=self.env.rank,
            world_size=self.env.world_size,
            timeout=datetime.timedelta(seconds=self._settings.pg_timeout_s),
            device_id=self.device if self.device.type == "cuda" else None,
        )

    def placement(self, world_size: int) -> Placement | str:
        if world_size != self.env.world_size:
            self.wrong_world_size[world_size] += 1
            return (
                f"needs {world_size} ranks; this torchrun run has WORLD_SIZE={self.env.world_size}"
            )
        return Placement(self.device.type, self.backend, None)  # torchrun placed the ranks

    # -- pytest hooks -----------------------------------------------------------------

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[Any]) -> None:
        assert self.exchange is not None
        digest = hashlib.sha1("\n".join(i.nodeid for i in items).encode()).hexdigest()
        self.exchange.put_mine("collected", (len(items), digest))
        got = self.exchange.gather("collected", time.monotonic() + _SETUP_S, self._gone)
        mine = (len(items), digest)
        differ = sorted(r for r in range(self.env.world_size) if got.get(r) != mine)
        if differ:
            seen = ", ".join(
                f"rank {r}: {got[r][0]} tests" if r in got else f"rank {r}: nothing"
                for r in sorted(set(differ) | {self.env.rank})
            )
            raise pytest.UsageError(
                f"the ranks collected different tests ({seen}); under torchrun every "
                "rank must run the same command line in the same tree"
            )
        self._distributed = {i.nodeid for i in items if self._is_distributed(i)}
        if self.env.rank != 0:
            local = [i for i in items if i.nodeid not in self._distributed]
            if local:
                config.hook.pytest_deselected(items=local)
                items[:] = [i for i in items if i.nodeid in self._distributed]

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "setup" or report.nodeid not in self._distributed:
            return
        assert self.exchange is not None
        if report.passed:
            outcome = "passed"
        elif report.skipped:
            outcome = f"skipped ({_skip_reason(report)})"
        else:
            outcome = f"failed in setup:\n{report.longreprtext}"
        self.exchange.for_test(report.nodeid).put_mine("setup", outcome)

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        assert self.exchange is not None
        self.exchange.store.add(f"progress/{self.env.rank}", 1)

    def pytest_runtest_teardown(self, item: pytest.Item) -> None:
        if self.wedged:
            item.session.shouldfail = f"torchrun session stopped: {self.wedged}"

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        """Every rank exits with rank 0's status: the agents fail or pass alike."""
        assert self.exchange is not None
        if self.env.rank == 0:
            self.exchange.put("exitstatus", int(exitstatus))
            self._exitstatus = int(exitstatus)
            return
        while not self.exchange.has("exitstatus"):  # rank 0 may run tests of its own
            if 0 in self._gone():
                return
            time.sleep(0.05)
        if self.exchange.has("exitstatus"):
            self._exitstatus = int(self.exchange.take("exitstatus"))
            session.exitstatus = self._exitstatus

    def summary_lines(self) -> list[str]:
        """This rank's lines of the summary's ``distributed tests`` section."""
        lines = [
            f"torchrun: {self.env.describe()}, ranks on {self.device.type}/{self.backend}; "
            f"{self.tests_run} distributed tests ran"
            + (
                f"; the default group was created anew {self._generation} times"
                if self._generation
                else ""
            )
        ]
        if self.wrong_world_size:
            sizes = ", ".join(
                f"{n} needing {k} ranks" for k, n in sorted(self.wrong_world_size.items())
            )
            lines.append(
                f"torchrun: {sum(self.wrong_world_size.values())} distributed tests skipped, "
                f"their world size is not WORLD_SIZE={self.env.world_size} ({sizes})"
            )
        if self.wedged:
            lines.append(f"torchrun: the session stopped early: {self.wedged}")
        return lines

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.wedged:
            # A rank thread is blocked in a collective: the interpreter could not
            # finish. Exit with the session's status.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(self._exitstatus or 1)
        with contextlib.suppress(Exception):
            self.thread.call(dist.destroy_process_group)

    def _gone(self) -> set[int]:
        return self.heartbeat.gone() if self.heartbeat is not None else set()

    # -- running a test -----------------------------------------------------------------

    def run(self, request: TestRequest, on_ready: Callable[[], None]) -> Verdict:
        assert self.exchange is not None
        self.tests_run += 1
        info = request.info()
        test = self.exchange.for_test(request.message.nodeid)
        setups = self._await_setups(test, request.timeout_s)
        problem = _setup_problem(setups, self.env.world_size)
        if problem:
            return Verdict(Status.FAILED, f"{problem} ({info.describe()})\n", None)
        on_ready()
        supervisor = Supervisor(
            test,
            self.thread,
            time.monotonic() + request.reported_timeout_s(),
            request.grace_s,
            self._gone,
        )
        attempt, ends = supervisor.run(lambda channel: self._run_test(request, channel))
        verdict = compose([attempt], info, None)
        verdict.warnings = _leak_warnings(ends)
        verdict.gpus = self.gpus
        if attempt.restart_after is not None:
            verdict.text += (
                "\nunder torchrun a test does not resume after a subtest that left a rank "
                "blocked: its remaining subtests did not run\n"
            )
        self._after(test, request.message.nodeid, ends, verdict, supervisor)
        return verdict

    def _await_setups(self, test: Exchange, idle_s: float) -> dict[int, str]:
        """Every rank's setup outcome. A rank may be late: rank 0 also runs the
        tests that are not distributed. It is waited for while it goes on with
        tests (``progress``), up to ``idle_s`` after its last one started."""
        assert self.exchange is not None
        seen: dict[int, tuple[bytes, float]] = {}
        while True:
            got = test.gather("setup", time.monotonic() + 1.0, self._gone)
            missing = set(range(self.env.world_size)) - set(got)
            if not missing or missing <= self._gone():
                return got
            now = time.monotonic()
            for rank in missing:
                key = f"progress/{rank}"
                count = self.exchange.store.get(key) if self.exchange.has(key) else b""
                if rank not in seen or seen[rank][0] != count:
                    seen[rank] = (count, now)
            if all(now - seen[rank][1] > idle_s for rank in missing):
                return got

    def _run_test(self, request: TestRequest, channel: Any) -> TestFinished:
        assert self._baseline is not None and self._leaks is not None
        spec, baseline, leaks = self._spec(), self._baseline, self._leaks
        return profiled(
            spec.profile_dir,
            f"{request.message.nodeid}.rank{spec.rank}",
            lambda: run_test(request.message, spec, self.device, channel, baseline, leaks),
        )

    def _spec(self) -> WorkerSpec:
        return WorkerSpec(
            rank=self.env.rank,
            world_size=self.env.world_size,
            backend=self.backend,
            device_type=self.device.type,
            store_port=self.env.master_port,
            cuda_visible_devices=None,
            output_dir="",
            capture_output=False,
            parent_pid=os.getppid(),
            sys_path=tuple(sys.path),
            env=(),
            pg_timeout_s=self._settings.pg_timeout_s,
            isolated_modules=self._settings.isolated_modules,
            profile_dir=self._settings.profile_dir,
        )

    def _after(
        self,
        test: Exchange,
        nodeid: str,
        ends: dict[int, RankEnd],
        verdict: Verdict,
        supervisor: Supervisor,
    ) -> None:
        """Keeps the process group usable for the next test, or stops the session."""
        missing = sorted(set(range(self.env.world_size)) - set(ends))
        if missing:
            self.wedged = f"rank(s) {missing} stopped answering during {nodeid}"
            return
        blocked = sorted(r for r, e in ends.items() if e.blocked())
        unhealthy = any(e.finished is not None and not e.finished.healthy for e in ends.values())
        if blocked or unhealthy:
            self._recover(test, nodeid, blocked, supervisor)
        elif verdict.status is Status.FAILED and not self._probe(test):
            self._recover(test, nodeid, [], supervisor)

    def _probe(self, test: Exchange) -> bool:
        ok = self.thread.call(lambda: probe_default_group(self.device))
        test.put_mine("probe", ok)
        answers = test.gather("probe", time.monotonic() + _RECOVER_S, self._gone)
        return len(answers) == self.env.world_size and all(answers.values())

    def _recover(
        self, test: Exchange, nodeid: str, blocked: list[int], supervisor: Supervisor
    ) -> None:
        """Ends the blocked ranks' waits, then creates the default group anew once
        every rank thread is free (see [Note: Ending a blocked collective])."""
        supervisor.release_barrier()
        keep = {self.env.master_port}
        _end_collectives(sockets=self.backend == "gloo", keep_ports=keep)
        free = supervisor.wait_idle(_RECOVER_S / 2)
        if not free:
            _end_collectives(sockets=True, keep_ports=keep)
            free = supervisor.wait_idle(_RECOVER_S / 2)
        test.put_mine("recovered", free)
        answers = test.gather("recovered", time.monotonic() + 2 * _RECOVER_S, self._gone)
        still = sorted(r for r in range(self.env.world_size) if not answers.get(r))
        if still:
            self.wedged = (
                f"after {nodeid}, rank(s) {still} stayed blocked in the test (see its report) "
                "and cannot be stopped under torchrun"
            )
            return
        self._generation += 1
        generation = self._generation
        self.thread.call(lambda: self._init_group(generation))
        self._leaks = self.thread.call(lambda: LeakCheck(self.device))


def _end_collectives(sockets: bool, keep_ports: set[int]) -> None:
    """[Note: Ending a blocked collective]
    A pooled rank blocked in a collective is stopped with its process; a torchrun
    rank is this process. Every rank (blocked or not) aborts all its process
    groups: NCCL's abort ends a blocked NCCL collective. Gloo's does not, and a
    gloo group's connections close only when the last reference to the group is
    gone, which code holding the group (a closure, a module) can prevent. So on
    gloo every rank also shuts down its established TCP connections except those
    to or from the store's port (``keep_ports``): a blocked send or receive then
    fails at once, on this rank and on its peers. Those connections belong to
    groups that are being abandoned; the default group is created anew after."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    with contextlib.suppress(Exception):
        if dist.is_initialized():
            abort() if abort is not None else dist.destroy_process_group()
    if sockets:
        for fd in _tcp_connections(keep_ports):
            with contextlib.suppress(OSError):
                sock = socket.socket(fileno=fd)
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                finally:
                    sock.detach()  # the group owns the descriptor
    gc.collect()


def _tcp_connections(keep_ports: set[int]) -> list[int]:
    """Descriptors of this process's established TCP connections (``/proc``),
    but for those with an end on one of ``keep_ports``."""
    by_inode: dict[str, int] = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{name}")
            if target.startswith("socket:["):
                by_inode[target[len("socket:[") : -1]] = int(name)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
                ports = {int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)}
                if state == "01" and inode in by_inode and not ports & keep_ports:
                    found.append(by_inode[inode])
    return found


def _gpu_name(local_rank: int) -> str:
    """The GPU of ``cuda:local_rank`` as a ``CUDA_VISIBLE_DEVICES`` entry."""
    outer = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = [e.strip() for e in outer.split(",") if e.strip()] if outer is not None else []
    return entries[local_rank] if local_rank < len(entries) else str(local_rank)


def _gpu_names(ranks: list[tuple[str, str]]) -> tuple[str, ...]:
    """Each rank's GPU, prefixed by its host when the ranks span hosts."""
    if len({host for host, _ in ranks}) == 1:
        return tuple(gpu for _, gpu in ranks)
    return tuple(f"{host}:{gpu}" for host, gpu in ranks)


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _setup_problem(setups: dict[int, str], world_size: int) -> str:
    """Why the test cannot run: some ranks did not set it up as this one did."""
    lines = []
    for rank in range(world_size):
        outcome = setups.get(rank)
        if outcome is None:
            lines.append(f"rank {rank} never set the test up (stopped answering?)")
        elif outcome != "passed":
            lines.append(f"rank {rank} {outcome}")
    if not lines:
        return ""
    ran = ", ".join(f"rank {r}" for r in range(world_size) if setups.get(r) == "passed")
    return (
        "the ranks did not all set the test up, so none ran it: "
        + "; ".join(lines)
        + (f"; {ran} did" if ran else "")
        + " (under torchrun every rank must decide skips alike)"
    )


def _leak_warnings(ends: dict[int, RankEnd]) -> list[str]:
    by_text: dict[str, list[int]] = {}
    for rank, end in sorted(ends.items()):
        if end.finished is not None and end.finished.leak:
            by_text.setdefault(end.finished.leak, []).append(rank)
    return [
        f"{', '.join(f'rank {r}' for r in ranks)}: after the test, {text} "
        "(under torchrun the ranks go on with it)"
        for text, ranks in by_text.items()
    ]
