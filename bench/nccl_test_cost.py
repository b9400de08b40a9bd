"""Where a distributed test's time goes on NCCL (or gloo): unit costs, and a suite's profile.

    python bench/nccl_test_cost.py micro [--backend nccl] [--iters 20] [--no-device-id]
    python bench/nccl_test_cost.py suite DIR PATH... [-- PYTEST ARGS]
    python bench/nccl_test_cost.py report DIR

``micro``: two ranks (one per GPU on NCCL) time, each ``--iters`` times, what the
harness and the suites do around a test: ``new_group`` of both ranks and of one
rank each, the first and a later all-reduce on it, ``destroy_process_group`` of
it, ``new_subgroups``, ``barrier``, ``torch.cuda.synchronize``,
``torch.cuda.empty_cache`` after a 64 MiB allocation, ``gc.collect``. Medians in
ms, rank 0's. ``--no-device-id`` leaves the default group unbound (new groups
then connect lazily, at their first collective, instead of splitting the default
communicator at once).

``suite``: runs pytest on PATHs with ``--rank-profile DIR/prof`` and
``--junitxml DIR/junit.xml`` (the GPUs are leased as in any run: add ``-n 2``
etc. after ``--``), then ``report``.

``report``: from the profiles, the ranks' time per test split into the body and
the harness's return to the baseline, and the time inside what a test (or
FSDP) calls: group creation and destruction, barriers, synchronisation, FSDP
construction, garbage collection (the rows nest: FSDP construction includes the
groups it creates); the pool starts; the tests that cost most; and, from the
JUnit file, how much of each test's wall time the ranks account for.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pstats
import re
import socket
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# -- micro ----------------------------------------------------------------------------


def _micro_rank(rank: int, port: int, backend: str, iters: int, bind: bool, out: object) -> None:
    import torch
    import torch.distributed as dist

    cuda = backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    started = time.perf_counter()
    if cuda:
        torch.cuda.set_device(device)
        torch.ones(1, device=device)
    cuda_init = time.perf_counter() - started
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, wait_for_workers=False)
    started = time.perf_counter()
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
        device_id=device if cuda and bind else None,
    )
    init_s = time.perf_counter() - started
    t = torch.ones(1, device=device)
    dist.all_reduce(t)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    times: dict[str, list[float]] = defaultdict(list)

    def timed(name: str, fn: Callable[[], object]) -> object:
        sync()
        start = time.perf_counter()
        result = fn()
        sync()
        times[name].append((time.perf_counter() - start) * 1e3)
        return result

    for _ in range(iters):
        both = timed("new_group(both ranks)", lambda: dist.new_group([0, 1]))
        timed("first all_reduce on it", lambda g=both: dist.all_reduce(t, group=g))
        timed("later all_reduce on it", lambda g=both: dist.all_reduce(t, group=g))
        timed("destroy_process_group(it)", lambda g=both: dist.destroy_process_group(g))
        own = timed("new_group([own rank])", lambda: dist.new_group([rank]))
        timed("first all_reduce on [own rank]", lambda g=own: dist.all_reduce(t, group=g))
        timed("destroy [own rank]", lambda g=own: dist.destroy_process_group(g))
        sub = timed("new_subgroups(1)", lambda: dist.new_subgroups(1))
        timed(
            "destroy new_subgroups' 2 groups",
            lambda s=sub: [dist.destroy_process_group(g) for g in s[1]],
        )
        timed("barrier()", dist.barrier)
        timed("all_reduce on the default group", lambda: dist.all_reduce(t))
        timed("torch.cuda.synchronize()", sync)
        if cuda:
            block = torch.empty(64 << 20, dtype=torch.uint8, device=device)
            del block
            timed("torch.cuda.empty_cache() (64 MiB cached)", torch.cuda.empty_cache)
        timed("gc.collect()", gc.collect)
    if rank == 0:
        out.put((cuda_init, init_s, {k: statistics.median(v) for k, v in times.items()}))  # type: ignore[attr-defined]
    dist.destroy_process_group()


def micro(backend: str, iters: int, bind: bool) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(
        _micro_rank, args=(port, backend, iters, bind, out), nprocs=2, start_method="spawn"
    )
    cuda_init, init_s, medians = out.get()
    bound = "bound to the device (device_id)" if bind else "not bound (no device_id)"
    print(f"micro, {backend}, default group {bound}, {iters} iterations, rank 0, median ms:")
    if backend == "nccl":
        print(f"  CUDA init (first tensor): {cuda_init * 1e3:.1f} (once per rank)")
    print(f"  init_process_group: {init_s * 1e3:.1f} (once per pool)")
    for name, ms in medians.items():
        print(f"  {name}: {ms:.2f}")


# -- suite and report ----------------------------------------------------------------

# (what, file ending, function): cumulative time of these functions, per rank
CATEGORIES: tuple[tuple[str, str, str], ...] = (
    ("rank's time on the test (run_test)", "harness/_rank/runner.py", "run_test"),
    ("  test body with setUp/tearDown", "harness/_rank/runner.py", "_call_test"),
    ("    run_subtests: groups released after each", "harness/_rank/isolation.py", "release_since"),
    ("  back to the baseline (sync, destroy, restore)", "harness/_rank/runner.py", "_settle"),
    ("  leak check (gc, threads, fds, memory)", "harness/_rank/isolation.py", "check"),
    ("  empty_cache", "torch/cuda/memory.py", "empty_cache"),
    ("  import of the test module", "harness/_rank/importer.py", "import_test_module"),
    ("new_group", "torch/distributed/distributed_c10d.py", "new_group"),
    ("new_subgroups", "torch/distributed/distributed_c10d.py", "new_subgroups"),
    ("init_device_mesh", "torch/distributed/device_mesh.py", "init_device_mesh"),
    ("destroy_process_group", "torch/distributed/distributed_c10d.py", "destroy_process_group"),
    ("barrier", "torch/distributed/distributed_c10d.py", "barrier"),
    ("torch.cuda.synchronize", "torch/cuda/__init__.py", "synchronize"),
    ("our FSDP's __init__", "fsdp/fully_sharded_data_parallel.py", "__init__"),
    ("torch's FSDP1 __init__", "torch/distributed/fsdp/fully_sharded_data_parallel.py", "__init__"),
    ("gc.collect", "~", "<built-in method gc.collect>"),
    ("dynamo reset", "harness/_rank/isolation.py", "_reset_dynamo"),
)
_PROFILE = re.compile(r"^(?P<test>.*)\.rank(?P<rank>\d+)\.\d+\.prof$")


def suite(directory: Path, paths: list[str], extra: list[str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pytest",
        *paths,
        "-p",
        "no:cacheprovider",
        "-q",
        f"--rank-profile={directory / 'prof'}",
        f"--junitxml={directory / 'junit.xml'}",
        *extra,
    ]
    started = time.perf_counter()
    code = subprocess.call(command, cwd=ROOT)
    wall = time.perf_counter() - started
    (directory / "wall.json").write_text(json.dumps({"wall_s": wall, "exit": code}))
    print(f"pytest exited {code} after {wall:.1f} s")
    report(directory)


def _load(directory: Path) -> dict[int, dict[str, pstats.Stats]]:
    by_rank: dict[int, dict[str, pstats.Stats]] = defaultdict(dict)
    for path in sorted((directory / "prof").glob("*.prof")):
        match = _PROFILE.match(path.name)
        if match is None:
            continue
        stats = pstats.Stats(str(path))
        test = match["test"]
        rank = int(match["rank"])
        if test in by_rank[rank]:
            by_rank[rank][test].add(stats)  # a test resumed on a new pool
        else:
            by_rank[rank][test] = stats
    return by_rank


def _cumulative(stats: pstats.Stats, ending: str, function: str) -> tuple[float, int]:
    total, calls = 0.0, 0
    for (filename, _, name), (_, nc, _, ct, _) in stats.stats.items():  # type: ignore[attr-defined]
        if name == function and (filename == ending or filename.endswith(ending)):
            total += ct
            calls += nc
    return total, calls


def report(directory: Path) -> None:
    by_rank = _load(directory)
    if not by_rank:
        print(f"no profiles under {directory / 'prof'}")
        return
    for rank in sorted(by_rank):
        tests = by_rank[rank]
        print(f"\nrank {rank}: {len(tests)} tests profiled; seconds summed over them (calls)")
        for what, ending, function in CATEGORIES:
            seconds, calls = 0.0, 0
            for stats in tests.values():
                s, c = _cumulative(stats, ending, function)
                seconds += s
                calls += c
            if calls:
                print(
                    f"  {what:<52} {seconds:9.2f} s  ({calls} calls, {seconds / len(tests) * 1e3:.1f} ms per test)"
                )
        ranked = sorted(
            ((_cumulative(s, *CATEGORIES[0][1:])[0], t) for t, s in tests.items()), reverse=True
        )
        print("  the tests that cost this rank most:")
        for seconds, test in ranked[:10]:
            print(f"    {seconds:7.2f} s  {test}")
    _pool_starts(directory)
    _junit(directory, by_rank.get(0, {}))


def _pool_starts(directory: Path) -> None:
    path = directory / "prof" / "pool-starts.jsonl"
    if not path.exists():
        return
    starts = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    seconds = [float(s["seconds"]) for s in starts]
    by_kind: dict[str, list[float]] = defaultdict(list)
    for start in starts:
        world, device = start["key"][0], start["key"][1]
        by_kind[f"{world} ranks on {device}"].append(float(start["seconds"]))
    print(
        f"\npool starts: {len(starts)}, {sum(seconds):.1f} s in all; "
        + ", ".join(
            f"{k}: {len(v)} (median {statistics.median(v):.2f} s)"
            for k, v in sorted(by_kind.items())
        )
    )


def _junit(directory: Path, rank0: dict[str, pstats.Stats]) -> None:
    path = directory / "junit.xml"
    if not path.exists():
        return
    cases = list(ET.parse(path).iter("testcase"))
    total = sum(float(c.get("time", 0)) for c in cases)
    ranks = sum(_cumulative(s, *CATEGORIES[0][1:])[0] for s in rank0.values())
    wall = ""
    if (directory / "wall.json").exists():
        wall = f", session wall {json.loads((directory / 'wall.json').read_text())['wall_s']:.1f} s"
    print(
        f"junit: {len(cases)} tests, {total:.1f} s of test time (setup + call + teardown, "
        f"summed over workers){wall}; rank 0 spent {ranks:.1f} s in run_test: the rest "
        f"({total - ranks:.1f} s) is dispatch, lease waits, pool starts and pytest"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("micro")
    m.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    m.add_argument("--iters", type=int, default=20)
    m.add_argument("--no-device-id", action="store_true")
    s = sub.add_parser("suite")
    s.add_argument("dir", type=Path)
    s.add_argument("paths", nargs="+")
    r = sub.add_parser("report")
    r.add_argument("dir", type=Path)
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    opts = parser.parse_args(argv)
    if opts.mode == "micro":
        micro(opts.backend, opts.iters, not opts.no_device_id)
    elif opts.mode == "suite":
        suite(opts.dir, opts.paths, extra)
    else:
        report(opts.dir)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
