"""How much of the communication in a chrome trace of ``bench/fsdp_step.py
--profile`` runs hidden behind computation.

Usage::

    python bench/trace_overlap.py trace-local-rank0.json[.gz] [more traces ...]

[Note: Hidden communication]
A trace's GPU kernels are split into communication (NCCL kernels) and
computation (every other kernel). For each collective kind (all-gather,
reduce-scatter, all-reduce) the script sums the time its kernels run, and the
part of that time during which some computation kernel runs on another stream
at the same moment; "hidden" is the second over the first. Memory copies and
sets are not counted as computation. An all-gather that is hidden overlapped
the previous unit's compute (prefetch); a reduce-scatter that is hidden
overlapped the backward of the next unit. The figure is per rank and for the
traced steps only. An NCCL kernel starts when its rank issues it and ends when
every rank has taken part, so its time includes waiting for the other ranks:
the rank that arrives first shows more communication, hidden or not.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

KINDS = ("AllGather", "ReduceScatter", "AllReduce")


@dataclass(frozen=True)
class Interval:
    start: float
    end: float


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        trace = json.load(handle)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def merged(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals."""
    result: list[Interval] = []
    for item in sorted(intervals, key=lambda i: i.start):
        if result and item.start <= result[-1].end:
            last = result[-1]
            result[-1] = Interval(last.start, max(last.end, item.end))
        else:
            result.append(item)
    return result


def covered(interval: Interval, union: list[Interval]) -> float:
    """How long ``interval`` overlaps the disjoint intervals ``union``."""
    total = 0.0
    for other in union:
        if other.start >= interval.end:
            break
        total += max(0.0, min(interval.end, other.end) - max(interval.start, other.start))
    return total


def kind_of(name: str) -> str | None:
    if "nccl" not in name.lower():
        return None
    return next((kind for kind in KINDS if kind in name), "other")


def hidden_fractions(events: list[dict]) -> dict[str, tuple[float, float]]:
    """Per collective kind: (kernel time in ms, fraction of it hidden)."""
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    compute = merged(
        Interval(e["ts"], e["ts"] + e["dur"]) for e in kernels if kind_of(e["name"]) is None
    )
    totals: dict[str, list[float]] = {}
    for event in kernels:
        kind = kind_of(event["name"])
        if kind is None:
            continue
        interval = Interval(event["ts"], event["ts"] + event["dur"])
        entry = totals.setdefault(kind, [0.0, 0.0])
        entry[0] += event["dur"]
        entry[1] += covered(interval, compute)
    return {
        kind: (busy / 1000.0, hidden / busy if busy else 0.0)
        for kind, (busy, hidden) in sorted(totals.items())
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("traces", nargs="+", type=Path)
    opts = parser.parse_args()
    for path in opts.traces:
        fractions = hidden_fractions(load_events(path))
        busy = sum(ms for ms, _ in fractions.values())
        hidden = sum(ms * f for ms, f in fractions.values())
        print(f"{path.name}: communication {busy:.1f} ms, {hidden / busy:.0%} hidden")
        for kind, (ms, fraction) in fractions.items():
            print(f"  {kind:>13}: {ms:8.1f} ms, {fraction:.0%} hidden")


if __name__ == "__main__":
    main()
