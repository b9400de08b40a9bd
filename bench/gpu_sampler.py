"""Runs a command while sampling every GPU with nvidia-smi; prints the wall time and,
per GPU, how busy it was.

    python bench/gpu_sampler.py [--csv FILE] [--interval-ms 500] -- COMMAND...

Per GPU: the mean of nvidia-smi's ``utilization.gpu`` (the share of each sample
period in which a kernel ran), the share of samples in which it was above 0, and
the most memory in use. The command's exit status is returned. Leasing's own
view (how long each GPU was leased to a test) is ``bench/lease_cost.py
--journal``.
"""

from __future__ import annotations

import argparse
import csv
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

QUERY = "index,utilization.gpu,memory.used"


def summarise(path: Path) -> list[str]:
    util: dict[str, list[float]] = defaultdict(list)
    memory: dict[str, list[float]] = defaultdict(list)
    with open(path) as f:
        for row in csv.reader(f):
            if len(row) != 3:
                continue
            try:
                index, busy, used = row[0].strip(), float(row[1]), float(row[2])
            except ValueError:
                continue
            util[index].append(busy)
            memory[index].append(used)
    return [
        f"GPU {index}: {len(samples)} samples, utilization mean {statistics.mean(samples):.1f}%, "
        f"busy in {sum(1 for s in samples if s > 0) / len(samples):.0%} of samples, "
        f"memory used max {max(memory[index]):.0f} MiB"
        for index, samples in sorted(util.items())
    ]


def _start_sampler(path: Path, interval_ms: int) -> subprocess.Popen[bytes] | None:
    try:
        return subprocess.Popen(
            [
                "nvidia-smi",
                f"--query-gpu={QUERY}",
                "--format=csv,noheader,nounits",
                f"-lms={interval_ms}",
                f"--filename={path}",
            ]
        )
    except FileNotFoundError:
        print("gpu_sampler: no nvidia-smi here: the command runs unsampled")
        return None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--csv", type=Path, default=None)
    parser.add_argument("--interval-ms", type=int, default=500)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    opts = parser.parse_args()
    command = opts.command[1:] if opts.command[:1] == ["--"] else opts.command
    if not command:
        parser.error("no command")
    path = opts.csv or Path(tempfile.mkstemp(suffix=".csv")[1])
    path.write_text("")
    sampler = _start_sampler(path, opts.interval_ms)
    started = time.perf_counter()
    try:
        code = subprocess.call(command)
    finally:
        wall = time.perf_counter() - started
        if sampler is not None:
            sampler.send_signal(signal.SIGINT)
            sampler.wait(10)
    print(f"gpu_sampler: {' '.join(command)}: exit {code}, wall {wall:.1f} s")
    for line in summarise(path):
        print(f"gpu_sampler: {line}")
    return code


if __name__ == "__main__":
    sys.exit(main())
