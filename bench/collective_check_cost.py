"""What ``--check-collectives`` (torch's TORCH_DISTRIBUTED_DEBUG=DETAIL checker) costs
per collective: two ranks time the same all-reduces with and without it.

    python bench/collective_check_cost.py [--world-size 2] [--iters 500] [--numel 1024]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(
    rank: int,
    world_size: int,
    store: str,
    debug: str,
    iters: int,
    numel: int,
    out: dict[str, float],
) -> None:
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = debug
    dist.set_debug_level_from_env()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    tensor = torch.ones(numel)
    for _ in range(20):
        dist.all_reduce(tensor)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    if rank == 0:
        out[debug] = statistics.median(times) * 1e6
    dist.destroy_process_group()


def measure(debug: str, world_size: int, iters: int, numel: int) -> float:
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(
            _rank, args=(world_size, f"{tmp}/store", debug, iters, numel, out), nprocs=world_size
        )
        return float(out[debug])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--numel", type=int, default=1024)
    args = parser.parse_args()
    plain = measure("OFF", args.world_size, args.iters, args.numel)
    checked = measure("DETAIL", args.world_size, args.iters, args.numel)
    print(
        f"all_reduce of {args.numel} floats, {args.world_size} ranks, gloo, median of "
        f"{args.iters}: plain {plain:.0f} us, checked {checked:.0f} us, "
        f"+{checked - plain:.0f} us ({checked / plain:.1f}x) per collective"
    )


if __name__ == "__main__":
    main()
