"""Per-unit CPU time of FSDP's hooks: many tiny units, so bookkeeping dominates.

Usage::

    python bench/unit_overhead.py                       # 64 units, use_orig_params both ways
    python bench/unit_overhead.py --units 64 --width 16 --steps 200 --profile
    python bench/unit_overhead.py --world-size 1 --linears 6   # NO_SHARD, 12 parameters a unit

One process on the CPU in torch's fake process group of ``--world-size`` ranks
(default two): its collectives return at once, so what is timed is FSDP's own
Python work, not communication or a second process competing for the cores.
At world size 1 FSDP switches to ``NO_SHARD`` (as torch's FSDP does), the path
of the single-GPU benchmark (``bench/fsdp_step.py --world-size 1``). The model
is ``--units`` blocks of ``--linears`` ``Linear(width, width)`` + ReLU (two
parameters each; ``--linears 6`` gives the 12 of a transformer block), each
block its own FSDP unit (FULL_SHARD, or NO_SHARD at world size 1) under a
root, fed a batch of one; ``--bf16`` adds the GPU benchmark's mixed precision
(bf16 parameters, fp32 reduction: each unshard then casts, also for
``NO_SHARD``; the model without FSDP stays in fp32). The layers are so small
that a step is almost only Python bookkeeping. Printed per mode:

- ``step``: median CPU time (``time.process_time``: less sensitive than wall
  time to other processes on a loaded machine) of forward + backward +
  ``zero_grad``, without profiler;
- ``per unit``: (FSDP step - the same model without FSDP) / units, in microseconds;
- with ``--hooks``: per unit and step, the CPU time spent in each of the
  runtime's four hooks (``pre_forward``, ``post_forward``, ``_pre_backward``,
  ``_post_backward`` of ``FSDPState``) and in the end-of-backward callback,
  timed by wrappers around those methods (about a microsecond each);
- with ``--profile``: the same four hooks' cumulative cProfile CPU time, which
  the profiler inflates (compare only runs of this script with each other).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp
import fsdp._runtime as fsdp_runtime
from fsdp.wrap import ModuleWrapPolicy

HOOKS = ("pre_forward", "post_forward", "_pre_backward", "_post_backward")
TIMED = (*HOOKS, "finalize_backward")


class Block(nn.Module):
    def __init__(self, width: int, linears: int) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(width, width) for _ in range(linears))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for linear in self.linears:
            x = torch.relu(linear(x))
        return x


def build(args: argparse.Namespace, wrap: bool, use_orig_params: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(args.width, args.linears) for _ in range(args.units)))
    if not wrap:
        return model
    mixed = None
    if args.bf16:  # the GPU benchmark's policy
        mixed = fsdp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return fsdp.FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        mixed_precision=mixed,
        use_orig_params=use_orig_params,
    )


def step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()
    model.zero_grad(set_to_none=True)


def median_step(model: nn.Module, x: torch.Tensor, steps: int) -> float:
    for _ in range(5):
        step(model, x)
    times = []
    for _ in range(steps):
        start = time.process_time()
        step(model, x)
        times.append(time.process_time() - start)
    return statistics.median(times)


def hook_times(model: nn.Module, x: torch.Tensor, steps: int) -> dict[str, float]:
    """Cumulative seconds per hook over ``steps`` profiled steps."""
    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    for _ in range(steps):
        step(model, x)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    found = dict.fromkeys(HOOKS, 0.0)
    for (filename, _, name), (_, _, _, cumulative, _) in stats.items():
        if name in found and filename.endswith(os.path.join("fsdp", "_runtime.py")):
            found[name] += cumulative
    return found


def timed_hooks(model: nn.Module, x: torch.Tensor, steps: int) -> dict[str, float]:
    """CPU seconds per hook over ``steps`` steps, from wrappers on ``FSDPState``."""
    state_cls = fsdp_runtime.FSDPState
    spent = dict.fromkeys(TIMED, 0.0)
    originals = {name: getattr(state_cls, name) for name in TIMED}

    def timer(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            try:
                return method(*args, **kwargs)
            finally:
                spent[name] += time.process_time() - start

        return timed

    for name, method in originals.items():
        setattr(state_cls, name, timer(name, method))
    try:
        for _ in range(steps):
            step(model, x)
    finally:
        for name, method in originals.items():
            setattr(state_cls, name, method)
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=64)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--linears", type=int, default=1, help="Linear layers per unit")
    parser.add_argument(
        "--world-size", type=int, default=2, help="fake ranks (1: FSDP switches to NO_SHARD)"
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--bf16", action="store_true", help="MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)"
    )
    parser.add_argument("--hooks", action="store_true", help="time each hook")
    parser.add_argument("--profile", action="store_true", help="cProfile the hooks")
    args = parser.parse_args()
    for name in ("units", "width", "linears", "steps", "world_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    try:
        run(args)
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> None:
    x = torch.randn(1, args.width, requires_grad=True)
    plain = median_step(build(args, False, False), x, args.steps)
    print(
        f"units {args.units} of {args.linears} Linear({args.width}, {args.width}), "
        f"world size {args.world_size}{', bf16' if args.bf16 else ''}, {args.steps} steps; without FSDP {plain * 1e3:.2f} ms"
    )
    for use_orig_params in (False, True):
        model = build(args, True, use_orig_params)
        assert isinstance(model, fsdp.FullyShardedDataParallel)
        strategy = model.sharding_strategy.name
        median = median_step(model, x, args.steps)
        per_unit = (median - plain) / args.units * 1e6
        line = f"{strategy} use_orig_params={use_orig_params!s:5}: step {median * 1e3:.2f} ms, per unit {per_unit:.0f} us"
        scale = 1e6 / (args.steps * args.units)
        if args.hooks:
            spent = timed_hooks(model, x, args.steps)
            line += "; per unit: " + ", ".join(f"{n} {t * scale:.0f} us" for n, t in spent.items())
        if args.profile:
            times = hook_times(model, x, args.steps)
            line += "; profiled per unit: " + ", ".join(
                f"{name} {t * scale:.0f} us" for name, t in times.items()
            )
        print(line)


if __name__ == "__main__":
    main()
