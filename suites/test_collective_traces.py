"""Golden traces: the collectives FSDP issues, step by step, for canonical configurations.

A small fixed nested model (a root holding two linears, two blocks of different
sizes, each its own unit) trains two steps under one configuration; every
all-gather, reduce-scatter and all-reduce of each forward and each backward is
recorded (``harness.collectives.CollectiveRecorder``: op, dtype, input and output
numel, group size and stride) and the text is compared with the golden literal
by expecttest's ``assertExpectedInline``. ``EXPECTTEST_ACCEPT=1`` rewrites the
literals (rank 0 writes; see ``harness.expect``):

    EXPECTTEST_ACCEPT=1 python -m pytest suites/test_collective_traces.py

[Note: Golden traces live among the suites]
The traces are of this project's FSDP. They live in ``suites/`` rather than
``tests/`` because the suites are what runs under ``--fsdp-impl torch`` as well:
a trace that torch's FSDP issues identically is checked for both, so the golden
text is confirmed by the oracle and a change to our schedule that leaves torch's
fails here naming the first differing collective. Every trace below is torch's
too (torch 2.13, CPU and gloo: its list-form all-gathers record the same numels).
Another implementation (``--fsdp-impl mypkg.fsdp``) may schedule its collectives
differently and still be correct, so for it these tests are skipped.

The model's unit sizes are chosen so that every unit shows in the trace by its
own numel: the root 26 elements, block 0 58, block 1 76 (padded to a multiple of
the shard group size: 28, 60 and 76 over four ranks). The debug level is OFF
while recording (under ``DETAIL`` both implementations add the forward-order
check's all-gathers to the first forward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdptest import FSDPTest
from fsdptest.api import (
    ADAPTER,
    FSDP,
    BackwardPrefetch,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
)
from harness.collectives import CollectiveCall, CollectiveRecorder

STEPS = 2
FOREIGN_SKIP = (
    "the golden traces are of this project's FSDP and torch's (which issues the same); "
    "another implementation may schedule its collectives differently and be correct"
)
pytestmark = pytest.mark.skipif(not ADAPTER.has_golden_traces, reason=FOREIGN_SKIP)


class _Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.lin1 = nn.Linear(4, hidden)
        self.lin2 = nn.Linear(hidden, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.lin1(x)))


class _Net(nn.Module):
    """Root parameters 26 (inp, out); blocks 58 and 76 (and 94 with a third
    block of ``hidden`` 10): each unit shows by its numel."""

    def __init__(self, hidden: tuple[int, ...] = (6, 8)) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.blocks = nn.Sequential(*(_Block(h) for h in hidden))
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


def _line(call: CollectiveCall) -> str:
    dtype = str(call.input_dtype).removeprefix("torch.")
    return (
        f"  {call.kind.name.lower():<15}{dtype:<9}{call.input_numel:>4} -> {call.output_numel:<4}"
        f" group {call.group_size} stride {call.group_stride}"
    )


@contextlib.contextmanager
def _debug_off() -> Iterator[None]:
    previous = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.OFF)
    try:
        yield
    finally:
        dist.set_debug_level(previous)


class _Traces(FSDPTest):
    def _trace(
        self, microbatches: int = 1, hidden: tuple[int, ...] = (6, 8), **fsdp_kwargs: Any
    ) -> str:
        """The collectives of ``STEPS`` steps of ``_Net(hidden)`` under
        ``FSDP(**fsdp_kwargs)``; with ``microbatches`` > 1 all but the last run
        under ``no_sync()``."""
        torch.manual_seed(0)
        model = FSDP(
            _Net(hidden).to(self.device), auto_wrap_policy=ModuleWrapPolicy({_Block}), **fsdp_kwargs
        )
        lines: list[str] = []
        with _debug_off():
            for step in range(STEPS):
                for micro in range(microbatches):
                    label = f"step {step}" + (f" microbatch {micro}" if microbatches > 1 else "")
                    last = micro == microbatches - 1
                    with contextlib.nullcontext() if last else model.no_sync():
                        lines += self._pass(model, label, step * microbatches + micro)
        return "\n".join(lines) + "\n"

    def _pass(self, model: nn.Module, label: str, seed: int) -> list[str]:
        generator = torch.Generator().manual_seed(100 * seed + self.rank)
        x = torch.randn(2, 3, generator=generator).to(self.device)
        with CollectiveRecorder() as forward:
            loss = model(x).float().sum()
        with CollectiveRecorder() as backward:
            loss.backward()
        return [
            f"{label} forward",
            *map(_line, forward.calls),
            f"{label} backward",
            *map(_line, backward.calls),
        ]


class TestCollectiveTraces(_Traces):
    world_size = 2

    def test_full_shard(self) -> None:
        """FULL_SHARD (BACKWARD_PRE): each unit gathered in forward and, but the root,
        again in backward; one reduce-scatter per unit."""
        trace = self._trace(sharding_strategy=ShardingStrategy.FULL_SHARD)
        self.assertExpectedInline(
            trace,
            """\
step 0 forward
  all_gather     float32    13 -> 26   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  all_gather     float32    38 -> 76   group 2 stride 1
step 0 backward
  all_gather     float32    38 -> 76   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  reduce_scatter float32    76 -> 38   group 2 stride 1
  reduce_scatter float32    58 -> 29   group 2 stride 1
  reduce_scatter float32    26 -> 13   group 2 stride 1
step 1 forward
  all_gather     float32    13 -> 26   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  all_gather     float32    38 -> 76   group 2 stride 1
step 1 backward
  all_gather     float32    38 -> 76   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  reduce_scatter float32    76 -> 38   group 2 stride 1
  reduce_scatter float32    58 -> 29   group 2 stride 1
  reduce_scatter float32    26 -> 13   group 2 stride 1
""",
        )

    def test_full_shard_backward_post(self) -> None:
        trace = self._trace(
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            backward_prefetch=BackwardPrefetch.BACKWARD_POST,
        )
        self.assertExpectedInline(
            trace,
            """\
step 0 forward
  all_gather     float32    13 -> 26   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  all_gather     float32    38 -> 76   group 2 stride 1
step 0 backward
  all_gather     float32    38 -> 76   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  reduce_scatter float32    76 -> 38   group 2 stride 1
  reduce_scatter float32    58 -> 29   group 2 stride 1
  reduce_scatter float32    26 -> 13   group 2 stride 1
step 1 forward
  all_gather     float32    13 -> 26   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  all_gather     float32    38 -> 76   group 2 stride 1
step 1 backward
  all_gather     float32    38 -> 76   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  reduce_scatter float32    76 -> 38   group 2 stride 1
  reduce_scatter float32    58 -> 29   group 2 stride 1
  reduce_scatter float32    26 -> 13   group 2 stride 1
""",
        )

    def test_full_shard_no_backward_prefetch(self) -> None:
        trace = self._trace(sharding_strategy=ShardingStrategy.FULL_SHARD, backward_prefetch=None)
        self.assertExpectedInline(
            trace,
            """\
step 0 forward
  all_gather     float32    13 -> 26   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  all_gather     float32    38 -> 76   group 2 stride 1
step 0 backward
  all_gather     float32    38 -> 76   group 2 stride 1
  reduce_scatter float32    76 -> 38   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  reduce_scatter float32    58 -> 29   group 2 stride 1
  reduce_scatter float32    26 -> 13   group 2 stride 1
step 1 forward
  all_gather     float32    13 -> 26   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  all_gather     float32    38 -> 76   group 2 stride 1
step 1 backward
  all_gather     float32    38 -> 76   group 2 stride 1
  reduce_scatter float32    76 -> 38   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  reduce_scatter float32    58 -> 29   group 2 stride 1
  reduce_scatter float32    26 -> 13   group 2 stride 1
""",
        )

    def test_full_shard_forward_prefetch(self) -> None:
        trace = self._trace(sharding_strategy=ShardingStrategy.FULL_SHARD, forward_prefetch=True)
        self.assertExpectedInline(
            trace,
            """\
step 0 forward
  all_gather     float32    13 -> 26   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  all_gather     float32    38 -> 76   group 2 stride 1
step 0 backward
  all_gather     float32    38 -> 76   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  reduce_scatter float32    76 -> 38   group 2 stride 1
  reduce_scatter float32    58 -> 29   group 2 stride 1
  reduce_scatter float32    26 -> 13   group 2 stride 1
step 1 forward
  all_gather     float32    13 -> 26   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  all_gather     float32    38 -> 76   group 2 stride 1
step 1 backward
  all_gather     float32    38 -> 76   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  reduce_scatter float32    76 -> 38   group 2 stride 1
  reduce_scatter float32    58 -> 29   group 2 stride 1
  reduce_scatter float32    26 -> 13   group 2 stride 1
""",
        )

    def test_full_shard_forward_prefetch_three_blocks(self) -> None:
        """Forward prefetch unshards the next unit in full, its views made in the
        current unit's pre-forward: autograd runs their backward after the
        current unit's, so once the first iteration has recorded the order (step
        1), the backward gathers every block before the first reduce-scatter
        (see [Note: Forward prefetch shows the views at once] in fsdp._flat_param)."""
        trace = self._trace(
            sharding_strategy=ShardingStrategy.FULL_SHARD, forward_prefetch=True, hidden=(6, 8, 10)
        )
        self.assertExpectedInline(
            trace,
            """\
step 0 forward
  all_gather     float32    13 -> 26   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  all_gather     float32    38 -> 76   group 2 stride 1
  all_gather     float32    47 -> 94   group 2 stride 1
step 0 backward
  all_gather     float32    47 -> 94   group 2 stride 1
  all_gather     float32    38 -> 76   group 2 stride 1
  reduce_scatter float32    94 -> 47   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  reduce_scatter float32    76 -> 38   group 2 stride 1
  reduce_scatter float32    58 -> 29   group 2 stride 1
  reduce_scatter float32    26 -> 13   group 2 stride 1
step 1 forward
  all_gather     float32    13 -> 26   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  all_gather     float32    38 -> 76   group 2 stride 1
  all_gather     float32    47 -> 94   group 2 stride 1
step 1 backward
  all_gather     float32    47 -> 94   group 2 stride 1
  all_gather     float32    38 -> 76   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  reduce_scatter float32    94 -> 47   group 2 stride 1
  reduce_scatter float32    76 -> 38   group 2 stride 1
  reduce_scatter float32    58 -> 29   group 2 stride 1
  reduce_scatter float32    26 -> 13   group 2 stride 1
""",
        )

    def test_shard_grad_op(self) -> None:
        trace = self._trace(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)
        self.assertExpectedInline(
            trace,
            """\
step 0 forward
  all_gather     float32    13 -> 26   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  all_gather     float32    38 -> 76   group 2 stride 1
step 0 backward
  reduce_scatter float32    76 -> 38   group 2 stride 1
  reduce_scatter float32    58 -> 29   group 2 stride 1
  reduce_scatter float32    26 -> 13   group 2 stride 1
step 1 forward
  all_gather     float32    13 -> 26   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  all_gather     float32    38 -> 76   group 2 stride 1
step 1 backward
  reduce_scatter float32    76 -> 38   group 2 stride 1
  reduce_scatter float32    58 -> 29   group 2 stride 1
  reduce_scatter float32    26 -> 13   group 2 stride 1
""",
        )

    def test_no_shard(self) -> None:
        trace = self._trace(sharding_strategy=ShardingStrategy.NO_SHARD)
        self.assertExpectedInline(
            trace,
            """\
step 0 forward
step 0 backward
  all_reduce     float32    76 -> 76   group 2 stride 1
  all_reduce     float32    58 -> 58   group 2 stride 1
  all_reduce     float32    26 -> 26   group 2 stride 1
step 1 forward
step 1 backward
  all_reduce     float32    76 -> 76   group 2 stride 1
  all_reduce     float32    58 -> 58   group 2 stride 1
  all_reduce     float32    26 -> 26   group 2 stride 1
""",
        )

    def test_full_shard_no_sync(self) -> None:
        trace = self._trace(sharding_strategy=ShardingStrategy.FULL_SHARD, microbatches=2)
        self.assertExpectedInline(
            trace,
            """\
step 0 microbatch 0 forward
  all_gather     float32    13 -> 26   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  all_gather     float32    38 -> 76   group 2 stride 1
step 0 microbatch 0 backward
  all_gather     float32    38 -> 76   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
step 0 microbatch 1 forward
  all_gather     float32    13 -> 26   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  all_gather     float32    38 -> 76   group 2 stride 1
step 0 microbatch 1 backward
  all_gather     float32    38 -> 76   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  reduce_scatter float32    76 -> 38   group 2 stride 1
  reduce_scatter float32    58 -> 29   group 2 stride 1
  reduce_scatter float32    26 -> 13   group 2 stride 1
step 1 microbatch 0 forward
  all_gather     float32    13 -> 26   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  all_gather     float32    38 -> 76   group 2 stride 1
step 1 microbatch 0 backward
  all_gather     float32    38 -> 76   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
step 1 microbatch 1 forward
  all_gather     float32    13 -> 26   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  all_gather     float32    38 -> 76   group 2 stride 1
step 1 microbatch 1 backward
  all_gather     float32    38 -> 76   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  reduce_scatter float32    76 -> 38   group 2 stride 1
  reduce_scatter float32    58 -> 29   group 2 stride 1
  reduce_scatter float32    26 -> 13   group 2 stride 1
""",
        )

    def test_shard_grad_op_no_sync(self) -> None:
        trace = self._trace(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, microbatches=2)
        self.assertExpectedInline(
            trace,
            """\
step 0 microbatch 0 forward
  all_gather     float32    13 -> 26   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  all_gather     float32    38 -> 76   group 2 stride 1
step 0 microbatch 0 backward
step 0 microbatch 1 forward
step 0 microbatch 1 backward
  reduce_scatter float32    76 -> 38   group 2 stride 1
  reduce_scatter float32    58 -> 29   group 2 stride 1
  reduce_scatter float32    26 -> 13   group 2 stride 1
step 1 microbatch 0 forward
  all_gather     float32    13 -> 26   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  all_gather     float32    38 -> 76   group 2 stride 1
step 1 microbatch 0 backward
step 1 microbatch 1 forward
step 1 microbatch 1 backward
  reduce_scatter float32    76 -> 38   group 2 stride 1
  reduce_scatter float32    58 -> 29   group 2 stride 1
  reduce_scatter float32    26 -> 13   group 2 stride 1
""",
        )

    def test_full_shard_mixed_precision(self) -> None:
        trace = self._trace(
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            mixed_precision=MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32),
        )
        self.assertExpectedInline(
            trace,
            """\
step 0 forward
  all_gather     float16    13 -> 26   group 2 stride 1
  all_gather     float16    29 -> 58   group 2 stride 1
  all_gather     float16    38 -> 76   group 2 stride 1
step 0 backward
  all_gather     float16    38 -> 76   group 2 stride 1
  all_gather     float16    29 -> 58   group 2 stride 1
  reduce_scatter float32    76 -> 38   group 2 stride 1
  reduce_scatter float32    58 -> 29   group 2 stride 1
  reduce_scatter float32    26 -> 13   group 2 stride 1
step 1 forward
  all_gather     float16    13 -> 26   group 2 stride 1
  all_gather     float16    29 -> 58   group 2 stride 1
  all_gather     float16    38 -> 76   group 2 stride 1
step 1 backward
  all_gather     float16    38 -> 76   group 2 stride 1
  all_gather     float16    29 -> 58   group 2 stride 1
  reduce_scatter float32    76 -> 38   group 2 stride 1
  reduce_scatter float32    58 -> 29   group 2 stride 1
  reduce_scatter float32    26 -> 13   group 2 stride 1
""",
        )


def _two_by_two(rank: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(shard, replicate) groups of a 2x2 mesh: shards {0,1} {2,3}, replicas {0,2} {1,3}."""
    shards = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])]
    replicas = [dist.new_group(ranks) for ranks in ([0, 2], [1, 3])]
    return shards[rank // 2], replicas[rank % 2]


class TestHybridCollectiveTraces(_Traces):
    """Hybrid strategies over two replicas of a two-rank shard group."""

    world_size = 4

    def test_hybrid_shard(self) -> None:
        trace = self._trace(
            sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=_two_by_two(self.rank)
        )
        self.assertExpectedInline(
            trace,
            """\
step 0 forward
  all_gather     float32    13 -> 26   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  all_gather     float32    38 -> 76   group 2 stride 1
step 0 backward
  all_gather     float32    38 -> 76   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  reduce_scatter float32    76 -> 38   group 2 stride 1
  all_reduce     float32    38 -> 38   group 2 stride 2
  reduce_scatter float32    58 -> 29   group 2 stride 1
  all_reduce     float32    29 -> 29   group 2 stride 2
  reduce_scatter float32    26 -> 13   group 2 stride 1
  all_reduce     float32    13 -> 13   group 2 stride 2
step 1 forward
  all_gather     float32    13 -> 26   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  all_gather     float32    38 -> 76   group 2 stride 1
step 1 backward
  all_gather     float32    38 -> 76   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  reduce_scatter float32    76 -> 38   group 2 stride 1
  all_reduce     float32    38 -> 38   group 2 stride 2
  reduce_scatter float32    58 -> 29   group 2 stride 1
  all_reduce     float32    29 -> 29   group 2 stride 2
  reduce_scatter float32    26 -> 13   group 2 stride 1
  all_reduce     float32    13 -> 13   group 2 stride 2
""",
        )

    def test_hybrid_shard_zero2(self) -> None:
        trace = self._trace(
            sharding_strategy=ShardingStrategy._HYBRID_SHARD_ZERO2,
            process_group=_two_by_two(self.rank),
        )
        self.assertExpectedInline(
            trace,
            """\
step 0 forward
  all_gather     float32    13 -> 26   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  all_gather     float32    38 -> 76   group 2 stride 1
step 0 backward
  reduce_scatter float32    76 -> 38   group 2 stride 1
  all_reduce     float32    38 -> 38   group 2 stride 2
  reduce_scatter float32    58 -> 29   group 2 stride 1
  all_reduce     float32    29 -> 29   group 2 stride 2
  reduce_scatter float32    26 -> 13   group 2 stride 1
  all_reduce     float32    13 -> 13   group 2 stride 2
step 1 forward
  all_gather     float32    13 -> 26   group 2 stride 1
  all_gather     float32    29 -> 58   group 2 stride 1
  all_gather     float32    38 -> 76   group 2 stride 1
step 1 backward
  reduce_scatter float32    76 -> 38   group 2 stride 1
  all_reduce     float32    38 -> 38   group 2 stride 2
  reduce_scatter float32    58 -> 29   group 2 stride 1
  all_reduce     float32    29 -> 29   group 2 stride 2
  reduce_scatter float32    26 -> 13   group 2 stride 1
  all_reduce     float32    13 -> 13   group 2 stride 2
""",
        )
