"""Gradient accumulation across synced and ``no_sync()`` backwards equals DDP.

A schedule is the list of microbatches of one optimizer step, each synced
(``S``) or run under ``no_sync()`` (``N``); the last one is always synced. Every
schedule of up to three microbatches runs, plus ``SNNS`` (a synced backward, two
``no_sync`` ones, a synced one), for two SGD steps with momentum (SGD rather
than Adam: Adam's update hides a wrong gradient scale), clearing gradients with
``zero_grad(set_to_none=...)`` before each step. DDP trains on the same data with
its own ``no_sync()``. After the last backward of each step the full parameters
(and, with ``use_orig_params=True`` and no offload, the full gradients) must
equal DDP's; after each step the full parameters must.

Hybrid strategies run on two meshes built here with ``dist.new_group``: one
replica sharded over every rank (``1xW``) and every rank a replica with a
one-rank shard group (``Wx1``), which torch's FSDP gets wrong (see
``suites/test_hybrid_replicas.py``).
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import unittest
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdptest import FSDPTest
from fsdptest.api import ADAPTER, FSDP, CPUOffload, ShardingStrategy, clean_tensor_name
from fsdptest.parity import EXACT, REORDERED_FP32, Tolerance
from harness import current_device

SYNC, NO_SYNC = "S", "N"
# Every order of up to three microbatches that ends synced, then the headline case.
SCHEDULES = [
    "".join(prefix) + SYNC
    for length in range(3)
    for prefix in itertools.product(NO_SYNC + SYNC, repeat=length)
] + ["SNNS"]
STEPS = 2
LR, MOMENTUM = 0.01, 0.9

HybridGroups = tuple[dist.ProcessGroup, dist.ProcessGroup]


class Sharding(enum.Enum):
    """A sharding strategy; for the hybrid ones also the mesh: ``1xW`` is one
    replica sharded over all W ranks, ``Wx1`` makes every rank a replica."""

    FULL_SHARD = enum.auto()
    SHARD_GRAD_OP = enum.auto()
    NO_SHARD = enum.auto()
    HYBRID_SHARD_1xW = enum.auto()
    HYBRID_SHARD_Wx1 = enum.auto()
    HYBRID_ZERO2_1xW = enum.auto()
    HYBRID_ZERO2_Wx1 = enum.auto()

    @property
    def strategy(self) -> ShardingStrategy:
        if self.name.startswith("HYBRID_SHARD"):
            return ShardingStrategy.HYBRID_SHARD
        if self.name.startswith("HYBRID_ZERO2"):
            return ShardingStrategy._HYBRID_SHARD_ZERO2
        return ShardingStrategy[self.name]

    @property
    def one_rank_shards(self) -> bool:
        return self.name.endswith("Wx1")

    def process_group(self, meshes: Meshes) -> HybridGroups | None:
        """The (shard, replicate) pair of a hybrid mesh; None for the default group."""
        if not self.name.startswith("HYBRID"):
            return None
        return meshes.rank_replicas if self.one_rank_shards else meshes.one_replica


class Meshes(NamedTuple):
    """Hybrid (shard, replicate) pairs, built once per test: a gloo group holds
    sockets and threads until the test ends."""

    one_replica: HybridGroups
    rank_replicas: HybridGroups

    @classmethod
    def build(cls, world_size: int, rank: int) -> Meshes:
        everyone = _subgroup([list(range(world_size))], rank)
        alone = _subgroup([[r] for r in range(world_size)], rank)
        return cls(one_replica=(everyone, alone), rank_replicas=(alone, everyone))


def _subgroup(layout: list[list[int]], rank: int) -> dist.ProcessGroup:
    """Creates every group of ``layout`` (on every rank, in order); returns this rank's."""
    groups = {tuple(ranks): dist.new_group(ranks) for ranks in layout}
    return next(group for ranks, group in groups.items() if rank in ranks)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))


def _input(rank: int, step: int, micro: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randn(3, 7, generator=generator).to(current_device())


def _ddp(module: nn.Module) -> DDP:
    device = current_device()
    module = module.to(device)
    return DDP(module, device_ids=[device.index] if device.type == "cuda" else None)


def _fsdp(
    sharding: Sharding, offload: bool, use_orig_params: bool, group: HybridGroups | None
) -> FSDP:
    """Two units: the first Linear, and the root holding the second."""
    net = _net() if offload else _net().to(current_device())
    kwargs = {
        "process_group": group,
        "sharding_strategy": sharding.strategy,
        "cpu_offload": CPUOffload(offload_params=offload),
        "use_orig_params": use_orig_params,
    }
    net[0] = FSDP(net[0], **kwargs)
    return FSDP(net, **kwargs)


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    with FSDP.summon_full_params(model):
        return {clean_tensor_name(n): p.detach().clone() for n, p in model.named_parameters()}


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    with FSDP.summon_full_params(model, with_grads=True):
        return {
            clean_tensor_name(n): None if p.grad is None else p.grad.detach().clone()
            for n, p in model.named_parameters()
        }


def _ddp_params(reference: DDP) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in reference.module.named_parameters()}


def _ddp_grads(reference: DDP) -> dict[str, torch.Tensor | None]:
    return {n: p.grad for n, p in reference.module.named_parameters()}


def _maybe_no_sync(model: nn.Module, kind: str) -> contextlib.AbstractContextManager[None]:
    return model.no_sync() if kind == NO_SYNC else contextlib.nullcontext()


class _GradAccumulation(FSDPTest):
    """Every schedule x ``set_to_none`` x sharding x offload x use_orig_params."""

    @pytest.mark.parametrize("sharding", list(Sharding), ids=lambda s: s.name)
    def test_every_schedule_equals_ddp(self, sharding: Sharding) -> None:
        """Parameters and gradients equal DDP's through two steps of every schedule."""
        config = {
            "schedule": SCHEDULES,
            "set_to_none": [True, False],
            "offload": [False, True],
            "use_orig_params": [False, True],
        }
        meshes = Meshes.build(self.world_size, self.rank)
        self.run_subtests(config, self._check_unless_skipped, meshes, sharding)

    def _check_unless_skipped(self, meshes: Meshes, sharding: Sharding, **kwargs: Any) -> None:
        """A matrix that silently skips its cases is how accumulation bugs hid
        (docs/guide/bug-classes.md, class 4): only torch's CPU offload on a CPU-only run
        may skip here (see fsdptest.api)."""
        try:
            self._check(meshes, sharding, **kwargs)
        except unittest.SkipTest:
            self.assertTrue(kwargs["offload"] and ADAPTER.limitations.cpu_offload_on_cpu, "skipped")
            raise

    def _check(
        self,
        meshes: Meshes,
        sharding: Sharding,
        schedule: str,
        set_to_none: bool,
        offload: bool,
        use_orig_params: bool,
    ) -> None:
        group = sharding.process_group(meshes)
        model = _fsdp(sharding, offload, use_orig_params, group)  # skips torch's CPU offload
        reference = _ddp(_net())
        # summon_full_params(with_grads=True) needs use_orig_params and no offload
        compare_grads = use_orig_params and not offload
        if (
            ADAPTER.known_defects.one_rank_shard_group_never_syncs_replicas
            and sharding.one_rank_shards
        ):
            # Torch's FSDP with a one-rank shard group switches to NO_SHARD
            # (_init_utils._init_core_state) and all-reduces over that group
            # only (_runtime_utils._reduce_grad_no_shard): the replicas never
            # sync. Asserted, so that a fix in torch shows up here.
            with self.assertRaises(AssertionError):
                self._train_and_compare(model, reference, schedule, set_to_none, compare_grads)
            return
        if (
            ADAPTER.limitations.accumulation_outside_no_sync_with_offload
            and offload
            and schedule.count(SYNC) > 1
        ):
            # Torch's FSDP documents this limitation ("Limitations" in the
            # FullyShardedDataParallel docstring): gradient accumulation outside
            # no_sync() does not work with CPU offloading. Asserted, so that a
            # fix in torch shows up here (on CPU-only runs torch skips offload).
            with self.assertRaises(AssertionError):
                self._train_and_compare(model, reference, schedule, set_to_none, compare_grads)
            return
        self._train_and_compare(model, reference, schedule, set_to_none, compare_grads)

    def _train_and_compare(
        self,
        model: FSDP,
        reference: DDP,
        schedule: str,
        set_to_none: bool,
        compare_grads: bool,
    ) -> None:
        optims = [
            torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for m in (model, reference)
        ]
        tolerance = _tolerance(self.world_size, schedule)

        def check(actual: object, expected: object, what: str) -> None:
            self.assertEqual(actual, expected, what, rtol=tolerance.rtol, atol=tolerance.atol)

        for step in range(STEPS):
            for optim in optims:
                optim.zero_grad(set_to_none=set_to_none)
            for micro, kind in enumerate(schedule):
                x = _input(self.rank, step, micro)
                for m in (model, reference):
                    with _maybe_no_sync(m, kind):
                        m(x).sum().backward()
            check(
                _full_params(model), _ddp_params(reference), f"step {step}: params after backward"
            )
            if compare_grads:
                check(_full_grads(model), _ddp_grads(reference), f"step {step}: gradients")
            for optim in optims:
                optim.step()
            check(_full_params(model), _ddp_params(reference), f"step {step}: params after step")


def _tolerance(world_size: int, schedule: str) -> Tolerance:
    """Exact with two ranks and one synced backward per step: every reduction
    has two addends, exact in any order. Otherwise torch's fp32 defaults
    (``REORDERED_FP32``): with three ranks DDP's all-reduce and FSDP's
    reduce-scatter may add in different orders, and a second synced backward
    makes DDP reduce its accumulated gradient, ``sum_r (A + g_r) / W``, where a
    sharded FSDP adds the new reduced gradient to the old one, ``A + sum_r g_r / W``
    (the same sum, rounded differently)."""
    if world_size == 2 and schedule.count(SYNC) == 1:
        return EXACT
    return REORDERED_FP32


class TestGradAccumulationWorld2(_GradAccumulation):
    world_size = 2


class TestGradAccumulationWorld3(_GradAccumulation):
    world_size = 3
