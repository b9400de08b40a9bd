"""The collective patches see the collectives of whichever FSDP is under test."""

from __future__ import annotations

import functools
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

from fsdptest import FSDPTest
from fsdptest.api import (
    ADAPTER,
    FSDP,
    CPUOffload,
    FlatParamHandle,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
)
from harness.collectives import (
    Collective,
    CollectiveRecorder,
    current,
    patch_reduce_scatter,
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3))


class TestCollectivePatches(FSDPTest):
    def test_recorder_sees_every_all_gather_and_reduce_scatter(self):
        """FULL_SHARD with three inner units and a root without parameters of its
        own: one all-gather per unit in forward, one more per non-root unit in
        backward, one reduce-scatter per unit, each in the reduce dtype."""
        model = FSDP(
            _model(),
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            mixed_precision=MixedPrecision(reduce_dtype=torch.float16),
            device_id=self.device if self.device.type == "cuda" else None,
        )
        model(torch.randn(4, 6, device=self.device)).sum().backward()  # warm-up iteration
        with CollectiveRecorder() as recorder:
            model(torch.randn(4, 6, device=self.device)).sum().backward()
        gathers = recorder.of(Collective.ALL_GATHER)
        scatters = recorder.of(Collective.REDUCE_SCATTER)
        self.assertEqual(len(scatters), 3)
        self.assertEqual({c.input_dtype for c in scatters}, {torch.float16})
        self.assertEqual({c.group_size for c in scatters}, {self.world_size})
        # forward: 3 units; backward: the 3 units were freed after forward
        # (none of them is the root), so each is gathered again
        self.assertEqual(len(gathers), 6)

    def test_stacked_patches_each_see_a_call_once(self):
        """A patch calls the function that was current when it was made, so a
        patch made inside a recorder reaches the recorder too."""
        seen: list[torch.dtype] = []
        model = FSDP(_model().to(self.device), sharding_strategy=ShardingStrategy.FULL_SHARD)
        with CollectiveRecorder() as recorder:
            original = current(Collective.REDUCE_SCATTER)

            def validate(*args: object, **kwargs: object) -> object:
                seen.append(next(a for a in args if isinstance(a, torch.Tensor)).dtype)
                return original(*args, **kwargs)

            with patch_reduce_scatter(validate):
                model(torch.randn(4, 6, device=self.device)).sum().backward()
        self.assertEqual(len(seen), 1)
        self.assertEqual(len(recorder.of(Collective.REDUCE_SCATTER)), 1)

    def test_old_and_new_names_count_once(self):
        """On torch 2.13 the old name calls the new one: one call, one record."""
        out = torch.empty(2, device=self.device)
        inp = torch.ones(2 * self.world_size, device=self.device)
        names = [n for n in Collective.REDUCE_SCATTER.names() if n != "reduce_scatter"]
        with CollectiveRecorder() as recorder:
            for name in names:
                getattr(dist, name)(out, inp)
        self.assertEqual(len(recorder.of(Collective.REDUCE_SCATTER)), len(names))
        self.assertEqual(out, torch.full((2,), float(self.world_size), device=self.device))

    def test_recorder_sees_coalesced_broadcasts(self):
        """DDP's constructor broadcasts the module's states through
        ``dist._broadcast_coalesced`` (as torch's FSDP does for
        ``sync_module_states``): one recorded broadcast per tensor, in order."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        module = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)).to(self.device)
        ids = [self.device.index] if self.device.type == "cuda" else None
        with CollectiveRecorder((Collective.BROADCAST,)) as recorder:
            DDP(module, device_ids=ids)
        states = [*module.parameters(), *module.buffers()]
        calls = recorder.of(Collective.BROADCAST)
        self.assertEqual([c.input_numel for c in calls], [t.numel() for t in states])
        self.assertEqual([c.input_dtype for c in calls], [t.dtype for t in states])
        self.assertEqual({c.group_size for c in calls}, {self.world_size})

    def test_recorder_sees_plain_broadcasts(self):
        t = torch.arange(3.0, device=self.device) * (self.rank + 1)
        with CollectiveRecorder((Collective.BROADCAST,)) as recorder:
            dist.broadcast(t, src=0)
        self.assertEqual(len(recorder.calls), 1)
        self.assertEqual(t, torch.arange(3.0, device=self.device))

    def test_patch_is_restored(self):
        before = {name: getattr(dist, name) for name in Collective.ALL_GATHER.names()}
        coalesced = dist._broadcast_coalesced
        with patch_reduce_scatter(functools.partial(current(Collective.REDUCE_SCATTER))):
            pass
        with CollectiveRecorder():
            pass
        self.assertEqual({n: getattr(dist, n) for n in before}, before)
        self.assertIs(dist._broadcast_coalesced, coalesced)


class TestSeedDtypeCheckSeesOurReduceScatter(FSDPTest):
    """The mixed-precision seed checks the dtype of every reduce-scatter input
    through ``patch_reduce_scatter``. With our FSDP deliberately reducing in
    ``param_dtype`` instead of ``reduce_dtype``, that check must fail."""

    def test_wrong_reduce_dtype_fails_the_seed_check(self) -> None:
        if not ADAPTER.is_project_fsdp:
            self.skipTest("patches this project's FlatParamHandle")
        from suites.test_mixed_precision import TestFSDPMixedPrecisionSharded

        suite = TestFSDPMixedPrecisionSharded.__new__(TestFSDPMixedPrecisionSharded)
        run = functools.partial(
            suite._run_test_mixed_precision_e2e,
            mp_config=MixedPrecision(torch.float16, torch.float32, torch.float16),
            cpu_offload=CPUOffload(offload_params=False),
            backward_prefetch=None,
            forward_prefetch=False,
            full_precision_param_dtype=torch.float32,
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            enable_sharded_grad_scaler=None,
        )
        run()  # the right path passes the check

        def param_dtype_instead(handle: FlatParamHandle) -> torch.dtype:
            return handle._fwd_bwd_param_dtype

        with mock.patch.object(FlatParamHandle, "reduce_dtype", param_dtype_instead):
            with self.assertRaisesRegex(
                AssertionError,
                "Expected to reduce in torch.float32 but got tensors in torch.float16",
            ):
                run()
