"""Per-test overhead of the harness: 50 trivial 2-rank tests, pooled and fresh.

Usage: python bench/harness_overhead.py [--device cpu|cuda] [--torch-baseline]
(``--torch-baseline`` needs numpy, which torch's test utilities import:
``pip install -e ".[bench]"``.)

Prints, for each mode, the suite's wall time and the median per-test duration
(setup + call + teardown, as pytest reports it; the tests do one all-reduce, so
this is the harness's overhead). The first test of the pooled run, which starts
the pool, is reported separately. ``--torch-baseline`` also times torch's
spawn-per-test MultiProcessTestCase on the same tests.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_pytest(args: list[str]) -> tuple[float, list[float]]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        start = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                f"--junitxml={report}",
                *args,
            ],
            cwd=ROOT,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        wall = time.perf_counter() - start
        times = [float(case.get("time", 0)) for case in ET.parse(report).iter("testcase")]
    return wall, times


def describe(name: str, wall: float, times: list[float], skip_first: bool) -> str:
    body = times[1:] if skip_first else times
    first = f", first test {times[0]:.2f} s (starts the pool)" if skip_first else ""
    return (
        f"{name}: {len(times)} tests, suite wall {wall:.1f} s, "
        f"median per test {statistics.median(body):.4f} s{first}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--torch-baseline", action="store_true")
    opts = parser.parse_args()
    if opts.torch_baseline and importlib.util.find_spec("numpy") is None:
        parser.error(
            "--torch-baseline needs numpy (torch's test utilities import it): "
            'pip install -e ".[bench]"'
        )
    common = ["bench/trivial_tests.py", "--device", opts.device]
    wall, times = run_pytest(common)
    print(describe("pooled", wall, times, skip_first=True))
    wall, times = run_pytest([*common, "--fresh-pool"])
    print(describe("fresh pool per test", wall, times, skip_first=False))
    if opts.torch_baseline:
        wall, times = run_pytest(["bench/torch_baseline_tests.py"])
        print(describe("torch MultiProcessTestCase", wall, times, skip_first=False))


if __name__ == "__main__":
    main()
