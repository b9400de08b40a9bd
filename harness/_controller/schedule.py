"""Which test an xdist worker gets next: the longest first, from known durations.

[Note: Longest tests first]
Under ``pytest -n``, xdist's ``load`` scheduler hands each worker consecutive
chunks of the collection and keeps at least two tests queued on every worker
(a worker runs a test only once it knows the next one). A session therefore
ends on whatever long tests were collected last, often queued behind each other
on one worker while the others idle: on two GPUs the second half of the suites
took 379 s for 552 s of tests on two workers, ending on its four longest tests
(docs/runs/gpu-runs.md, run 59). Where the tests' durations are known from earlier
runs, ``LongestFirstScheduling`` sends the longest test still pending to
whichever worker asks (the longest-processing-time-first rule), keeping two
tests queued per worker and no more, so the last tests to start are the
shortest. A test without a known duration goes first, in collection order: a
new test may be long.

The durations are each test's setup, call and teardown, summed. A session that
ran a distributed test records them in pytest's cache (``harness/durations``)
when it ends (a foreign project's sessions, which load the plugin too, record
nothing and so keep xdist's order: see [Note: A plugin in every session]), and reads
them from there and from the file named by the ``harness_durations`` ini value
or ``--dist-durations`` (a file kept with the project, so that a fresh checkout
on a CI runner schedules well too; the cache wins where both know a test);
``--dist-record-durations`` writes the session's durations into that file.
The scheduler replaces xdist's ``load`` only (the default of ``-n``): another
``--dist`` mode is the user's choice and is kept, as is ``load`` itself under
``--dist-schedule xdist`` or where no duration is known. Scheduling changes
only the order in which tests start, never which tests run.
"""

from __future__ import annotations

from typing import Any

import pytest
from xdist.scheduler import LoadScheduling

from harness._controller.durations import DurationLog, longest_first

QUEUED = 2  # tests queued per worker: the one it runs and the next (see the Note)


class LongestFirstScheduling(LoadScheduling):  # type: ignore[misc]
    """xdist's load scheduling, sending the longest pending test next."""

    def __init__(self, config: pytest.Config, log: Any, durations: DurationLog) -> None:
        super().__init__(config, log)
        self._durations = durations

    def schedule(self) -> None:
        assert self.collection_is_completed
        if self.collection is not None:
            for node in self.nodes:
                self.check_schedule(node)
            return
        if not self._check_nodes_have_same_collection():
            self.log("**Different tests collected, aborting run**")
            return
        self.collection = next(iter(self.node2collection.values()))
        self.pending[:] = longest_first(self.collection, self._durations.known)
        self._durations.note_scheduled(self.collection)
        for _ in range(QUEUED):  # one test at a time round the workers
            for node in self.nodes:
                if self.pending and len(self.node2pending[node]) < QUEUED:
                    self._send_tests(node, 1)
        if not self.pending:
            for node in self.nodes:
                node.shutdown()

    def check_schedule(self, node: Any, duration: float = 0) -> None:
        if node.shutting_down:
            return
        if not self.pending:
            node.shutdown()
            return
        wanted = QUEUED - len(self.node2pending[node])
        if wanted > 0:
            self._send_tests(node, wanted)


def make_scheduler(config: pytest.Config, log: Any, durations: DurationLog) -> Any:
    """The session's scheduler, or None to keep xdist's own (see the Note)."""
    if config.getoption("dist_schedule") != "longest" or config.getoption("dist") != "load":
        return None
    if not durations.known:
        return None
    return LongestFirstScheduling(config, log, durations)
