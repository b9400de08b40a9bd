"""The pytest-process side of the conformance search: budgets, and the object
that runs drawn programs on the pooled ranks and turns a failure into a report
with the minimal scenario and the line that replays it.

[Note: Conformance budgets]
The search uses the budget of the session's hypothesis profile (``ci`` by
default, ``deep`` with ``--hypothesis-profile deep``; ``fsdptest.properties.search``'s
``budget_of``: no deadline, derandomized ``ci``), never the profile loaded
globally, with its own counts: ``BUDGETS`` gives the scenarios per world size and the
API calls drawn per program (``stateful_step_count``: rules; a training step
is one rule of several calls). ``ci`` is derandomized (every run draws the same
scenarios) and must stay under three minutes on two CPU cores for the three
world sizes together; ``deep`` draws new ones every run and keeps failing ones
in the hypothesis database. ``--conformance-scenarios N`` replaces either
count (a bounded deep run). A failure is shrunk for up to ``SHRINK_SECONDS``
(hypothesis's own limit, five minutes, cut the shrinking of the planted bugs
short on a loaded machine). Each scenario runs on the ranks as one call with
its own deadline (``SCENARIO_TIMEOUT_S``): a hang costs one scenario's time.
The deadline is well above what the longest drawn programs take on a loaded
machine: a 57-call program at two ranks took 62 s under a load average of 22
on two cores, and at 60 s two such scenarios of a deep run timed out without
any rank being stuck.

[Note: What the pytest process does]
Only this module, ``scenario``, ``drawing`` and ``allowed`` are imported in the
pytest process; none imports an FSDP implementation (implementations are
resolved to module names without importing them). The ranks import them
(``check``, ``execute``). The pytest process draws, pickles one scenario per
call, and reads the verdict and rank 0's statistics line back.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from fsdptest.conformance.drawing import machine_for
from fsdptest.conformance.scenario import Scenario
from fsdptest.conformance.target import Target
from fsdptest.implementations import resolve
from fsdptest.properties.search import budget_of
from harness.rank_calls import CallOutcome, RankCalls
from harness.testcase import DistributedTest

STATS_PREFIX = "conformance-stats "  # the line rank 0 prints (fsdptest.conformance.check)
SCENARIO_TIMEOUT_S = 150.0


# Hypothesis stops shrinking after five minutes ("making very slow progress"); one
# scenario is a rank call of seconds on a loaded machine, and a drawn program of
# 20 calls needs a few hundred of them to shrink (see [Note: Conformance budgets]).
SHRINK_SECONDS = 1800


@contextlib.contextmanager
def _shrinking_for(seconds: int) -> Iterator[None]:
    """Hypothesis's shrinking limit raised to ``seconds`` while inside (its
    engine's module constant, where this version has one)."""
    from hypothesis.internal.conjecture import engine

    before = getattr(engine, "MAX_SHRINKING_SECONDS", None)
    if before is None:
        yield
        return
    engine.MAX_SHRINKING_SECONDS = max(before, seconds)
    try:
        yield
    finally:
        engine.MAX_SHRINKING_SECONDS = before


class Budget(NamedTuple):
    scenarios: int  # per world size
    steps: int  # rules per program
    profile: str = "ci"  # the hypothesis profile whose settings the search uses


BUDGETS = {
    "ci": Budget(scenarios=12, steps=10, profile="ci"),
    "deep": Budget(scenarios=700, steps=20, profile="deep"),
}


class ScenarioFailed(AssertionError):
    """A scenario's observations differ; the message is the ranks' report, the
    scenario and how to replay it."""


class Tally:
    """What the checks of a session did (read from rank 0's statistics lines)."""

    def __init__(self) -> None:
        self.scenarios = 0
        self.failed = 0
        self.endings: Counter[str] = Counter()
        self.ops = 0
        self.observations = 0
        self.allowed: Counter[str] = Counter()

    def add(self, outcome: CallOutcome) -> dict[str, object] | None:
        self.scenarios += 1
        self.failed += int(not outcome.passed)
        line = next(
            (
                text[len(STATS_PREFIX) :]
                for text in outcome.outputs.get(0, "").splitlines()
                if text.startswith(STATS_PREFIX)
            ),
            None,
        )
        if line is None:
            return None
        stats = json.loads(line)
        self.endings[_ending(str(stats["reference"]))] += 1
        self.ops += int(stats["ops"])  # type: ignore[call-overload]
        self.observations += int(stats["observations"])  # type: ignore[call-overload]
        self.allowed.update(stats["allowed"])  # type: ignore[arg-type]
        return stats

    def summary(self) -> str:
        endings = ", ".join(f"{n} {e}" for e, n in self.endings.most_common())
        allowed = ", ".join(f"{name} x{n}" for name, n in sorted(self.allowed.items())) or "none"
        return (
            f"conformance: {self.scenarios} scenarios checked, {self.failed} failed; "
            f"{self.ops} API calls, {self.observations} observations compared; "
            f"reference runs: {endings or 'none'}; allowed differences applied: {allowed}"
        )


def _ending(text: str) -> str:
    """``completed``, or the exception that stopped the run (its op index left out)."""
    if text.startswith("stopped at op"):
        return "stopped by " + text.split(" by ", 1)[-1]
    return text


SURVEY_SHOWN = 20


def first_difference(report: str) -> str:
    """The line of a failed scenario's (or FSDP2 program's) report that names its
    first difference (``op N (...), what``, or ``fully_shard`` itself), else its
    first line."""
    lines = [line.strip() for line in report.splitlines() if line.strip()]
    for line in lines:
        if line.startswith(("op ", "fully_shard")) or " skipped" in line:
            return line[:300]
    return lines[0][:300] if lines else "(no report)"


class ConformanceSearch:
    """Runs drawn scenarios on the pooled ranks (see the module notes)."""

    def __init__(
        self,
        calls: RankCalls,
        impl: str,
        reference: str,
        replay_test: str,
        budget: Budget,
        tally: Tally,
        stats_file: Path | None = None,
        survey: bool = False,
    ) -> None:
        self.calls = calls
        self.impl = impl
        self.reference = reference
        self.replay_test = replay_test
        self.budget = budget
        self.tally = tally
        self.stats_file = stats_file
        self.survey = survey
        self.surveyed_failures: list[str] = []  # a survey's failures, one line and a replay each

    def target(self, world_size: int) -> Target:
        device_type = self.calls.device_type(world_size) or "cpu"
        return Target(
            resolve(self.impl).module, resolve(self.reference).module, device_type, world_size
        )

    def search(self, ranks: type[DistributedTest], world_size: int) -> None:
        """Draws ``budget.scenarios`` programs for ``world_size`` ranks and checks each."""
        machine = machine_for(self.target(world_size), lambda s: self.check(ranks, s))
        chosen = settings(
            budget_of(self.budget.profile, None),
            max_examples=self.budget.scenarios,
            stateful_step_count=self.budget.steps,
        )
        listed = len(self.surveyed_failures)
        with _shrinking_for(SHRINK_SECONDS):
            run_state_machine_as_test(machine, settings=chosen)
        failures = self.surveyed_failures[listed:]
        if failures:  # only in a survey: otherwise the first failure raised
            raise ScenarioFailed(self._survey_report(failures, world_size))

    def _survey_report(self, failures: list[str], world_size: int) -> str:
        """Each failed scenario of the survey: its first difference and its replay line
        (the first 20; the full reports go to ``--conformance-stats``)."""
        where = self.stats_file or "pass --conformance-stats PATH"
        more = len(failures) - SURVEY_SHOWN
        return "\n".join(
            [
                f"{len(failures)} scenarios at world size {world_size} failed (a survey; full "
                f"reports: {where}):",
                *failures[:SURVEY_SHOWN],
                *([f"... and {more} more"] if more > 0 else []),
            ]
        )

    def check(self, ranks: type[DistributedTest], scenario: Scenario) -> None:
        """Runs ``ranks().check(...)`` with the scenario on its ranks; raises
        ``ScenarioFailed`` unless every rank passed."""
        started = time.monotonic()
        outcome = self.calls.run(
            ranks,
            "check",
            scenario.world_size,
            timeout_s=SCENARIO_TIMEOUT_S,
            scenario=scenario,
            impl=self.impl,
            reference=self.reference,
        )
        stats = self.tally.add(outcome)
        if self.stats_file is not None:
            self._write_stats(scenario, outcome, stats, time.monotonic() - started)
        if not outcome.passed and self.survey:
            first = first_difference(outcome.report)
            self.surveyed_failures.append(f"- {first}\n  {self.replay_command(scenario)}")
        elif not outcome.passed:
            raise ScenarioFailed(self.report(scenario, outcome))

    def _write_stats(
        self,
        scenario: Scenario,
        outcome: CallOutcome,
        stats: dict[str, object] | None,
        seconds: float,
    ) -> None:
        record: dict[str, object] = {
            "world_size": scenario.world_size,
            "seconds": round(seconds, 2),
            "passed": outcome.passed,
            "stats": stats,
            "replay": self.replay_command(scenario),
        }
        if not outcome.passed:
            record["report"] = outcome.report[:4000]
        assert self.stats_file is not None
        with self.stats_file.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def replay_command(self, scenario: Scenario) -> str:
        return (
            f"python -m pytest '{self.replay_test}' --fsdp-impl {self.impl} "
            f"--fsdp-reference {self.reference} --replay-example {scenario.replay_id()}"
        )

    def report(self, scenario: Scenario, outcome: CallOutcome) -> str:
        how = "skipped, which no drawn scenario may" if not outcome.failed else "failed"
        return (
            f"the scenario {how}:\n{scenario.describe()}\n"
            f"replay it with:\n  {self.replay_command(scenario)}\n\n{outcome.report}"
        )
