"""Hybrid sharding (port of upstream ``test_fsdp_hybrid_shard.py``).

``HYBRID_SHARD`` and ``_HYBRID_SHARD_ZERO2`` shard within an intra-node group
and replicate across an inter-node group: one reduce-scatter over the first and
one all-reduce over the second per flat parameter and backward, even when the
second has one rank. Groups come from ``process_group=(intra, inter)``, a 2-D
``device_mesh`` (dimension 0 replicates), or, when auto-wrapping, from the
world (every rank of a host shards); manual wrapping must name them.

Upstream runs with ``max(#GPUs, 2)`` ranks and needs 4 GPUs for three tests;
here every test runs with 4 ranks (on the CPU when there are fewer GPUs), so
the world is two "nodes" of two ranks for ``_init_intra_and_inter_node_groups``.

[Note: Hybrid groups on a CPU run]
Built from the world, ours puts every rank of a gloo world in one intra-node
group (a host runs them all). Torch's FSDP sizes the intra-node group by its
device handle's device count, which for the CPU is 1: every rank is its own
shard group, the strategy falls back to ``NO_SHARD`` and the inter-node group
is the world. ``test_fsdp_hybrid_shard_basic_setup`` asserts that for
``--fsdp-impl torch`` on the CPU where upstream (on GPUs) asserts the world as
the shard group. Torch's ``sync_module_states`` refuses CPU tensors (see
``test_fsdp_misc.py``), which ``test_hsdp_sync_module_state`` asserts for it.
"""

from __future__ import annotations

import enum
import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.distributed_c10d import _rank_not_in_group

from fsdptest import FSDPTest
from fsdptest.api import (
    ADAPTER,
    FSDP,
    HYBRID_SHARDING_STRATEGIES,
    ModuleWrapPolicy,
    ShardingStrategy,
    StateDictType,
    _init_intra_and_inter_node_groups,
)
from fsdptest.interface import DeviceInitMode, FSDPInitMode
from harness import current_device
from harness.collectives import Collective, CollectiveRecorder
from models import TransformerWithSharedParams

TORCH_SYNC_MODULE_STATES_ON_CPU = (
    "The module has CPU parameters or buffers when `sync_module_states=True`"
)


class MyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(10, 10)
        self.lin2 = nn.Linear(10, 10)
        self.lin3 = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin3(self.lin2(self.lin1(x)))


class ShardingStrategyMode(enum.Enum):
    ALL_HYBRID_SHARD = enum.auto()
    MIXED_HYBRID_FULL_SHARD = enum.auto()


class TestFSDPHybridShard(FSDPTest):
    world_size = 4

    def _halves(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """Shard groups: the first and the second half of the ranks; replicate
        groups: ranks i and i + n/2. Every rank creates every group."""
        n = self.world_size
        shard_rank_lists = list(range(0, n // 2)), list(range(n // 2, n))
        shard_groups = (dist.new_group(shard_rank_lists[0]), dist.new_group(shard_rank_lists[1]))
        my_shard_group = shard_groups[0] if self.rank in shard_rank_lists[0] else shard_groups[1]
        my_replicate_group = None
        for i in range(n // 2):
            replicate_group_ranks = list(range(i, n, n // 2))
            replicate_group = dist.new_group(replicate_group_ranks)
            if self.rank in replicate_group_ranks:
                my_replicate_group = replicate_group
        assert my_replicate_group is not None
        return my_shard_group, my_replicate_group

    def test_raises_manual_wrap_hybrid_shard_when_none_policy(self) -> None:
        """Manual wrapping with a hybrid strategy needs explicit groups or a mesh."""
        model = MyModel().to(self.device)
        err_ctx = self.assertRaisesRegex(
            ValueError, "requires explicit specification of process group or device_mesh."
        )
        with err_ctx:
            FSDP(model, sharding_strategy=ShardingStrategy.HYBRID_SHARD)
        with err_ctx:
            FSDP(model, sharding_strategy=ShardingStrategy._HYBRID_SHARD_ZERO2)

    def test_hsdp_save_load_state_dict(self) -> None:
        """A hybrid model's sharded model and optimizer state dicts load into
        another hybrid model."""
        my_shard_group, my_replicate_group = self._halves()
        fsdp_ctor = functools.partial(
            FSDP,
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
            use_orig_params=True,
            process_group=(my_shard_group, my_replicate_group),
        )
        model = fsdp_ctor(MyModel().to(self.device))
        optim = torch.optim.AdamW(model.parameters())
        # A CPU input: FSDP moves it to the compute device.
        model(torch.randn(2, 10)).sum().backward()
        optim.step()
        shard_g = model.process_group
        replicate_g = model._inter_node_pg
        assert shard_g == my_shard_group
        assert replicate_g == my_replicate_group
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            msd = model.state_dict()
            osd = FSDP.optim_state_dict(model, optim)
        load_model = fsdp_ctor(MyModel().to(self.device))
        load_optim = torch.optim.AdamW(load_model.parameters())
        with FSDP.state_dict_type(load_model, StateDictType.SHARDED_STATE_DICT):
            load_model.load_state_dict(msd)
            FSDP.optim_state_dict_to_load(load_model, load_optim, osd)
        load_optim.load_state_dict(osd)

    def test_hsdp_sync_module_state(self) -> None:
        """``sync_module_states`` gives every rank global rank 0's parameters
        (within each shard group, then across replicas)."""
        my_shard_group, my_replicate_group = self._halves()
        model = MyModel().to(self.device)
        nn.init.constant_(model.lin1.weight, self.rank)
        nn.init.constant_(model.lin2.weight, self.rank)
        nn.init.constant_(model.lin3.weight, self.rank)
        fsdp_ctor = functools.partial(
            FSDP,
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
            use_orig_params=True,
            sync_module_states=True,
            process_group=(my_shard_group, my_replicate_group),
        )
        if ADAPTER.limitations.sync_module_states_on_cpu:
            with self.assertRaisesRegex(ValueError, TORCH_SYNC_MODULE_STATES_ON_CPU):
                fsdp_ctor(model)
            return
        model = fsdp_ctor(model)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            self.assertTrue((model.lin1.weight == 0).all())
            self.assertTrue((model.lin2.weight == 0).all())
            self.assertTrue((model.lin3.weight == 0).all())

    def test_invalid_pg_specification_raises(self) -> None:
        """A hybrid strategy needs None or an (intra, inter) pair of groups."""
        model = MyModel().to(self.device)
        with self.assertRaisesRegex(ValueError, "Expected process_group to be passed in"):
            FSDP(
                model,
                auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                process_group=self.process_group,
                sharding_strategy=ShardingStrategy.HYBRID_SHARD,
            )

    def test_fsdp_hybrid_shard_basic_setup(self) -> None:
        """Hybrid units built from the world or a (1, world) mesh shard over the
        world, share one pair of groups, and reduce with one reduce-scatter and
        one all-reduce each per backward."""
        self.run_subtests(
            {
                "hsdp_sharding_strategy": [
                    ShardingStrategy.HYBRID_SHARD,
                    ShardingStrategy._HYBRID_SHARD_ZERO2,
                ],
                "sharding_strategy_mode": [
                    ShardingStrategyMode.ALL_HYBRID_SHARD,
                    ShardingStrategyMode.MIXED_HYBRID_FULL_SHARD,
                ],
                "use_orig_params": [False, True],
                "use_device_mesh": [False, True],
            },
            self._test_fsdp_hybrid_shard_basic_setup,
        )

    def _test_fsdp_hybrid_shard_basic_setup(
        self,
        hsdp_sharding_strategy: ShardingStrategy,
        sharding_strategy_mode: ShardingStrategyMode,
        use_orig_params: bool,
        use_device_mesh: bool,
    ) -> None:
        device_mesh = (
            init_device_mesh(self.device.type, (1, self.world_size)) if use_device_mesh else None
        )
        hsdp_model = self._init_hsdp_model(
            hsdp_sharding_strategy,
            sharding_strategy_mode,
            use_orig_params,
            hsdp_device_mesh=device_mesh,
        )
        if ADAPTER.limitations.hybrid_falls_back_on_cpu and device_mesh is None:
            self._check_torch_world_groups_on_cpu(hsdp_model, sharding_strategy_mode)
            return
        # The hybrid units' groups: the world shards, one rank replicates.
        intra_node_pgs = set()
        inter_node_pgs = set()
        for fsdp_module in hsdp_model.fsdp_modules(hsdp_model):
            if fsdp_module.sharding_strategy not in HYBRID_SHARDING_STRATEGIES:
                self.assertEqual(
                    sharding_strategy_mode, ShardingStrategyMode.MIXED_HYBRID_FULL_SHARD
                )
                self.assertEqual(fsdp_module.sharding_strategy, ShardingStrategy.FULL_SHARD)
                continue
            intra_node_pgs.add(fsdp_module.process_group)
            inter_node_pg = fsdp_module._inter_node_pg
            inter_node_pgs.add(inter_node_pg)
            self.assertEqual(self.world_size, dist.get_world_size(fsdp_module.process_group))
            self.assertEqual(1, dist.get_world_size(inter_node_pg))
            self.assertFalse(_rank_not_in_group(inter_node_pg))
            self.assertEqual(hsdp_sharding_strategy, fsdp_module.sharding_strategy)
        # All hybrid units share one pair of groups.
        self.assertEqual(1, len(intra_node_pgs))
        self.assertEqual(1, len(inter_node_pgs))

        # One reduce-scatter and one all-reduce per hybrid flat parameter.
        num_all_reduce, num_reduce_scatter = _count_reductions(hsdp_model)
        if sharding_strategy_mode == ShardingStrategyMode.ALL_HYBRID_SHARD:
            num_flat_params = len(_fsdp_handles(hsdp_model))
            self.assertEqual(num_flat_params, num_all_reduce)
            self.assertEqual(num_flat_params, num_reduce_scatter)
        else:
            num_hsdp_flat_params = len(_fsdp_handles(hsdp_model.transformer))
            num_flat_params = len(_fsdp_handles(hsdp_model))
            self.assertEqual(num_hsdp_flat_params, num_all_reduce)
            self.assertEqual(num_flat_params, num_reduce_scatter)

    def _check_torch_world_groups_on_cpu(
        self, hsdp_model: nn.Module, sharding_strategy_mode: ShardingStrategyMode
    ) -> None:
        """Torch's limitation (see [Note: Hybrid groups on a CPU run]): one rank per
        intra-node group, so the units built from the world fall back to NO_SHARD,
        with the world as inter-node group, and reduce by one all-reduce over
        their one-rank group (no reduce-scatter, nothing across the replicas)."""
        world_built = (
            hsdp_model.fsdp_modules(hsdp_model)
            if sharding_strategy_mode == ShardingStrategyMode.ALL_HYBRID_SHARD
            else hsdp_model.fsdp_modules(hsdp_model.transformer)
        )
        for fsdp_module in world_built:
            self.assertEqual(ShardingStrategy.NO_SHARD, fsdp_module.sharding_strategy)
            self.assertEqual(1, dist.get_world_size(fsdp_module.process_group))
            self.assertEqual(self.world_size, dist.get_world_size(fsdp_module._inter_node_pg))
        num_all_reduce, num_reduce_scatter = _count_reductions(hsdp_model)
        self.assertEqual(len(_fsdp_handles_of(world_built)), num_all_reduce)
        num_full_shard = len(_fsdp_handles(hsdp_model)) - len(_fsdp_handles_of(world_built))
        self.assertEqual(num_full_shard, num_reduce_scatter)

    def test_fsdp_hybrid_shard_parity(self) -> None:
        """Hybrid sharding over 2 x 2 ranks trains like FULL_SHARD over the 4."""
        self.run_subtests(
            {
                "hsdp_sharding_strategy": [
                    ShardingStrategy.HYBRID_SHARD,
                    ShardingStrategy._HYBRID_SHARD_ZERO2,
                ],
                "use_orig_params": [False, True],
            },
            self._test_fsdp_hybrid_shard_parity,
        )

    def _test_fsdp_hybrid_shard_parity(
        self, hsdp_sharding_strategy: ShardingStrategy, use_orig_params: bool
    ) -> None:
        fsdp_model = self._init_fsdp_model(use_orig_params)
        global_pg = dist.distributed_c10d._get_default_group()
        hsdp_pgs = _init_intra_and_inter_node_groups(global_pg, 2)
        hsdp_model = self._init_hsdp_model(
            hsdp_sharding_strategy,
            ShardingStrategyMode.ALL_HYBRID_SHARD,
            use_orig_params,
            hsdp_process_groups=hsdp_pgs,
        )
        assert hsdp_model._inter_node_pg.size() > 1, "HSDP model initialized without replication"
        fsdp_optim = torch.optim.Adam(fsdp_model.parameters(), lr=1e-2)
        hsdp_optim = torch.optim.Adam(hsdp_model.parameters(), lr=1e-2)
        torch.manual_seed(self.rank + 1)
        for _ in range(5):
            inp = fsdp_model.module.get_input(self.device)
            losses: list[torch.Tensor] = []
            for model, optim in ((fsdp_model, fsdp_optim), (hsdp_model, hsdp_optim)):
                optim.zero_grad()
                loss = model(*inp).sum()
                losses.append(loss)
                loss.backward()
                optim.step()
            self.assertEqual(losses[0], losses[1])

    def _init_fsdp_model(self, use_orig_params: bool) -> nn.Module:
        auto_wrap_policy = ModuleWrapPolicy(
            {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}
        )
        hsdp_kwargs = {
            "auto_wrap_policy": auto_wrap_policy,
            "device_id": self.device,
            "use_orig_params": use_orig_params,
        }
        return TransformerWithSharedParams.init(
            self.process_group,
            FSDPInitMode.RECURSIVE,
            DeviceInitMode.BEFORE,
            hsdp_kwargs,
            deterministic=True,
        )

    def _init_hsdp_model(
        self,
        hsdp_sharding_strategy: ShardingStrategy,
        sharding_strategy_mode: ShardingStrategyMode,
        use_orig_params: bool,
        hsdp_process_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None,
        hsdp_device_mesh: Any = None,
    ) -> nn.Module:
        assert hsdp_process_groups is None or hsdp_device_mesh is None
        auto_wrap_policy = ModuleWrapPolicy(
            {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}
        )
        hsdp_kwargs = {
            "device_id": self.device,
            "auto_wrap_policy": auto_wrap_policy,
            "sharding_strategy": hsdp_sharding_strategy,
            "use_orig_params": use_orig_params,
            "device_mesh": hsdp_device_mesh,
        }
        if sharding_strategy_mode == ShardingStrategyMode.ALL_HYBRID_SHARD:
            hsdp_model = TransformerWithSharedParams.init(
                hsdp_process_groups or self.process_group,
                FSDPInitMode.RECURSIVE,
                DeviceInitMode.BEFORE,
                hsdp_kwargs,
                deterministic=True,
            )
        elif sharding_strategy_mode == ShardingStrategyMode.MIXED_HYBRID_FULL_SHARD:
            model = TransformerWithSharedParams.init(
                hsdp_process_groups or self.process_group,
                FSDPInitMode.NO_FSDP,
                DeviceInitMode.BEFORE,
                {},
                deterministic=True,
            )
            # Hybrid for the transformer (and its layers, auto-wrapped) ...
            model.transformer = FSDP(model.transformer, **hsdp_kwargs)
            # ... and FULL_SHARD for the rest.
            hsdp_model = FSDP(
                model,
                device_id=self.device,
                sharding_strategy=ShardingStrategy.FULL_SHARD,
                use_orig_params=use_orig_params,
            )
        return hsdp_model


def _fsdp_handles(module: nn.Module) -> list[Any]:
    """torch's ``traversal_utils._get_fsdp_handles`` for wrapper-built models."""
    return _fsdp_handles_of(FSDP.fsdp_modules(module))


def _fsdp_handles_of(units: list[Any]) -> list[Any]:
    return [unit._handle for unit in units if unit._handle is not None]


def _count_reductions(hsdp_model: nn.Module) -> tuple[int, int]:
    """(all-reduces, reduce-scatters) of one forward and backward."""
    with CollectiveRecorder((Collective.ALL_REDUCE, Collective.REDUCE_SCATTER)) as recorder:
        inp = hsdp_model.get_input(current_device())
        out = hsdp_model(inp[0], inp[1])
        loss = hsdp_model.get_loss(inp, out)
        loss.backward()
    return len(recorder.of(Collective.ALL_REDUCE)), len(recorder.of(Collective.REDUCE_SCATTER))
