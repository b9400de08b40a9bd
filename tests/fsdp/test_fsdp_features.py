"""Our FSDP (and torch's, with --fsdp-impl torch) against DDP on a small model:
every strategy x original parameters x offload x prefetch, state-dict round
trips of every type, summon_full_params(with_grads) and hybrid sharding;
optimizer state dicts beyond the upstream suite (DTensor values, a sharded dict
into another wrapping) and the object collectives of ``fsdp._comm``."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp import _comm
from fsdptest import FSDPTest
from fsdptest.api import (
    ADAPTER,
    FSDP,
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from harness import current_device


def _needs_numpy_under_torch(test: Callable[..., None]) -> Callable[..., None]:
    """Torch's FSDP sends optimizer state-dict keys with object collectives, which
    unpickle through numpy (see suites/test_fsdp_optim_state.py); ours need none."""
    if not ADAPTER.limitations.optim_keys_need_numpy:
        return test
    reason = "torch's FSDP sends optimizer state-dict keys with object collectives"
    return pytest.mark.requires_module("numpy", reason=reason)(test)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3), nn.Linear(3, 4)).to(
        current_device()
    )


def _ddp(module: nn.Module) -> DDP:
    device = current_device()
    return DDP(module, device_ids=[device.index]) if device.type == "cuda" else DDP(module)


class TestParityMatrix(FSDPTest):
    @pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
    @pytest.mark.parametrize("use_orig_params", [False, True])
    @pytest.mark.parametrize("offload", [False, True])
    @pytest.mark.parametrize("prefetch", [None, "BACKWARD_PRE", "BACKWARD_POST"])
    def test_four_steps_match_ddp(self, strategy, use_orig_params, offload, prefetch):
        """Losses equal every step, full parameters equal at the end, and the
        full state dict has DDP's keys."""
        reference = _ddp(_model())
        model = FSDP(
            _model().cpu() if offload else _model(),
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            sharding_strategy=ShardingStrategy[strategy],
            use_orig_params=use_orig_params,
            cpu_offload=CPUOffload(offload),
            backward_prefetch=BackwardPrefetch[prefetch] if prefetch else None,
            forward_prefetch=True,
        )
        optims = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (reference, model)]
        torch.manual_seed(1 + self.rank)
        for step in range(4):
            x = torch.randn(6, 5, device=current_device())
            losses = []
            for m, optim in zip((reference, model), optims):
                loss = m(x).sum()
                loss.backward()
                optim.step()
                optim.zero_grad(set_to_none=step % 2 == 0)
                losses.append(loss)
            # same math in fp32 on two ranks: exact
            self.assertEqual(losses[0], losses[1], rtol=0, atol=0)
        with FSDP.summon_full_params(model):
            for (n1, p1), (n2, p2) in zip(
                reference.module.named_parameters(), model.named_parameters()
            ):
                self.assertEqual(n1, n2)
                self.assertEqual(p1, p2, rtol=0, atol=0)
        self.assertEqual(sorted(model.state_dict()), sorted(reference.module.state_dict()))


class TestStateDictRoundTrip(FSDPTest):
    @pytest.mark.parametrize("kind", list(StateDictType), ids=lambda k: k.name)
    @pytest.mark.parametrize("use_orig_params", [False, True])
    def test_load_restores_saved_values(self, kind, use_orig_params):
        """Save, change every parameter, load strictly: the saved values are back.
        (Torch's FSDP leaves a local state dict's flat parameters unexpected with
        use_orig_params, so only a non-strict load succeeds there.)"""
        local_orig = (
            ADAPTER.known_defects.local_state_dict_keeps_flat_param_key
            and kind is StateDictType.LOCAL_STATE_DICT
            and use_orig_params
        )
        model = FSDP(
            _model(),
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            use_orig_params=use_orig_params,
            mixed_precision=MixedPrecision(param_dtype=torch.float16),
        )
        model(torch.randn(4, 5, device=current_device())).sum().backward()
        with FSDP.summon_full_params(model):
            saved_values = [p.detach().clone() for p in model.parameters()]
        with FSDP.state_dict_type(model, kind):
            state = copy.deepcopy(model.state_dict())  # entries may alias the parameters
            with FSDP.summon_full_params(model), torch.no_grad():
                for param in model.parameters():
                    param.add_(1.0)
            if local_orig:
                with self.assertRaisesRegex(RuntimeError, 'Unexpected key.*"0._flat_param"'):
                    model.load_state_dict(state)
            result = model.load_state_dict(state, strict=not local_orig)
        unexpected = ["0._flat_param", "2._flat_param", "3._flat_param"] if local_orig else []
        self.assertEqual(sorted(result.unexpected_keys), unexpected)
        with FSDP.summon_full_params(model):
            self.assertEqual([p.detach() for p in model.parameters()], saved_values)


class TestMisc(FSDPTest):
    def test_summon_with_grads_shows_ddp_gradients(self):
        reference = _ddp(_model())
        model = FSDP(_model(), use_orig_params=True)
        torch.manual_seed(self.rank)
        x = torch.randn(4, 5, device=current_device())
        reference(x).sum().backward()
        model(x).sum().backward()
        with FSDP.summon_full_params(model, with_grads=True):
            for p1, p2 in zip(reference.parameters(), model.parameters()):
                self.assertEqual(p1.grad, p2.grad)
        for param in model.parameters():
            self.assertTrue(param.grad is None or param.grad.shape == param.shape)

    @pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"])
    def test_hybrid_matches_ddp(self, strategy):
        """Sharded over the world, one replica per rank group of one."""
        replicate = [dist.new_group([r]) for r in range(self.world_size)][self.rank]
        reference = _ddp(_model())
        model = FSDP(
            _model(),
            process_group=(self.process_group, replicate),
            sharding_strategy=ShardingStrategy[strategy],
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        )
        optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
        torch.manual_seed(self.rank)
        for _ in range(3):
            x = torch.randn(4, 5, device=current_device())
            losses = []
            for m, optim in zip((reference, model), optims):
                loss = m(x).sum()
                loss.backward()
                optim.step()
                optim.zero_grad()
                losses.append(loss)
            self.assertEqual(losses[0], losses[1])


class TestCompile(FSDPTest):
    @pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
    def test_compiled_model_matches_eager(self, strategy):
        """torch.compile compiles the modules; FSDP's hooks run eagerly (aot_eager
        backend, so this runs on the CPU too; the seed's test_fsdp_compile uses
        Inductor on GPUs)."""
        torch.manual_seed(0)
        kwargs = {
            "auto_wrap_policy": ModuleWrapPolicy({nn.Linear}),
            "use_orig_params": True,
            "sharding_strategy": ShardingStrategy[strategy],
        }
        eager = FSDP(_model(), **kwargs)
        compiled = torch.compile(FSDP(_model(), **kwargs), backend="aot_eager")
        optims = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (eager, compiled)]
        for _ in range(4):
            x = torch.randn(3, 5, device=current_device())
            losses = []
            for m, optim in zip((eager, compiled), optims):
                optim.zero_grad()
                loss = m(x).sum()
                loss.backward()
                optim.step()
                losses.append(loss)
            self.assertEqual(losses[0], losses[1])


def _trained(model: nn.Module) -> torch.optim.Optimizer:
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(2):
        model(torch.randn(4, 5, device=current_device())).sum().backward()
        optim.step()
    return optim


def _sharded_settings(use_dtensor: bool) -> tuple[object, ...]:
    optim_config = ShardedOptimStateDictConfig(_use_dtensor=use_dtensor)
    return StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), optim_config


class TestOptimStateDict(FSDPTest):
    @_needs_numpy_under_torch
    @pytest.mark.parametrize("use_orig_params", [False, True])
    def test_sharded_dtensor_values_round_trip(self, use_orig_params):
        """``_use_dtensor``: each tensor state of a unit's parameter is a DTensor of
        its rows (Shard(0) over the unit's mesh), and loads back into the local state.
        Torch's FSDP needs a device mesh for DTensor values."""
        mesh = init_device_mesh(current_device().type, (self.world_size,))
        model = FSDP(_model(), device_mesh=mesh, use_orig_params=use_orig_params)
        optim = _trained(model)
        FSDP.set_state_dict_type(model, *_sharded_settings(use_dtensor=True))
        osd = FSDP.optim_state_dict(model, optim)
        for state in osd["state"].values():
            self.assertIsInstance(state["exp_avg"], DTensor)
            self.assertEqual(state["exp_avg"].placements, (Shard(0),))
            # offload_to_cpu (the default) puts the DTensor's rows on the CPU, as torch's
            # FSDP does; gathering them runs on the mesh's device (NCCL has no CPU).
            rows = state["exp_avg"].to(mesh.device_type)
            self.assertEqual(state["exp_avg"].shape, rows.full_tensor().shape)
        self.assertEqual(FSDP.optim_state_dict_to_load(model, optim, osd), optim.state_dict())

    @_needs_numpy_under_torch
    def test_sharded_dict_loads_into_another_wrapping(self):
        """A sharded dict of a model whose units differ from the loading model's:
        states of parameters outside the loading model's units are gathered too, so
        the result is the loading model's own local state (trained the same way)."""
        source = _model()
        source[0] = FSDP(source[0])
        osd = FSDP.sharded_optim_state_dict(source, _trained(source))
        target = _model()
        target[2] = FSDP(target[2])
        target_optim = _trained(target)
        loaded = FSDP.flatten_sharded_optim_state_dict(osd, target, target_optim)
        if ADAPTER.known_defects.flatten_keeps_unwrapped_sharded_tensors:
            # Torch's FSDP copies the states of parameters outside every unit as they
            # are: the first layer's stay ShardedTensors, which no optimizer loads.
            self.assertIsInstance(loaded["state"][0]["exp_avg"], ShardedTensor)
            return
        self.assertEqual(loaded, target_optim.state_dict())
        target_optim.load_state_dict(loaded)


class TestObjectCollectives(FSDPTest):
    def test_objects_reach_every_rank(self):
        """``fsdp._comm``'s object collectives (pickled bytes in tensors, no numpy)."""
        group, device = self.process_group, current_device()
        mine = {"rank": self.rank, "payload": list(range(self.rank * 100))}
        gathered = _comm.all_gather_object(mine, group, device)
        expected = [{"rank": r, "payload": list(range(r * 100))} for r in range(self.world_size)]
        self.assertEqual(gathered, expected)
        received = _comm.broadcast_object(mine if self.rank == 0 else None, 0, group, device)
        self.assertEqual(received, expected[0])
