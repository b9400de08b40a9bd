"""What leasing GPUs costs, and how busy leasing keeps them.

    python bench/lease_cost.py                    # round trip and contention, fake GPU ids
    python bench/lease_cost.py --in-situ          # also 50 trivial 2-rank tests, leased or not
    python bench/lease_cost.py --journal DIR      # summarise the lease journal of a run

1. Round trip: one process acquires and releases k of G GPUs, uncontended
   (``harness._controller.leases``; a lock file per GPU plus the allocator lock).
2. Contention: P processes each take L leases of 1 or 2 of G fake GPUs (drawn
   from a seeded generator), holding each for H ms. Printed: the wall time
   against the ideal (all GPU-time packed on G GPUs), each GPU's leased fraction,
   the waits, the leases per process.
3. ``--in-situ``: ``bench/trivial_tests.py`` (50 trivial 2-rank tests) with CPU
   ranks, once without GPUs and once leasing two fake GPUs per test
   (``harness_fake_gpus``): the median per-test time of each.
4. ``--journal DIR``: the same summary for the journal of a session run with
   ``--gpu-lease-dir DIR`` (on a GPU machine: how much of the run each GPU was
   leased to a test; ``bench/gpu_sampler.py`` measures the kernels' share).
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "harness" / "_controller"))  # the module alone: no torch import

from leases import GpuLeases, read_journal  # noqa: E402


def round_trip(gpus: int, count: int, iters: int) -> float:
    """Median microseconds of one acquire + release."""
    with tempfile.TemporaryDirectory() as tmp:
        leases = GpuLeases(Path(tmp), tuple(f"g{i}" for i in range(gpus)))
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            leases.acquire(count, "bench")
            leases.release()
            times.append(time.perf_counter() - start)
        leases.close()
    return statistics.median(times) * 1e6


WORKER = """
import random, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from leases import GpuLeases
directory, gpus, leases_n, hold_s, seed, go = sys.argv[2:8]
leases = GpuLeases(Path(directory), tuple(f"g{i}" for i in range(int(gpus))))
rng = random.Random(int(seed))
print("ready", flush=True)
while not Path(go).exists():
    time.sleep(0.001)
for i in range(int(leases_n)):
    with leases.leased(rng.choice((1, 2)), f"{seed}-{i}"):
        time.sleep(float(hold_s))
"""


def contention(processes: int, gpus: int, leases_n: int, hold_ms: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        go = Path(tmp) / "go"
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    WORKER,
                    str(ROOT / "harness" / "_controller"),
                    tmp,
                    str(gpus),
                    str(leases_n),
                    str(hold_ms / 1e3),
                    str(seed),
                    str(go),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            for seed in range(processes)
        ]
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        go.touch()
        for proc in procs:
            proc.wait()
        print(
            f"contention: {processes} processes x {leases_n} leases of 1 or 2 of {gpus} "
            f"fake GPUs, each held {hold_ms:g} ms"
        )
        summarise(read_journal(Path(tmp)), gpus=tuple(f"g{i}" for i in range(gpus)))


def summarise(journal: list[dict[str, object]], gpus: tuple[str, ...] = ()) -> None:
    if not journal:
        print("  (no leases in the journal)")
        return
    start = min(float(e["acquired"]) - float(e["waited_s"]) for e in journal)  # type: ignore[arg-type]
    end = max(float(e["released"]) for e in journal)  # type: ignore[arg-type]
    span = end - start
    held = {gpu: 0.0 for gpu in gpus}
    for entry in journal:
        for gpu in entry["gpus"]:  # type: ignore[attr-defined]
            held[gpu] = held.get(gpu, 0.0) + float(entry["released"]) - float(entry["acquired"])  # type: ignore[arg-type]
    ideal = sum(held.values()) / max(1, len(held))
    waits = sorted(float(e["waited_s"]) for e in journal)  # type: ignore[arg-type]
    per_pid: dict[object, int] = {}
    for entry in journal:
        per_pid[entry["pid"]] = per_pid.get(entry["pid"], 0) + 1
    print(
        f"  {len(journal)} leases in {span:.2f} s (GPU-time packed perfectly: {ideal:.2f} s, "
        f"{ideal / span:.0%} of the wall)"
    )
    print(
        "  leased (summed over a GPU's slots, so over 100 % when tests shared it): "
        + ", ".join(f"{g} {t / span:.0%}" for g, t in sorted(held.items()))
    )
    print(
        "  most tests on a GPU at once: "
        + ", ".join(f"{g} {_most_at_once(journal, g)}" for g in sorted(held))
    )
    print(
        f"  waits: median {statistics.median(waits) * 1e3:.1f} ms, "
        f"p90 {waits[int(0.9 * (len(waits) - 1))] * 1e3:.1f} ms, max {waits[-1] * 1e3:.1f} ms"
    )
    print(f"  leases per process: {sorted(per_pid.values())}")


def _most_at_once(journal: list[dict[str, object]], gpu: str) -> int:
    events = sorted(
        (float(e[key]), change)  # type: ignore[arg-type]
        for e in journal
        if gpu in e["gpus"]  # type: ignore[operator]
        for key, change in (("acquired", 1), ("released", -1))
    )
    held = most = 0
    for _, change in events:  # a release sorts before an acquisition at one instant
        held += change
        most = max(most, held)
    return most


def in_situ() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from harness_overhead import run_pytest

    common = ["bench/trivial_tests.py"]
    for name, extra in (
        ("cpu, no lease", ["--device", "cpu"]),
        ("cpu ranks leasing 2 fake GPUs", ["--device", "auto", "-o", "harness_fake_gpus=g0,g1"]),
    ):
        wall, times = run_pytest([*common, *extra])
        print(
            f"in situ, {name}: {len(times)} tests, wall {wall:.1f} s, "
            f"median per test {statistics.median(times[1:]) * 1e3:.1f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--leases", type=int, default=50)
    parser.add_argument("--hold-ms", type=float, default=20.0)
    parser.add_argument("--in-situ", action="store_true")
    parser.add_argument("--journal", type=Path, help="summarise this lease directory's journal")
    opts = parser.parse_args()
    if opts.journal is not None:
        print(f"journal {opts.journal}:")
        summarise(read_journal(opts.journal))
        return
    random.seed(0)
    for count in (1, 2):
        print(
            f"round trip, {count} of {opts.gpus} GPUs, uncontended: "
            f"{round_trip(opts.gpus, count, opts.iters):.1f} us median"
        )
    contention(opts.processes, opts.gpus, opts.leases, opts.hold_ms)
    if opts.in_situ:
        in_situ()


if __name__ == "__main__":
    main()
