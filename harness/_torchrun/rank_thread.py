"""The thread that runs a torchrun rank's test bodies, and its channel to the supervisor."""

from __future__ import annotations

import faulthandler
import queue
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from harness._controller import stacks


class TestAborted(BaseException):
    """Raised in the rank thread where it waits at a subtest barrier that will not
    open (another rank is blocked); a BaseException so that test code does not
    catch it."""


_ABORT = object()


class LocalChannel:
    """Stands in for a pooled rank's pipe: ``send`` goes to the supervisor's inbox,
    ``recv`` waits for the supervisor's reply to a finished subtest."""

    def __init__(self) -> None:
        self.inbox: queue.Queue[object] = queue.Queue()
        self._replies: queue.Queue[object] = queue.Queue()

    def send(self, message: object) -> None:
        self.inbox.put(message)

    def recv(self) -> object:
        reply = self._replies.get()
        if reply is _ABORT:
            raise TestAborted("stopped at a subtest barrier: another rank is blocked")
        return reply

    def reply(self, message: object) -> None:
        self._replies.put(message)

    def abort(self) -> None:
        self._replies.put(_ABORT)


class RankThread:
    """Runs jobs one at a time, as a pooled rank's main thread runs tests."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], Future[Any]]] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="harness-rank", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self._jobs.put((job, future))
        return future

    def call(self, job: Callable[[], Any]) -> Any:
        return self.submit(job).result()

    def _serve(self) -> None:
        while True:
            job, future = self._jobs.get()
            try:
                future.set_result(job())
            except BaseException as exc:
                future.set_exception(exc)

    def stack(self) -> str:
        """The thread's Python stack, as faulthandler writes it (a hung pooled rank's
        stack reads the same), without the harness's frames."""
        with tempfile.TemporaryFile("w+") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.seek(0)
            text = f.read()
        assert self._thread.ident is not None
        return stacks.clean(_block_of(text, self._thread.ident))


def _block_of(text: str, ident: int) -> str:
    """The block of one thread in a faulthandler dump of every thread."""
    header = f"0x{ident:016x}"
    for block in text.split("\n\n"):
        lines = block.strip("\n").splitlines()
        if lines and header in lines[0]:
            return "\n".join(lines)
    return text
