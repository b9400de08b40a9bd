"""Sharded state dicts of hybrid units with a 2-D device mesh (port of upstream
``test_hsdp_dtensor_state_dict.py``), and loading sharded state dicts across
wrappings and mesh shapes.

A ``HYBRID_SHARD`` unit over a ``(replicate, shard)`` mesh saves ``DTensor`` s
placed ``(Replicate(), Shard(0))`` on that mesh, holding what the same unit
built from the mesh's ``(shard group, replicate group)`` saves as
``ShardedTensor`` s (its rows chunked over the shard group), on the same device;
optimizer states likewise, ``step`` a plain tensor. Both load back after
``torch.save``/``torch.load``. A root that is not a unit, holding a hybrid unit
and modules that differ between ranks, saves DTensors for the unit's states and
plain tensors for the others. Upstream needs 4 GPUs; here 4 ranks (on the CPU
when there are fewer GPUs).

Loading across wrappings (facts of torch's FSDP found here, asserted for it):
ours loads a sharded model or optimizer state dict of any of the four wrappings
of the same model (no mesh, a 1-D mesh over the world, a 2-D hybrid mesh, the
hybrid groups as a pair) into any other, with the saved values. Torch's loads a
sharded model state dict only into a unit of the kind and mesh it was saved from
("The device mesh of a tensor should be a root mesh.", "Expected
ShardedTensor", "has no attribute 'device_mesh'"); ``ShardedTensor`` s chunked
over the whole world load into hybrid units without error but with the wrong
values, model states into units with a pair of groups and optimizer states
into either kind of hybrid unit (each shard group gathers its own ranks'
chunks, as if they were chunked over it).
Torch is not asked to load a pair's ``ShardedTensor`` s (chunked over 2 ranks)
into units sharded over 4: it all-gathers tensors of different sizes (gloo
refuses, NCCL may hang).
"""

from __future__ import annotations

import io
from copy import deepcopy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdptest import FSDPTest
from fsdptest.api import (
    ADAPTER,
    FSDP,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from harness import current_device

HYBRID_PLACEMENTS = (Replicate(), Shard(0))


_TORCH_DEFECTS = ADAPTER.known_defects.hybrid_sharded_state_dicts_across_wrappings
"""Torch's refusals and wrong loads of the module note."""


class DenseModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net1 = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.net2 = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.net3 = nn.Sequential(nn.Linear(32, 64), nn.ReLU())
        self.net4 = nn.Sequential(nn.ReLU(), nn.Linear(64, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net4(self.net3(self.net2(self.net1(x))))

    def get_input(self) -> torch.Tensor:
        return torch.rand(4, 8, device=current_device())


WRAPPINGS = ("no_mesh", "mesh_1d", "hybrid_mesh", "hybrid_groups")
_HYBRID = ("hybrid_mesh", "hybrid_groups")


class TestHSDPWithDeviceMeshAndDTensor(FSDPTest):
    world_size = 4

    def _wrap(self, wrapping: str, module: nn.Module | None = None) -> nn.Module:
        module = (module or DenseModel()).to(self.device)
        if wrapping == "no_mesh":
            return FSDP(module)
        if wrapping == "mesh_1d":
            return FSDP(module, device_mesh=init_device_mesh(self.device.type, (self.world_size,)))
        hybrid = ShardingStrategy.HYBRID_SHARD
        mesh_2d = init_device_mesh(self.device.type, (2, self.world_size // 2))
        if wrapping == "hybrid_mesh":
            return FSDP(module, device_mesh=mesh_2d, sharding_strategy=hybrid)
        groups = (mesh_2d.get_group(mesh_dim=1), mesh_2d.get_group(mesh_dim=0))
        return FSDP(module, process_group=groups, sharding_strategy=hybrid)

    def _trained(self, model: nn.Module) -> torch.optim.Optimizer:
        optim = torch.optim.Adam(model.parameters(), lr=0.1)
        model(model.get_input()).sum().backward()
        optim.step()
        return optim

    def _full_params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            return model.state_dict()

    def test_hsdp_init_with_device_mesh(self) -> None:
        """Model and optimizer values are DTensors replicated over mesh dimension 0
        and sharded by rows over dimension 1; the settings say ``_use_dtensor``."""
        mesh_2d = init_device_mesh(self.device.type, (2, self.world_size // 2))
        model = FSDP(
            DenseModel().to(self.device),
            device_mesh=mesh_2d,
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        )
        optim = self._trained(model)
        full = self._full_params(model)
        FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)
        for fqn, value in model.state_dict().items():
            self.assertEqual(type(value), DTensor)
            self.assertEqual(value.placements, HYBRID_PLACEMENTS)
            self.assertEqual(value.device_mesh, mesh_2d)
            chunk = torch.chunk(full[fqn], 2, dim=0)[mesh_2d.get_local_rank(1)]
            self.assertEqual(value.to_local(), chunk)
        for state in FSDP.optim_state_dict(model, optim)["state"].values():
            for name, value in state.items():
                if name != "step":
                    self.assertEqual(type(value), DTensor)
                    self.assertEqual(value.placements, HYBRID_PLACEMENTS)
                    self.assertEqual(value.device_mesh, mesh_2d)
        settings = FSDP.get_state_dict_type(model)
        self.assertEqual(settings.state_dict_config._use_dtensor, True)
        self.assertEqual(settings.optim_state_dict_config._use_dtensor, True)

    def test_dtensor_sharded_tensor_state_dict_identical(self) -> None:
        """A hybrid mesh's DTensor values hold what the hybrid pair of groups'
        ShardedTensor values hold, on the same device."""
        self.run_subtests(
            {"offload_to_cpu": [True, False]},
            self._test_dtensor_sharded_tensor_state_dict_identical,
        )

    def _test_dtensor_sharded_tensor_state_dict_identical(self, offload_to_cpu: bool) -> None:
        saved = []
        for wrapping in ("hybrid_mesh", "hybrid_groups"):
            model = self._wrap(wrapping)
            optim = self._trained(model)
            FSDP.set_state_dict_type(
                model,
                StateDictType.SHARDED_STATE_DICT,
                state_dict_config=ShardedStateDictConfig(offload_to_cpu=offload_to_cpu),
                optim_state_dict_config=ShardedOptimStateDictConfig(offload_to_cpu=offload_to_cpu),
            )
            saved.append((model.state_dict(), FSDP.optim_state_dict(model, optim)))
        (dtensor_sd, dtensor_osd), (sharded_sd, sharded_osd) = saved
        self.assertEqual(list(dtensor_sd), list(sharded_sd))
        for fqn, value in dtensor_sd.items():
            self._assert_same_local(value, sharded_sd[fqn])
        for fqn, state in dtensor_osd["state"].items():
            self.assertEqual(list(state), list(sharded_osd["state"][fqn]))
            for name, value in state.items():
                if name == "step":
                    self.assertEqual(value, sharded_osd["state"][fqn][name])
                else:
                    self._assert_same_local(value, sharded_osd["state"][fqn][name])

    def _assert_same_local(self, dtensor: Any, sharded: Any) -> None:
        self.assertEqual(type(dtensor), DTensor)
        self.assertEqual(type(sharded), ShardedTensor)
        self.assertEqual(dtensor.to_local(), sharded.local_tensor())
        self.assertEqual(dtensor.to_local().device, sharded.local_tensor().device)

    def test_dtensor_sharded_optim_load_state_dict(self) -> None:
        """A hybrid unit's sharded optimizer state dict loads back after ``torch.save``."""
        self.run_subtests(
            {"offload_to_cpu": [True, False]}, self._test_dtensor_sharded_optim_load_state_dict
        )

    def _test_dtensor_sharded_optim_load_state_dict(self, offload_to_cpu: bool) -> None:
        model = self._wrap("hybrid_mesh")
        optim = self._trained(model)
        config = ShardedOptimStateDictConfig(offload_to_cpu=offload_to_cpu)
        FSDP.set_state_dict_type(
            model, StateDictType.SHARDED_STATE_DICT, optim_state_dict_config=config
        )
        checkpoint = io.BytesIO()
        torch.save(FSDP.optim_state_dict(model, optim), checkpoint)
        ref_osd = deepcopy(FSDP.optim_state_dict(model, optim))
        model(model.get_input()).sum().backward()
        optim.step()
        checkpoint.seek(0)
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, torch.load(checkpoint)))
        new_osd = FSDP.optim_state_dict(model, optim)
        for fqn, state in new_osd["state"].items():
            for name, value in state.items():
                self.assertEqual(value, ref_osd["state"][fqn][name])
                if name != "step":
                    self.assertEqual(type(value), DTensor)

    def test_dtensor_sharded_model_load_state_dict(self) -> None:
        """A hybrid unit's sharded model state dict loads back after ``torch.save``."""
        self.run_subtests(
            {"offload_to_cpu": [True, False]}, self._test_dtensor_sharded_model_load_state_dict
        )

    def _test_dtensor_sharded_model_load_state_dict(self, offload_to_cpu: bool) -> None:
        model = self._wrap("hybrid_mesh")
        optim = self._trained(model)
        config = ShardedStateDictConfig(offload_to_cpu=offload_to_cpu)
        FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT, state_dict_config=config)
        checkpoint = io.BytesIO()
        torch.save(model.state_dict(), checkpoint)
        ref_state_dict = deepcopy(model.state_dict())
        model(model.get_input()).sum().backward()
        optim.step()
        checkpoint.seek(0)
        model.load_state_dict(torch.load(checkpoint))
        for fqn, value in model.state_dict().items():
            self.assertEqual(type(value), DTensor)
            self.assertEqual(value, ref_state_dict[fqn])

    def test_root_module_is_not_FSDP(self) -> None:
        """Under a root that is not a unit, with modules that differ between ranks,
        the hybrid unit's optimizer states are DTensors and the others' plain."""
        mesh_2d = init_device_mesh(self.device.type, (2, self.world_size // 2))
        model = _FakeMPModel(mesh_2d).to(self.device)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        model(torch.rand(5, 8, device=self.device)).sum().backward()
        optim.step()
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            osd = FSDP.optim_state_dict(model, optim, optim.state_dict())
        own_sparse = "sparse0" if self.rank == 0 else "sparse1"
        self.assertEqual({fqn.split(".")[0] for fqn in osd["state"]}, {"dense", own_sparse})
        for fqn, state in osd["state"].items():
            for name in ("exp_avg", "exp_avg_sq"):
                if fqn.startswith("dense."):
                    self.assertIsInstance(state[name], DTensor)
                    self.assertEqual(state[name].placements, HYBRID_PLACEMENTS)
                else:
                    self.assertEqual(type(state[name]), torch.Tensor)

    def test_sharded_state_dicts_load_across_wrappings(self) -> None:
        """A sharded model and optimizer state dict of each wrapping loads into
        each other wrapping with the saved values (torch's: see the module note)."""
        self.run_subtests(
            {"source": list(WRAPPINGS), "target": list(WRAPPINGS)},
            self._test_sharded_state_dicts_load_across_wrappings,
        )

    def _test_sharded_state_dicts_load_across_wrappings(self, source: str, target: str) -> None:
        if _TORCH_DEFECTS and source == "hybrid_groups" and target != "hybrid_groups":
            self.skipTest(
                "torch's FSDP all-gathers ShardedTensors chunked over 2 ranks as if over its "
                "own group of 4 (tensors of different sizes: gloo refuses, NCCL may hang)"
            )
        saved_model = self._wrap(source)
        saved_optim = self._trained(saved_model)
        with FSDP.state_dict_type(saved_model, StateDictType.SHARDED_STATE_DICT):
            state_dict, osd = (
                saved_model.state_dict(),
                FSDP.optim_state_dict(saved_model, saved_optim),
            )
        model = self._wrap(target)
        optim = self._trained(model)
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, osd))
            loaded = self._load_model(model, state_dict, source, target)
        self.assertEqual(
            optim.state_dict()["state"].keys(), saved_optim.state_dict()["state"].keys()
        )
        if loaded:
            self.assertEqual(self._full_params(model), self._full_params(saved_model))
        torch_gathers_wrongly = _TORCH_DEFECTS and source == "no_mesh" and target in _HYBRID
        self._assert_optim_states(model, optim, saved_model, saved_optim, not torch_gathers_wrongly)

    def _load_model(
        self, model: nn.Module, state_dict: dict[str, Any], source: str, target: str
    ) -> bool:
        """Loads ``state_dict`` into ``model``; returns whether the values must match
        (asserting torch's refusals and its wrong load)."""
        torch_refusal = _torch_model_refusal(source, target) if _TORCH_DEFECTS else None
        if torch_refusal is not None:
            error, message = torch_refusal
            with self.assertRaisesRegex(error, message):
                model.load_state_dict(state_dict)
            return False
        model.load_state_dict(state_dict)
        if _TORCH_DEFECTS and source == "no_mesh" and target == "hybrid_groups":
            self._assert_torch_loaded_wrong_values(model, state_dict)
            return False
        return True

    def _assert_torch_loaded_wrong_values(
        self, model: nn.Module, state_dict: dict[str, Any]
    ) -> None:
        """Torch's FSDP loads the whole world's ShardedTensors into a pair of hybrid
        groups without error, but each shard group gathers its own ranks' chunks."""
        saved = {fqn: _gather_sharded(value) for fqn, value in state_dict.items()}
        loaded = self._full_params(model)
        self.assertTrue(any(not torch.equal(loaded[k].cpu(), saved[k].cpu()) for k in saved))

    def _assert_optim_states(
        self,
        model: nn.Module,
        optim: torch.optim.Optimizer,
        saved_model: nn.Module,
        saved_optim: torch.optim.Optimizer,
        equal: bool,
    ) -> None:
        """The loading optimizer holds the saved states (or, where torch's FSDP
        gathers wrongly, does not): compared as full optimizer state dicts (every
        wrapping has the same parameter names)."""
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            loaded = FSDP.optim_state_dict(model, optim)["state"]
        with FSDP.state_dict_type(saved_model, StateDictType.FULL_STATE_DICT):
            saved = FSDP.optim_state_dict(saved_model, saved_optim)["state"]
        if equal:
            self.assertEqual(loaded, saved)
            return
        self.assertEqual(loaded.keys(), saved.keys())
        differs = [not torch.equal(loaded[k]["exp_avg"], saved[k]["exp_avg"]) for k in saved]
        self.assertTrue(any(differs))


def _torch_model_refusal(source: str, target: str) -> tuple[type[Exception], str] | None:
    """How torch's FSDP refuses a sharded model state dict of ``source`` in a
    unit of ``target``, or None where it loads it (see the module note)."""
    if source == target:
        return None
    meshes = {"mesh_1d", "hybrid_mesh"}
    if source in meshes and target in meshes:
        return AssertionError, "The device mesh of a tensor should be a root mesh."
    if source in meshes:
        return AssertionError, "Expected ShardedTensor, got"
    if target in meshes:
        return AttributeError, "has no attribute 'device_mesh'"
    return None


def _gather_sharded(value: ShardedTensor) -> torch.Tensor:
    """The full tensor of a ShardedTensor chunked by rows over the world."""
    local = value.local_tensor() if value.local_shards() else None
    rows = -(-value.shape[0] // dist.get_world_size())
    chunk = torch.zeros((rows, *value.shape[1:]), dtype=value.dtype, device=current_device())
    if local is not None:
        chunk[: local.shape[0]].copy_(local)
    gathered = [torch.empty_like(chunk) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, chunk)
    return torch.cat(gathered)[: value.shape[0]]


class _FakeMPModel(nn.Module):
    """A hybrid unit under a plain root, after a module that only rank 0 has
    (``sparse0``) or only the others have (``sparse1``), summed over ranks."""

    def __init__(self, device_mesh: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = FSDP(
            DenseModel().to(current_device()),
            use_orig_params=True,
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
            device_mesh=device_mesh,
        )
        if dist.get_rank() == 0:
            self.sparse0 = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        else:
            self.sparse1 = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sparse = self.sparse0(x) if dist.get_rank() == 0 else self.sparse1(x)
        dist.all_reduce(sparse)
        return self.dense(sparse)
