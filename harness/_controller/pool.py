"""A pool of rank processes, owned by one pytest process, reused across tests.

[Note: Rendezvous without races]
The pytest process binds a listening socket on 127.0.0.1 port 0, hands its file
descriptor to a TCPStore server (``master_listen_fd``) and gives the port it got
to the ranks. No port is probed and then bound later, so two pools (or two xdist
workers) can never race for one port, and nothing listens beyond loopback. Gloo
and NCCL are pinned to the loopback interface unless the user says otherwise.

[Note: Failing fast without losing errors]
When a rank reports a failure (or dies), the other ranks get a short grace
period to report their own outcome: if every rank failed, every traceback is
reported. A rank still running after the grace period is almost always blocked
in a collective waiting for the rank that failed; its stack is captured
(SIGUSR1 -> faulthandler) and it is stopped. Nobody waits for a collective
timeout to learn the real error.

[Note: An interrupted test says where its ranks were]
A session stopped from outside while a test hangs (Ctrl-C, a CI job's time
limit sending SIGINT, ``timeout -s INT``) used to end with pytest's
``KeyboardInterrupt`` and nothing about the test: the harness's own deadline,
which reports every rank's stack, had not come yet. The ranks ignore SIGINT;
the pytest process, interrupted while it waits for them, asks every rank still
running for its Python stacks (as at the deadline) and raises
``InterruptedTest``, a ``KeyboardInterrupt`` that carries them, so pytest stops
as it would, and the plugin prints them: in the summary, or on the standard
error of an xdist worker, whose own summary no one sees.
"""

from __future__ import annotations

import contextlib
import enum
import multiprocessing as mp
import os
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch.distributed as dist

from harness._controller import stacks
from harness._controller.devices import LEASED_GPUS_ENV
from harness._controller.report import InterruptedTest
from harness._protocol import (
    BodyReturned,
    Probe,
    ProbeResult,
    Proceed,
    Ready,
    RunTest,
    Shutdown,
    Status,
    SubtestFinished,
    SubtestStarted,
    TestFinished,
    WorkerSpec,
)
from harness._rank import worker
from harness._types import Attempt, Placement, PoolKey, PoolSettings, RankResult, SubtestRecord

_START_TIMEOUT_S = 120.0
_STOP_TIMEOUT_S = 5.0
_SIGNAL_WAIT_S = 1.5
_STACK_WAIT_S = 3.0
_STABLE_POLLS = 4
_PROBE_TIMEOUT_S = 10.0
_LOOPBACK_ENV = (("GLOO_SOCKET_IFNAME", "lo"), ("NCCL_SOCKET_IFNAME", "lo"))
_DEBUG_ENV = "TORCH_DISTRIBUTED_DEBUG"  # DETAIL: torch checks every collective across ranks


class PoolState(enum.Enum):
    NEW = "new"
    READY = "ready"
    BROKEN = "broken"
    STOPPED = "stopped"

    def is_ready(self) -> bool:
        return self is PoolState.READY


class PoolStartError(RuntimeError):
    pass


@dataclass
class RankProcess:
    rank: int
    process: mp.process.BaseProcess
    conn: Connection
    output_file: Path
    stacks_file: Path
    stack_requests: Connection
    output_offset: int = 0

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def death(self) -> str | None:
        """How the process ended, or None while it runs."""
        code = self.process.exitcode
        if code is None:
            return None
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"killed by signal {name} ({-code})"
        return f"exited with exit code {code}"

    def read_output(self) -> str:
        try:
            with open(self.output_file, "rb") as f:
                f.seek(self.output_offset)
                data = f.read()
        except FileNotFoundError:
            return ""
        self.output_offset += len(data)
        return data.decode("utf-8", errors="replace")

    def dump_stack(self) -> str:
        """Asks the rank for the Python stacks of all its threads: by signal
        (answered even while a C call holds the GIL), else through the rank's
        stack thread (answered even where a library took over the signal)."""
        if self.process.exitcode is not None:
            return ""
        before = _size(self.stacks_file)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, worker.STACK_SIGNAL)
        if not self._await_stack(before, _SIGNAL_WAIT_S):
            with contextlib.suppress(OSError):
                self.stack_requests.send_bytes(b"dump")
            self._await_stack(before, _STACK_WAIT_S)
        with open(self.stacks_file, "rb") as f:
            f.seek(before)
            return f.read().decode("utf-8", errors="replace")

    def _await_stack(self, before: int, wait_s: float) -> bool:
        """Waits until the stacks file has grown and then kept its size for a
        while (faulthandler writes frame by frame; a loaded machine is slow)."""
        deadline = time.monotonic() + wait_s
        size, stable = before, 0
        while time.monotonic() < deadline and stable < _STABLE_POLLS:
            time.sleep(0.05)
            new_size = _size(self.stacks_file)
            stable = stable + 1 if new_size > before and new_size == size else 0
            size = new_size
        return size > before


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


class RankPool:
    """``world_size`` spawned rank processes sharing one process group."""

    def __init__(
        self,
        key: PoolKey,
        placement: Placement,
        settings: PoolSettings,
    ) -> None:
        self.key = key
        self.placement = placement
        self.state = PoolState.NEW
        self._settings = settings
        self._ranks: list[RankProcess] = []
        self._store: dist.TCPStore | None = None
        self._tmpdir = tempfile.TemporaryDirectory(prefix="harness-pool-")

    def start(self, sys_path: tuple[str, ...]) -> None:
        port = self._start_store()
        ctx = mp.get_context("spawn")
        for rank in range(self.key.world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            stack_reader, stack_writer = ctx.Pipe(duplex=False)
            spec = self._spec(rank, port, sys_path)
            process = ctx.Process(
                target=worker.main,
                args=(spec, child_conn, stack_reader),
                name=f"harness-rank{rank}",
                daemon=True,
            )
            process.start()
            child_conn.close()
            stack_reader.close()
            self._ranks.append(
                RankProcess(
                    rank,
                    process,
                    parent_conn,
                    worker.output_path(self._tmpdir.name, rank),
                    worker.stacks_path(self._tmpdir.name, rank),
                    stack_writer,
                )
            )
        self._await_ready()
        self.state = PoolState.READY

    def _start_store(self) -> int:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        port = int(listener.getsockname()[1])
        # The store server takes ownership of the listening descriptor.
        self._store = dist.TCPStore(
            "127.0.0.1",
            port,
            self.key.world_size + 1,
            is_master=True,
            master_listen_fd=listener.detach(),
            wait_for_workers=False,
        )
        return port

    def _spec(self, rank: int, port: int, sys_path: tuple[str, ...]) -> WorkerSpec:
        env = {k: os.environ.get(k, v) for k, v in _LOOPBACK_ENV}
        if self.key.check_collectives:
            env[_DEBUG_ENV] = "DETAIL"
        if self.key.gpus:
            env[LEASED_GPUS_ENV] = ",".join(self.key.gpus)
        visible = self.placement.cuda_visible_devices
        return WorkerSpec(
            rank=rank,
            world_size=self.key.world_size,
            backend=self.placement.backend,
            device_type=self.placement.device_type,
            store_port=port,
            cuda_visible_devices=",".join(self.key.gpus) if visible is None else visible,
            output_dir=self._tmpdir.name,
            capture_output=self._settings.capture_output,
            parent_pid=os.getpid(),
            sys_path=sys_path,
            env=tuple(sorted(env.items())),
            pg_timeout_s=self._settings.pg_timeout_s,
            isolated_modules=self._settings.isolated_modules,
            release_cached_memory=self._settings.release_cached_memory,
            profile_dir=self._settings.profile_dir,
            reuse_groups=self._settings.reuse_groups,
        )

    def _await_ready(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        waiting = {r.rank: r for r in self._ranks}
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._fail_start("timed out waiting for the ranks to join the process group")
            sentinels = {r.process.sentinel: r for r in waiting.values()}
            conns = {r.conn: r for r in waiting.values()}
            for obj in wait([*conns, *sentinels], timeout=remaining):
                if obj in sentinels:
                    proc = sentinels[obj]
                    self._fail_start(f"rank {proc.rank} {proc.death()} while starting")
                proc = conns[obj]  # type: ignore[index]
                message = _recv(proc)
                if isinstance(message, Ready):
                    waiting.pop(proc.rank, None)

    def _fail_start(self, why: str) -> None:
        outputs = "\n".join(f"--- rank {r.rank} output ---\n{r.read_output()}" for r in self._ranks)
        self.stop()
        raise PoolStartError(
            f"could not start a pool of {self.key.world_size} ranks: {why}\n{outputs}"
        )

    # -- running a test -------------------------------------------------------

    def execute(self, request: RunTest, deadline: float, grace_s: float) -> Attempt:
        assert self.state.is_ready(), self.state
        for proc in self._ranks:
            proc.conn.send(request)
        driver = _AttemptDriver(self._ranks, deadline, grace_s)
        try:
            attempt = driver.run()
        except KeyboardInterrupt as exc:
            self.state = PoolState.BROKEN
            raise InterruptedTest(request.nodeid, driver.stacks_of_running_ranks()) from exc
        if not attempt.pool_broken and not _passed_cleanly_in_step(attempt):
            attempt.pool_broken = not self._probe()
        for proc in self._ranks:
            attempt.ranks[proc.rank].output = proc.read_output()
        if attempt.pool_broken:
            self.state = PoolState.BROKEN
        return attempt

    def _probe(self) -> bool:
        """[Note: Keeping the pool after a clean failure] Every rank finished the
        test (none died, hung or leaked), but an aborted collective may have left
        the default group out of step. A small all-reduce on every rank, with a
        timeout, tells: the pool is kept only if every rank gets the right sum."""
        for proc in self._ranks:
            proc.conn.send(Probe())
        deadline = time.monotonic() + _PROBE_TIMEOUT_S
        answers: dict[int, bool] = {}
        while len(answers) < len(self._ranks):
            remaining = deadline - time.monotonic()
            pending = {p.conn: p for p in self._ranks if p.rank not in answers}
            ready = wait(list(pending), timeout=max(0.0, remaining))
            if not ready:
                return False
            for conn in ready:
                message = _recv(pending[conn])  # type: ignore[index]
                if not isinstance(message, ProbeResult):
                    return False
                answers[message.rank] = message.ok
        return all(answers.values())

    def stop(self) -> None:
        if self.state is PoolState.STOPPED:
            return
        for proc in self._ranks:
            with contextlib.suppress(OSError, BrokenPipeError):
                if self.state.is_ready():
                    proc.conn.send(Shutdown())
        _stop_processes([r.process for r in self._ranks], graceful=self.state.is_ready())
        for proc in self._ranks:
            proc.conn.close()
            proc.stack_requests.close()
        self._store = None
        self._tmpdir.cleanup()
        self.state = PoolState.STOPPED


def _passed_cleanly_in_step(attempt: Attempt) -> bool:
    """Passed cleanly, and no rank's group cache needs emptying."""
    if any(r.finished is not None and r.finished.groups_dirty for r in attempt.ranks.values()):
        return False
    return _passed_cleanly(attempt)


def _passed_cleanly(attempt: Attempt) -> bool:
    """Every rank passed (or skipped) the test, and no subtest failed."""
    statuses = {r.finished.status for r in attempt.ranks.values() if r.finished is not None}
    if len(statuses) != 1 or Status.FAILED in statuses:
        return False
    return not any(record.any_failed() for record in attempt.subtests.values())


def _stop_processes(processes: list[mp.process.BaseProcess], graceful: bool) -> None:
    if graceful:
        _join_all(processes, _STOP_TIMEOUT_S)
    for process in processes:
        if process.exitcode is None:
            process.terminate()
    _join_all(processes, _STOP_TIMEOUT_S)
    for process in processes:
        if process.exitcode is None:
            process.kill()
    _join_all(processes, _STOP_TIMEOUT_S)


def _join_all(processes: list[mp.process.BaseProcess], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))


def _recv(proc: RankProcess) -> object:
    try:
        return proc.conn.recv()
    except (EOFError, OSError):
        return None


class _AttemptDriver:
    """Drives one test execution: relays subtest barriers, enforces the deadline
    and the grace period, and records what every rank did."""

    def __init__(self, ranks: list[RankProcess], deadline: float, grace_s: float) -> None:
        self._ranks = {r.rank: r for r in ranks}
        self._deadline = deadline
        self._grace_s = grace_s
        self._grace_deadline: float | None = None
        self._pending = set(self._ranks)
        self._failed_subtest: int | None = None
        self.attempt = Attempt(ranks={r: RankResult(r) for r in self._ranks})

    def run(self) -> Attempt:
        while self._pending:
            timeout = self._next_timeout()
            if timeout <= 0:
                self._expire()
                break
            self._poll(timeout)
        return self.attempt

    def stacks_of_running_ranks(self) -> dict[int, str]:
        """The stacks of the ranks that have not finished the test (each asked
        once; a second interrupt stops the asking)."""
        return {
            rank: stacks.clean(self._ranks[rank].dump_stack()) for rank in sorted(self._pending)
        }

    def _next_timeout(self) -> float:
        limit = self._deadline
        if self._grace_deadline is not None:
            limit = min(limit, self._grace_deadline)
        return limit - time.monotonic()

    def _poll(self, timeout: float) -> None:
        live = [self._ranks[r] for r in self._pending]
        conns = {p.conn: p for p in live}
        sentinels = {p.process.sentinel: p for p in live}
        for obj in wait([*conns, *sentinels], timeout=timeout):
            if obj in conns:
                proc = conns[obj]  # type: ignore[index]
                message = _recv(proc)
                if message is not None:
                    self._handle(proc.rank, message)
                    continue
                proc.process.join(_STOP_TIMEOUT_S)
            else:
                proc = sentinels[obj]  # type: ignore[index]
            if proc.rank in self._pending and proc.process.exitcode is not None:
                self._on_death(proc)

    def _handle(self, rank: int, message: object) -> None:
        result = self.attempt.ranks[rank]
        if isinstance(message, SubtestStarted):
            result.current_subtest = (message.index, message.config)
            result.deselected = message.deselected
            record = self.attempt.subtests.setdefault(
                message.index, SubtestRecord(message.index, message.config)
            )
            record.started = record.started or time.time()
        elif isinstance(message, SubtestFinished):
            self._on_subtest_finished(rank, message)
        elif isinstance(message, BodyReturned):
            result.body_returned = message.status
        elif isinstance(message, TestFinished):
            result.finished = message
            result.current_subtest = None
            self._pending.discard(rank)
            if message.leak:
                self.attempt.leaks[rank] = message.leak
            if not message.healthy or message.leak:
                # An unhealthy rank cannot go on; a leaking one slows every later
                # test: the next test gets a fresh pool. (A test that merely
                # failed keeps the pool if the probe agrees: see RankPool._probe.)
                self.attempt.pool_broken = True
            if message.status.is_failed() or message.status is Status.SKIPPED:
                # A rank that failed, or skipped alone, may leave the others in a
                # collective it never joins.
                self._start_grace()

    def _on_subtest_finished(self, rank: int, message: SubtestFinished) -> None:
        record = self.attempt.subtests.setdefault(
            message.index, SubtestRecord(message.index, message.config)
        )
        record.finished[rank] = message
        if message.status.is_failed() or message.status is Status.SKIPPED:
            self._failed_subtest = message.index
            self._start_grace()
        if len(record.finished) == len(self._ranks):
            record.stopped = time.time()
            reply = Proceed(message.index, record.any_failed())
            for proc in self._ranks.values():
                proc.conn.send(reply)
            for result in self.attempt.ranks.values():
                result.current_subtest = None
            self._grace_deadline = None
            self._failed_subtest = None

    def _on_death(self, proc: RankProcess) -> None:
        result = self.attempt.ranks[proc.rank]
        result.death = proc.death()
        self._pending.discard(proc.rank)
        self.attempt.pool_broken = True
        if result.current_subtest is not None:
            index, config = result.current_subtest
            record = self.attempt.subtests.setdefault(index, SubtestRecord(index, config))
            record.notes.append(f"rank {proc.rank} {result.death} during this subtest")
            self._failed_subtest = index
        self._start_grace()

    def _start_grace(self) -> None:
        if self._grace_deadline is None:
            self._grace_deadline = time.monotonic() + self._grace_s

    def _expire(self) -> None:
        """The deadline or the grace period ran out with ranks still running."""
        self.attempt.pool_broken = True
        self.attempt.timed_out = time.monotonic() >= self._deadline
        for rank in sorted(self._pending):
            proc = self._ranks[rank]
            self.attempt.ranks[rank].stopped_stack = proc.dump_stack()
        if not self.attempt.timed_out and self._failed_subtest is not None:
            note_stragglers(self.attempt, self._failed_subtest)
            self.attempt.restart_after = self._failed_subtest
        self._pending.clear()


def note_stragglers(attempt: Attempt, index: int) -> None:
    """Notes, on subtest ``index``, the stacks of the ranks stopped before finishing it."""
    record = attempt.subtests[index]
    for rank, result in attempt.ranks.items():
        if result.stopped_stack is not None and rank not in record.finished:
            stack = stacks.clean(result.stopped_stack) or "(no stack: it did not answer)"
            how = "skipped" if record.all_skipped() else "failed"
            record.notes.append(
                f"rank {rank} was stopped after another rank {how} this subtest; "
                f"it was blocked here:\n{stack}"
            )
