"""``--launcher torchrun``: the suites with ranks started by torchrun, across hosts.

[Note: Tests under torchrun]
``torchrun ... -m pytest --launcher torchrun suites/...`` (``--dist-launcher``
where a project's conftest owns ``--launcher``) starts one pytest
session per rank. Each session collects the same tests (the same command line
everywhere; the ranks compare a hash of their collected node ids and refuse to
run on a difference) and runs the distributed tests in order, in-process: the
test body runs on a thread of the session's own (the rank thread, the pooled
rank's main thread here), in the process group torchrun set up (``env://``:
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), with the same
isolation between tests as a pooled rank (``harness._rank``). The session's main
thread supervises it as the pytest process supervises a pool.

The ranks tell each other what happened through torch's TCPStore at
``MASTER_ADDR:MASTER_PORT`` (torchrun's agent hosts it), over a connection of
their own, never through the process group under test: a rank blocked in a
collective cannot keep the others from reporting. Each rank publishes whether it
set a test up (a skip or an error on some ranks only fails the test on every
rank, naming them, instead of leaving the others waiting), every subtest outcome
(the subtest barrier: the next subtest starts when every rank finished this
one), and how it ended the test: its ``TestFinished``, or, when the deadline or
another rank's failure plus ``--fail-grace`` passed first, its rank thread's
stack. Every rank builds the same report from the store (``harness._controller
.report``): failing ranks named with their tracebacks, stacks of blocked ranks,
subtests. From the verdict on, a test is reported as a pooled one is (see
[Note: Two launchers] in ``harness.plugin``): its placement properties
(``dist_gpus``: each rank's GPU, with its host when the ranks span hosts), each
subtest a pytest report of its own, and the same checks that nothing ran green
for nothing (a ``--dist-subtest`` filter that selects none of a test's
combinations fails it, every subtest skipped is a skip, a body that never ran
fails). A rank that stops beating its heartbeat for ``_DEAD_S`` is reported as
gone (torchrun's own error summary names its exit code).

A test whose world size is not torchrun's ``WORLD_SIZE`` is skipped on every
rank with the reason, and the session summary counts these skips. Tests that are
not distributed run on global rank 0 only (the others deselect them), and
``rank_calls`` (which starts the harness's own pools) skips. At the end every
rank exits with rank 0's exit status, so every agent fails or passes alike.

A rank blocked in a collective cannot be stopped as a pooled rank is (its
process is the session). After a test that left one blocked, every rank ends
its collectives (see [Note: Ending a blocked collective] in ``session``), and
when every rank thread has returned within ``_RECOVER_S`` the default group is
created anew and the session goes on. A rank that stays blocked (a Python loop
that never ends, a device hang no abort reaches) stops the session after that
test's report: the remaining tests do not run, the summary says why, and the
process exits with the session's status once pytest is done. After a test that
failed cleanly, a small all-reduce checks the default group as for a pool, and
a group out of step is created anew.
"""
