"""The rank side of one conformance check: the scenario under the implementation
under test, then under the reference, in the same ranks; the two traces
compared (``fsdptest.conformance.compare``), the allowed differences set aside
(``fsdptest.conformance.allowed``), and what is left raised.

Every rank compares its own two traces and fails with its own differences; the
harness reports each failing rank. Rank 0 prints one ``conformance-stats``
line (JSON: how each run ended, how many observations were compared, which
allowed differences applied), which the pytest process reads from the rank's
captured output for the session's summary.
"""

from __future__ import annotations

import json
from typing import NamedTuple

import torch.distributed as dist

from fsdptest.conformance.allowed import Normalised, normalisations, normalise
from fsdptest.conformance.compare import Difference, differences, tolerance
from fsdptest.conformance.execute import OpRecord, Run, Trace
from fsdptest.conformance.implementation import FsdpApi
from fsdptest.conformance.scenario import Scenario
from fsdptest.conformance.search import STATS_PREFIX
from harness.testcase import current_device

SHOWN = 4


class Verdict(NamedTuple):
    ours: Trace
    reference: Trace
    left: list[Difference]
    allowed: dict[str, int]  # name -> how many observations it rewrote


def run_both(
    scenario: Scenario, impl: str, reference: str, without: frozenset[str] = frozenset()
) -> Verdict:
    """The scenario under both implementations (names as ``--fsdp-impl`` takes
    them), the traces normalised (``fsdptest.conformance.allowed``, but for the
    entries named in ``without``) and compared."""
    device = current_device()
    ours_api, reference_api = FsdpApi(impl), FsdpApi(reference)
    ours = Run(scenario, ours_api, device).trace()
    theirs = Run(scenario, reference_api, device).trace()
    entries = normalisations(ours_api.implementation.module, reference_api.implementation.module)
    entries = [e for e in entries if e.name not in without]
    counts: dict[str, int] = {}
    ours, theirs = _normalised(ours, entries, counts), _normalised(theirs, entries, counts)
    return Verdict(ours, theirs, differences(ours, theirs, tolerance(scenario)), counts)


def _normalised(trace: Trace, entries: list[Normalised], counts: dict[str, int]) -> Trace:
    records = tuple(
        OpRecord(r.index, r.op, normalise(r.op, r.observed, entries, counts)) for r in trace.records
    )
    return trace._replace(records=records)


def check_scenario(scenario: Scenario, impl: str, reference: str) -> None:
    """Raises ``AssertionError`` with the differences left (see the module docstring)."""
    verdict = run_both(scenario, impl, reference)
    if dist.get_rank() == 0:
        print(STATS_PREFIX + json.dumps(stats(verdict)), flush=True)
    if verdict.left:
        raise AssertionError(report(verdict))


def stats(verdict: Verdict) -> dict[str, object]:
    return {
        "ours": verdict.ours.ended,
        "reference": verdict.reference.ended,
        "reference error": _error(verdict.reference),
        "ops": len(verdict.reference.records) - 1,
        "observations": sum(len(r.observed) for r in verdict.reference.records),
        "differences": len(verdict.left),
        "allowed": verdict.allowed,
    }


def _error(trace: Trace) -> object:
    """The exception that stopped the run, if one did (type, message)."""
    return trace.records[-1].observed.get("exception") if trace.records else None


def report(verdict: Verdict) -> str:
    shown = "\n".join(d.describe() for d in verdict.left[:SHOWN])
    more = len(verdict.left) - SHOWN
    tail = f"\n({more} more differences)" if more > 0 else ""
    return (
        f"rank {dist.get_rank()}: the FSDP under test ({verdict.ours.implementation}) differs "
        f"from the reference ({verdict.reference.implementation}):\n{shown}{tail}\n"
        f"under test: {verdict.ours.ended}; reference: {verdict.reference.ended}"
    )
