"""Turns what the ranks did into one verdict and one readable failure report.

[Note: Nothing that ran nothing passes]
A verdict is PASSED only when every rank of a pool of at least one rank finished
the test body and passed. Zero ranks, a ``--subtest`` filter that selected none
of a test's combinations, every subtest skipped (the test is then skipped, with
the first reason) or a subtest skipped on some ranks only (a failure) never end
as a pass; neither does a test whose ranks never reached the body (a failed pool
start, a rank that died first) nor a body that only built a coroutine or a
generator (the ranks raise for that; see ``harness._rank.runner``), nor a
``run_subtests`` call whose configuration has no combination (the ranks raise).

[Note: A filter that selects nothing]
Subtest combinations are built inside the ranks, so the pytest process learns
what a ``--subtest`` filter could have matched only when the test has run: each
rank reports the keys and values its ``run_subtests`` calls offered and which
pairs of the filter matched some value. A test that called ``run_subtests`` but
ran none of its combinations under the filter fails, naming the pairs that
matched nothing (a misspelt key, a value no combination has) and listing the
keys and values that exist. A test that never calls ``run_subtests`` runs as
usual: it has no combination to select.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from harness._controller import stacks
from harness._protocol import Status, SubtestCounts
from harness._types import Attempt, RankResult, SubtestRecord

_DEATH_OUTPUT_LINES = 40


class InterruptedTest(KeyboardInterrupt):
    """The session was interrupted while ``nodeid`` ran (see [Note: An
    interrupted test says where its ranks were] in ``harness._controller.pool``)."""

    def __init__(self, nodeid: str, rank_stacks: dict[int, str]) -> None:
        super().__init__(nodeid)
        self.nodeid = nodeid
        self.rank_stacks = rank_stacks

    def describe(self) -> str:
        lines = [f"interrupted while {self.nodeid} ran"]
        if not self.rank_stacks:
            lines.append("(every rank had finished it)")
        for rank, stack in self.rank_stacks.items():
            lines.append(f"rank {rank} was here:")
            lines.append(stack or "(no stack: it did not answer)")
        return "\n".join(lines)


class PoolLeakWarning(UserWarning):
    """A test left process groups, threads, descriptors or device memory in its
    pooled ranks that the harness could not release; the pool was replaced."""


@dataclass(frozen=True)
class SubtestOutcome:
    """One subtest's result, reported as a pytest report of its own: ``text`` is
    its failure report (every failing rank's traceback, stopped ranks' stacks)
    or its skip reason."""

    index: int
    config: str
    status: Status
    text: str
    started: float
    duration_s: float


@dataclass
class Verdict:
    status: Status
    text: str  # the test's report; failing subtests are listed, their reports are in `subtests`
    counts: SubtestCounts | None
    outputs: dict[int, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    subtests: list[SubtestOutcome] = field(default_factory=list)
    # The GPUs the ranks ran on: those leased for the run, or torchrun's ranks'
    # (see [Note: What ran where] in harness._controller.pytest_reports).
    gpus: tuple[str, ...] = ()

    def full_text(self) -> str:
        """The report with every failing subtest's own report appended."""
        failed = [s.text.rstrip() for s in self.subtests if s.status.is_failed()]
        if not failed:
            return self.text
        return "\n\n".join([self.text.rstrip(), *failed]) + "\n"


@dataclass(frozen=True)
class RunInfo:
    world_size: int
    device_type: str
    backend: str
    timeout_s: float
    subtest_filter: tuple[tuple[str, str], ...] = ()
    subtest_option: str = "--subtest"  # how this session spells the option

    def describe(self) -> str:
        return f"world_size={self.world_size}, device={self.device_type}, backend={self.backend}"

    def rerun_hint(self, config: str) -> str:
        return f're-run it alone with: {self.subtest_option} "{config}"'


def compose(attempts: Sequence[Attempt], info: RunInfo, start_error: str | None) -> Verdict:
    if start_error is not None:
        return Verdict(Status.FAILED, start_error, None)
    if not attempts or not attempts[-1].ranks:
        return Verdict(Status.FAILED, f"no rank ran the test ({info.describe()})\n", None)
    verdict = _judge(attempts, info)
    verdict.warnings = _leak_warnings(attempts)
    return verdict


def _judge(attempts: Sequence[Attempt], info: RunInfo) -> Verdict:
    final = attempts[-1]
    subtests = _merge_subtests(attempts)
    counts = _count(subtests, attempts) if subtests or _any_deselected(attempts) else None
    outcomes = [_subtest_outcome(record, info) for record in subtests.values()]
    outputs = _outputs(attempts)
    unmatched = _unmatched_filter(final, subtests, info)
    status = _status(final, counts)
    if status.is_failed() or unmatched:
        parts = [unmatched] if unmatched else []
        if status.is_failed():
            parts.append(_header(final, info, counts))
            if counts is not None and counts.failed:
                parts.append(_failed_subtests_list(subtests, info))
            parts.extend(_rank_sections(final, info, counts))
        text = "\n\n".join(parts).rstrip() + "\n"
        return Verdict(Status.FAILED, text, counts, outputs, subtests=outcomes)
    if status is Status.SKIPPED:
        return Verdict(status, _skip_reason(final, subtests), counts, outputs, subtests=outcomes)
    return Verdict(status, "", counts, outputs, subtests=outcomes)


def _subtest_outcome(record: SubtestRecord, info: RunInfo) -> SubtestOutcome:
    duration = max(0.0, record.stopped - record.started) if record.stopped else 0.0
    if record.any_failed():
        status, text = Status.FAILED, _subtest_report(record, info)
    elif record.all_skipped():
        status, text = Status.SKIPPED, _first_skip_reason(record)
    else:
        status, text = Status.PASSED, ""
    return SubtestOutcome(record.index, record.config, status, text, record.started, duration)


def _first_skip_reason(record: SubtestRecord) -> str:
    return next(f.text for _, f in sorted(record.finished.items()))


def _unmatched_filter(final: Attempt, subtests: dict[int, SubtestRecord], info: RunInfo) -> str:
    """See [Note: A filter that selects nothing]; "" when there is nothing to say."""
    if not info.subtest_filter or subtests:
        return ""
    reports = [r.finished for r in final.ranks.values() if r.finished is not None]
    offered = next((f for f in reports if f.subtest_space), None)
    if offered is None:
        return ""  # no run_subtests call (or no rank got that far)
    pairs = ", ".join(f"{k}={v}" for k, v in info.subtest_filter)
    missing = [
        f"no subtest has the key {key!r}"
        if key not in dict(offered.subtest_space)
        else f"no subtest has {key}={value}"
        for (key, value), hit in zip(info.subtest_filter, offered.filter_hits)
        if not hit
    ] or ["no subtest has all of them together"]
    keys = "; ".join(f"{k}={', '.join(v)}" for k, v in offered.subtest_space)
    deselected = final.ranks[min(final.ranks)].deselected_total()
    return (
        f'{info.subtest_option} "{pairs}" selected none of the {deselected} subtests of this '
        f"test: {'; '.join(missing)}\nits subtests' keys and values: {keys}"
    )


def _leak_warnings(attempts: Sequence[Attempt]) -> list[str]:
    """One line per leaking rank (identical texts of several ranks once)."""
    by_text: dict[str, list[int]] = {}
    for attempt in attempts:
        for rank, leak in sorted(attempt.leaks.items()):
            by_text.setdefault(leak, []).append(rank)
    return [
        f"{', '.join(f'rank {r}' for r in ranks)}: after the test, {text}; "
        "the pool of ranks was replaced"
        for text, ranks in by_text.items()
    ]


def _merge_subtests(attempts: Sequence[Attempt]) -> dict[int, SubtestRecord]:
    merged: dict[int, SubtestRecord] = {}
    for attempt in attempts:
        merged.update(attempt.subtests)
    return dict(sorted(merged.items()))


def _any_deselected(attempts: Sequence[Attempt]) -> bool:
    return any(r.deselected_total() for a in attempts for r in a.ranks.values())


def _count(subtests: dict[int, SubtestRecord], attempts: Sequence[Attempt]) -> SubtestCounts:
    """``ran`` counts the subtests that ran (skipped ones did not)."""
    failed = sum(1 for r in subtests.values() if r.any_failed())
    skipped = sum(1 for r in subtests.values() if not r.any_failed() and r.all_skipped())
    deselected = sum(a.ranks[0].deselected_total() for a in attempts if 0 in a.ranks)
    ran = len(subtests) - skipped
    return SubtestCounts(ran=ran, failed=failed, skipped=skipped, deselected=deselected)


def _status(final: Attempt, counts: SubtestCounts | None) -> Status:
    if final.timed_out or (counts is not None and counts.failed):
        return Status.FAILED
    results = list(final.ranks.values())
    if any(r.death is not None or r.stopped_stack is not None for r in results):
        return Status.FAILED
    statuses = [r.finished.status for r in results if r.finished is not None]
    if any(s.is_failed() for s in statuses) or len(statuses) < len(results):
        return Status.FAILED
    if _inconsistent_skip(final):
        return Status.FAILED
    if any(s is Status.SKIPPED for s in statuses):
        return Status.SKIPPED
    if counts is not None and counts.skipped and not counts.ran:
        # Every subtest skipped: the test checked nothing, and reported as
        # passed it would hide the missing coverage in the counts.
        return Status.SKIPPED
    return Status.PASSED


def _skip_reason(final: Attempt, subtests: dict[int, SubtestRecord]) -> str:
    for result in final.ranks.values():
        if result.finished is not None and result.finished.status is Status.SKIPPED:
            return result.finished.text
    for record in subtests.values():
        for finished in record.finished.values():
            if finished.status is Status.SKIPPED:
                return f"every subtest skipped; subtest {record.index}: {finished.text}"
    return "skipped"


def _inconsistent_skip(final: Attempt) -> str:
    """Some ranks skipped the test while others ran it (or were still running)."""
    skipped = [
        r for r in final.ranks.values() if r.finished and r.finished.status is Status.SKIPPED
    ]
    others = [r for r in final.ranks.values() if r not in skipped]
    if not skipped or not others:
        return ""
    reason = skipped[0].finished.text if skipped[0].finished else ""
    names = ", ".join(f"rank {r.rank}" for r in skipped)
    rest = ", ".join(f"rank {r.rank}" for r in others)
    return f"inconsistent skip: {names} skipped ({reason}) but {rest} did not"


def _ended(final: Attempt) -> str:
    """How the ranks that finished ended the test: 'skipped' or 'failed'."""
    done = [r.finished.status for r in final.ranks.values() if r.finished is not None]
    return "skipped" if done and all(s is Status.SKIPPED for s in done) else "failed"


def _header(final: Attempt, info: RunInfo, counts: SubtestCounts | None) -> str:
    inconsistent = _inconsistent_skip(final)
    if inconsistent and not final.timed_out:
        return f"{inconsistent} ({info.describe()})"
    if final.timed_out:
        return (
            f"timed out after {info.timeout_s:g} s ({info.describe()}); stacks of every rank below"
        )
    failing = [r for r in final.ranks.values() if _rank_failed(r, counts)]
    dead = [r for r in failing if r.death is not None]
    parts = [f"rank {r.rank} {r.death}" for r in dead]
    others = [r for r in failing if r.death is None]
    if others:
        names = ", ".join(f"rank {r.rank}" for r in others)
        after = " afterwards" if dead else ""
        parts.append(f"{len(others)} of {info.world_size} ranks failed{after}: {names}")
    if parts:
        parts[-1] += f" ({info.describe()})"
    if counts is not None and counts.failed:
        parts.append(_counts_line(counts))
    return "\n".join(parts) if parts else f"test failed ({info.describe()})"


def _counts_line(counts: SubtestCounts) -> str:
    return (
        f"{counts.failed} of {counts.ran} subtests failed "
        f"({counts.ran} ran, {counts.failed} failed, {counts.skipped} skipped, "
        f"{counts.deselected} deselected)"
    )


def _rank_failed(result: RankResult, counts: SubtestCounts | None) -> bool:
    if result.death is not None:
        return True
    finished = result.finished
    if finished is None:
        return False
    if finished.status.is_failed() and finished.subtests_failed and counts is not None:
        return False  # the subtest section explains it
    return finished.status.is_failed()


def _failed_subtests_list(subtests: dict[int, SubtestRecord], info: RunInfo) -> str:
    """One line per failing subtest; each has a report of its own."""
    return "\n".join(
        f"subtest {record.index} [{record.config}] failed on {_where(record)}; "
        + info.rerun_hint(record.config)
        for record in subtests.values()
        if record.any_failed()
    )


def _where(record: SubtestRecord) -> str:
    failed_ranks = [r for r, f in sorted(record.finished.items()) if f.status.is_failed()]
    if failed_ranks:
        return ", ".join(f"rank {r}" for r in failed_ranks)
    if record.all_skipped() or record.inconsistent_skip():
        return "no rank (inconsistent skip)"
    return "no rank reported"


def _subtest_report(record: SubtestRecord, info: RunInfo) -> str:
    failed_ranks = [r for r, f in sorted(record.finished.items()) if f.status.is_failed()]
    lines = [f"=== subtest {record.index} [{record.config}]: failed on {_where(record)} ==="]
    lines.append(info.rerun_hint(record.config))
    lines.extend(_grouped_tracebacks(record, failed_ranks))
    if record.inconsistent_skip():
        lines.append(record.inconsistent_skip())
    lines.extend(record.notes)
    return "\n".join(lines) + "\n"


def _grouped_tracebacks(record: SubtestRecord, ranks: list[int]) -> list[str]:
    """Identical tracebacks from several ranks are printed once."""
    groups: dict[str, list[int]] = {}
    for rank in ranks:
        groups.setdefault(record.finished[rank].text, []).append(rank)
    lines = []
    for text, members in groups.items():
        label = ", ".join(f"rank {r}" for r in members)
        lines.append(f"--- {label} ---")
        lines.append(text.rstrip())
    return lines


def _rank_sections(final: Attempt, info: RunInfo, counts: SubtestCounts | None) -> list[str]:
    sections = [_death_section(r) for r in final.ranks.values() if r.death is not None]
    identical: dict[str, list[int]] = {}
    for result in final.ranks.values():
        finished = result.finished
        if (
            finished is not None
            and finished.status.is_failed()
            and _rank_failed(result, counts)
            and result.death is None
        ):
            identical.setdefault(finished.text, []).append(result.rank)
    for text, ranks in identical.items():
        label = ", ".join(f"rank {r}" for r in ranks)
        sections.append(f"=== {label}: {_exc_type(final, ranks[0])} ===\n{text.rstrip()}")
    for result in final.ranks.values():
        if (
            result.death is None
            and result.stopped_stack is not None
            and not _reported_before(result, final)
        ):
            sections.append(_stopped_section(result, final))
    return sections


def _exc_type(final: Attempt, rank: int) -> str:
    finished = final.ranks[rank].finished
    return finished.exc_type if finished is not None else "failed"


def _reported_before(result: RankResult, final: Attempt) -> bool:
    """A rank waiting at a subtest barrier it already reached is not news."""
    if final.restart_after is None:
        return False
    record = final.subtests.get(final.restart_after)
    return record is not None and result.rank in record.finished


def _death_section(result: RankResult) -> str:
    where = ""
    if result.current_subtest is not None:
        where = f" during subtest {result.current_subtest[0]} [{result.current_subtest[1]}]"
    tail = "\n".join(stacks.clean(result.output).splitlines()[-_DEATH_OUTPUT_LINES:])
    return f"=== rank {result.rank}: {result.death}{where} ===\nlast output of the rank:\n{tail}"


def _stopped_section(result: RankResult, final: Attempt) -> str:
    where = ""
    if result.current_subtest is not None:
        where = f" in subtest {result.current_subtest[0]} [{result.current_subtest[1]}]"
    if result.body_returned is not None:
        when = "at the deadline" if final.timed_out else f"when another rank {_ended(final)}"
        return (
            f"=== rank {result.rank}: the test body returned "
            f"({result.body_returned.value}), but its queued device work was still "
            f"unfinished {when} ===\n"
            "(a collective that another rank never joined? On CUDA, NCCL collectives "
            "such as all_reduce() return to Python before they complete.)"
        )
    if final.timed_out:
        why = f"still running{where} at the deadline"
    else:
        why = f"stopped{where} after another rank {_ended(final)}; it was blocked here"
    stack = stacks.clean(result.stopped_stack) if result.stopped_stack else ""
    stack = stack or "(no stack: it did not answer)"
    return f"=== rank {result.rank}: {why} ===\n{stack}"


def _outputs(attempts: Sequence[Attempt]) -> dict[int, str]:
    merged: dict[int, list[str]] = {}
    for attempt in attempts:
        for rank, result in attempt.ranks.items():
            if result.output:
                merged.setdefault(rank, []).append(result.output)
    return {rank: "".join(parts) for rank, parts in merged.items()}
