"""The rank process: joins the pool's process group once, then runs tests on request.

[Note: A rank's lifetime]
A rank is started with the spawn method, so nothing of the pytest process
(CUDA state, threads, patched modules) leaks into it. It redirects its output to
a file the pytest process reads per test, arms ``faulthandler`` (fatal signals
write a Python stack; SIGUSR1 dumps every thread's stack on request, which is
how a hang is explained; a thread answers the same request over a pipe, for the
case where a library took the signal over), watches its parent so that it never outlives the
session, joins the process group over a TCPStore the parent is hosting, and
then serves ``RunTest`` messages until ``Shutdown`` or until its pipe closes.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TextIO

from harness._protocol import WorkerSpec
from harness._rank.runner import serve

STACK_SIGNAL = signal.SIGUSR1
_PR_SET_PDEATHSIG = 1


def output_path(output_dir: str, rank: int) -> Path:
    return Path(output_dir) / f"rank{rank}.out"


def stacks_path(output_dir: str, rank: int) -> Path:
    return Path(output_dir) / f"rank{rank}.stacks"


def main(spec: WorkerSpec, conn: Connection, stack_requests: Connection) -> None:
    _prepare_process(spec)
    _serve_stack_requests(stack_requests)
    exit_code = serve(spec, conn)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def _prepare_process(spec: WorkerSpec) -> None:
    if spec.capture_output:
        _redirect_output(output_path(spec.output_dir, spec.rank))
    faulthandler.enable(all_threads=True)
    _STACK_FILES.append(open(stacks_path(spec.output_dir, spec.rank), "a"))
    faulthandler.register(STACK_SIGNAL, file=_STACK_FILES[-1], all_threads=True, chain=False)
    _die_with_parent(spec.parent_pid)
    # Ctrl-C (SIGINT to the terminal's process group, or `timeout -s INT`) is the
    # pytest process's to handle: it asks the ranks where they are and stops them
    # (see [Note: An interrupted test says where its ranks were] in harness._controller.pool).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for key, value in spec.env:
        os.environ[key] = value
    if spec.cuda_visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = spec.cuda_visible_devices
    sys.path[:] = list(spec.sys_path)


_STACK_FILES: list[TextIO] = []


def _serve_stack_requests(requests: Connection) -> None:
    """Dumps every thread's stack for each request on ``requests``. The thread
    blocks in ``recv`` (without the GIL) and ends when the pool closes the pipe."""

    def serve() -> None:
        while True:
            try:
                requests.recv_bytes()
            except (EOFError, OSError):
                return
            faulthandler.dump_traceback(file=_STACK_FILES[-1], all_threads=True)
            _STACK_FILES[-1].flush()

    threading.Thread(target=serve, name="harness-stack-dump", daemon=True).start()


def _redirect_output(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


def _die_with_parent(parent_pid: int) -> None:
    """No rank outlives the pytest process, even one killed with SIGKILL."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(70)
            time.sleep(0.5)

    threading.Thread(target=watch, name="harness-parent-watch", daemon=True).start()
