"""The pytest-process side of the FSDP2 searches: budgets, and the object that
sends drawn programs to the pooled ranks and turns a failure into a report with
the program and the line that replays it.

[Note: FSDP2 search budgets]
Two searches draw the same programs (``fsdptest.fsdp2search.drawing``):
``conformance`` (the implementation under test against the reference, torch's
by default) and ``parity`` (the implementation under test against the
replicated reference). Each runs per world size with the session's hypothesis
profile (``fsdptest.properties.search.budget_of``: ``ci`` derandomized, ``deep``
random with the database) and its own counts (``BUDGETS``: programs per world
size and search, calls per program); ``--conformance-scenarios N`` replaces the
count, as for the FSDP1 search, and ``--conformance-survey`` and
``--conformance-stats FILE`` work as there (every program checked, failures
listed at the end; one JSON line per program). The ``ci`` budget keeps both searches at the
three world sizes near a minute on two CPU cores. A test that sent no program
to the ranks fails (``Fsdp2Search.checked``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import NamedTuple

from hypothesis import given, settings

from fsdptest.conformance.search import SURVEY_SHOWN, first_difference
from fsdptest.fsdp2search.drawing import programs
from fsdptest.fsdp2search.program import Program
from fsdptest.properties.search import budget_of
from harness.rank_calls import CallOutcome, RankCalls
from harness.testcase import DistributedTest

PROGRAM_TIMEOUT_S = 150.0


class Budget(NamedTuple):
    programs: int  # per world size and search
    ops: int  # calls per program
    profile: str = "ci"


BUDGETS = {"ci": Budget(programs=3, ops=6), "deep": Budget(programs=700, ops=14, profile="deep")}


class ProgramFailed(AssertionError):
    """A program's runs differ; the message is the ranks' report, the program and
    how to replay it."""


class Fsdp2Search:
    """Runs drawn FSDP2 programs on the pooled ranks (see the module note)."""

    def __init__(
        self,
        calls: RankCalls,
        impl: str,
        reference: str,
        replay_test: str,
        budget: Budget,
        survey: bool = False,
        stats_file: Path | None = None,
    ) -> None:
        self.calls = calls
        self.impl = impl
        self.reference = reference
        self.replay_test = replay_test
        self.budget = budget
        self.survey = survey
        self.stats_file = stats_file
        self.checked = 0
        self.failures: list[str] = []  # a survey's failures: first difference and replay

    def search(self, ranks: type[DistributedTest], world_size: int, mode: str) -> None:
        """Draws ``budget.programs`` programs for ``world_size`` ranks and checks each."""
        chosen = settings(budget_of(self.budget.profile, None), max_examples=self.budget.programs)

        @settings(chosen)
        @given(programs(world_size, mode, self.budget.ops))
        def drawn(program: Program) -> None:
            self.check(ranks, program, mode)

        listed = len(self.failures)
        drawn()
        failures = self.failures[listed:]
        if failures:  # only in a survey: otherwise the first failure raised
            shown = "\n".join(failures[:SURVEY_SHOWN])
            raise ProgramFailed(
                f"{len(failures)} {mode} programs at world size {world_size} failed (a survey; "
                f"full reports: {self.stats_file or 'pass --conformance-stats PATH'}):\n{shown}"
            )

    def check(self, ranks: type[DistributedTest], program: Program, mode: str) -> None:
        """Runs ``ranks().<mode>(program=...)`` on the program's ranks; raises
        ``ProgramFailed`` unless every rank passed."""
        self.checked += 1
        started = time.monotonic()
        kwargs = {"program": program, "impl": self.impl}
        if mode == "conformance":
            kwargs["reference"] = self.reference
        outcome = self.calls.run(
            ranks, mode, program.world_size, timeout_s=PROGRAM_TIMEOUT_S, **kwargs
        )
        seconds = time.monotonic() - started
        if self.stats_file is not None:
            self._write_stats(program, mode, outcome, seconds)
        if not outcome.passed and self.survey:
            first = first_difference(outcome.report)
            self.failures.append(f"- {first}\n  {self.replay_command(program, mode)}")
        elif not outcome.passed:
            raise ProgramFailed(self.report(program, mode, outcome))

    def _write_stats(
        self, program: Program, mode: str, outcome: CallOutcome, seconds: float
    ) -> None:
        record: dict[str, object] = {
            "mode": mode,
            "world_size": program.world_size,
            "ops": len(program.ops),
            "seconds": round(seconds, 2),
            "passed": outcome.passed,
            "replay": self.replay_command(program, mode),
        }
        if not outcome.passed:
            record["report"] = outcome.report[:4000]
        assert self.stats_file is not None
        with self.stats_file.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def replay_command(self, program: Program, mode: str) -> str:
        return (
            f"python -m pytest '{self.replay_test}[{mode}]' --fsdp-impl {self.impl} "
            f"--fsdp-reference {self.reference} --replay-example {program.replay_id()}"
        )

    def report(self, program: Program, mode: str, outcome: CallOutcome) -> str:
        how = "skipped, which no drawn program may" if not outcome.failed else "failed"
        return (
            f"the FSDP2 program ({mode}) {how}:\n{program.describe()}\n"
            f"replay it with:\n  {self.replay_command(program, mode)}\n\n{outcome.report}"
        )
