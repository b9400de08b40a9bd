"""Sharded state dicts of units with a 1-D device mesh (port of upstream
``test_fsdp_dtensor_state_dict.py``).

With ``device_mesh``, ``SHARDED_STATE_DICT`` values are ``DTensor`` s instead of
``ShardedTensor`` s (torch sets the configs' ``_use_dtensor``): ``Shard(0)`` on
the unit's mesh, each rank's local tensor its ``torch.chunk`` of the full
parameter (empty beyond the number of chunks), the same tensor a
``ShardedTensor`` holds, on the same device (the CPU with ``offload_to_cpu``);
optimizer states likewise, ``step`` staying a plain tensor. Both survive
``torch.save``/``torch.load`` (weights only) and load back.
``LOCAL_STATE_DICT`` is refused, and so is a full state dict's plain tensors
loaded under ``SHARDED_STATE_DICT``. Upstream runs with 4 ranks (or one per GPU);
here 2, so that two GPUs run it on NCCL, with a one-row layer that leaves rank 1
an empty chunk (upstream's uneven model leaves rank 3 one at 4 ranks).

Also asserted (facts of torch's FSDP, found here): when ``_use_dtensor`` becomes
True (see [Note: _use_dtensor follows the device mesh] in ``fsdp._state_dict.settings``),
and which values load into which wrapping: ours loads a sharded model state
dict of either kind into either wrapping; torch's loads only the kind it saves
(a ``ShardedTensor`` into a unit with a mesh fails with ``AttributeError``, a
``DTensor`` into one without with ``AssertionError``). Both load sharded
optimizer state dicts of either kind.
"""

from __future__ import annotations

import io
from copy import deepcopy
from typing import Any

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from fsdptest import FSDPTest
from fsdptest.api import (
    ADAPTER,
    FSDP,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictType,
)
from harness import current_device

_LOCAL_WITH_MESH = "DeviceMesh is not compatible with LOCAL_STATE_DICT."


class DummyModel(nn.Module):
    """Upstream's even model: every parameter has at least 2 rows."""

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
        return torch.rand(8, 8, device=current_device())


class DummyModelUneven(nn.Module):
    """Upstream's uneven model (odd sizes), ending in a one-row layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net1 = nn.Sequential(nn.Linear(5, 10), nn.ReLU())
        self.net2 = nn.Sequential(nn.Linear(10, 15), nn.ReLU())
        self.net3 = nn.Linear(15, 30)
        self.net4 = nn.Sequential(nn.ReLU(), nn.Linear(30, 5))
        self.net5 = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net5(self.net4(self.net3(self.net2(self.net1(x)))))

    def get_input(self) -> torch.Tensor:
        return torch.rand(5, 5, device=current_device())


def _local(value: Any) -> torch.Tensor:
    """A sharded value's local tensor (an empty one where the rank holds nothing)."""
    if isinstance(value, DTensor):
        return value.to_local()
    assert isinstance(value, ShardedTensor), type(value)
    shards = value.local_shards()
    return shards[0].tensor if shards else torch.empty(0)


class TestFSDPWithDeviceMeshAndDTensor(FSDPTest):
    world_size = 2

    def _mesh(self) -> DeviceMesh:
        return init_device_mesh(self.device.type, (self.world_size,))

    def _create_model(
        self, is_even_sharded_model: bool, device_mesh: DeviceMesh | None = None
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        module = DummyModel() if is_even_sharded_model else DummyModelUneven()
        model = FSDP(module.to(self.device), device_mesh=device_mesh)
        optim = torch.optim.Adam(model.parameters(), lr=0.1)
        model(model.get_input()).sum().backward()
        optim.step()
        return model, optim

    def _full_params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            return model.state_dict()

    def test_fsdp_init_with_device_mesh(self) -> None:
        """Model and optimizer values are DTensors sharded by rows over the mesh,
        and the state-dict settings say ``_use_dtensor``."""
        self.run_subtests(
            {"is_even_sharded_model": [True, False]}, self._test_fsdp_init_with_device_mesh
        )

    def _test_fsdp_init_with_device_mesh(self, is_even_sharded_model: bool) -> None:
        device_mesh = self._mesh()
        model, optim = self._create_model(is_even_sharded_model, device_mesh)
        full = self._full_params(model)
        FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)
        state_dict = model.state_dict()
        optim_state_dict = FSDP.optim_state_dict(model, optim)
        self.assertEqual(list(state_dict), list(full))
        for fqn, value in state_dict.items():
            self.assertEqual(type(value), DTensor)
            self.assertEqual(value.placements, (Shard(0),))
            self.assertEqual(value.device_mesh, device_mesh)
            self.assertEqual(value.shape, full[fqn].shape)
            self._assert_chunk(value.to_local(), full[fqn])
        for state in optim_state_dict["state"].values():
            for name, value in state.items():
                if name == "step":
                    self.assertEqual(type(value), torch.Tensor)
                    continue
                self.assertEqual(type(value), DTensor)
                self.assertEqual(value.placements, (Shard(0),))
                self.assertEqual(value.device_mesh, device_mesh)
        settings = FSDP.get_state_dict_type(model)
        self.assertEqual(settings.state_dict_config._use_dtensor, True)
        self.assertEqual(settings.optim_state_dict_config._use_dtensor, True)

    def _assert_chunk(self, local: torch.Tensor, full: torch.Tensor) -> None:
        chunks = torch.chunk(full, self.world_size, dim=0)
        if self.rank < len(chunks):
            self.assertEqual(local.cpu(), chunks[self.rank].cpu())
        else:
            self.assertEqual(local.numel(), 0)

    def test_use_dtensor_follows_the_mesh(self) -> None:
        """``get_state_dict_type`` sets the optimizer config's ``_use_dtensor``; the
        model config's becomes True at the first save and stays until new
        settings replace the config."""
        model, _ = self._create_model(True, self._mesh())
        FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)
        settings = FSDP.get_state_dict_type(model)
        self.assertEqual(settings.state_dict_config._use_dtensor, False)
        self.assertEqual(settings.optim_state_dict_config._use_dtensor, True)
        model.state_dict()
        self.assertEqual(FSDP.get_state_dict_type(model).state_dict_config._use_dtensor, True)
        FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig())
        self.assertEqual(FSDP.get_state_dict_type(model).state_dict_config._use_dtensor, False)

    def test_dtensor_sharded_tensor_state_dict_identical(self) -> None:
        """A mesh's DTensor values hold what a group's ShardedTensor values hold,
        on the same device, for the model and the optimizer."""
        self.run_subtests(
            {"offload_to_cpu": [True, False], "is_even_sharded_model": [True, False]},
            self._test_dtensor_sharded_tensor_state_dict_identical,
        )

    def _test_dtensor_sharded_tensor_state_dict_identical(
        self, offload_to_cpu: bool, is_even_sharded_model: bool
    ) -> None:
        saved = []
        for device_mesh in (self._mesh(), None):
            model, optim = self._create_model(is_even_sharded_model, device_mesh)
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
            self._assert_same_local(value, sharded_sd[fqn], offload_to_cpu)
        self.assertEqual(list(dtensor_osd["state"]), list(sharded_osd["state"]))
        for fqn, state in dtensor_osd["state"].items():
            self.assertEqual(list(state), list(sharded_osd["state"][fqn]))
            for name, value in state.items():
                if name == "step":
                    self.assertEqual(value, sharded_osd["state"][fqn][name])
                else:
                    self._assert_same_local(value, sharded_osd["state"][fqn][name], offload_to_cpu)

    def _assert_same_local(self, dtensor: Any, sharded: Any, on_cpu: bool) -> None:
        self.assertEqual(type(dtensor), DTensor)
        self.assertEqual(type(sharded), ShardedTensor)
        local = _local(sharded)
        if not sharded.local_shards():
            self.assertEqual(dtensor.to_local().numel(), 0)
            return
        self.assertEqual(dtensor.to_local(), local)
        self.assertEqual(dtensor.to_local().device, local.device)
        self.assertEqual(local.device.type, "cpu" if on_cpu else self.device.type)

    def test_dtensor_sharded_optim_load_state_dict(self) -> None:
        """A sharded optimizer state dict saved with ``torch.save`` loads back
        (``torch.load`` with weights only): the optimizer's state is what was saved."""
        self.run_subtests(
            {"offload_to_cpu": [True, False], "is_even_sharded_model": [True, False]},
            self._test_dtensor_sharded_optim_load_state_dict,
        )

    def _test_dtensor_sharded_optim_load_state_dict(
        self, offload_to_cpu: bool, is_even_sharded_model: bool
    ) -> None:
        model, optim = self._create_model(is_even_sharded_model, self._mesh())
        FSDP.set_state_dict_type(
            model,
            StateDictType.SHARDED_STATE_DICT,
            optim_state_dict_config=ShardedOptimStateDictConfig(offload_to_cpu=offload_to_cpu),
        )
        checkpoint = io.BytesIO()
        torch.save(FSDP.optim_state_dict(model, optim), checkpoint)
        ref_osd = deepcopy(FSDP.optim_state_dict(model, optim))
        model(model.get_input()).sum().backward()
        optim.step()
        checkpoint.seek(0)
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, torch.load(checkpoint)))
        new_osd = FSDP.optim_state_dict(model, optim)
        self.assertEqual(list(new_osd["state"]), list(ref_osd["state"]))
        for fqn, state in new_osd["state"].items():
            self.assertEqual(list(state), list(ref_osd["state"][fqn]))
            for name, value in state.items():
                ref = ref_osd["state"][fqn][name]
                self.assertEqual(value, ref)
                if name != "step":
                    self.assertEqual(type(value), DTensor)
                    self.assertEqual(type(ref), DTensor)

    def test_dtensor_sharded_model_load_state_dict(self) -> None:
        """A sharded model state dict saved with ``torch.save`` loads back: the
        parameters are what was saved."""
        self.run_subtests(
            {"offload_to_cpu": [True, False], "is_even_sharded_model": [True, False]},
            self._test_dtensor_sharded_model_load_state_dict,
        )

    def _test_dtensor_sharded_model_load_state_dict(
        self, offload_to_cpu: bool, is_even_sharded_model: bool
    ) -> None:
        model, optim = self._create_model(is_even_sharded_model, self._mesh())
        FSDP.set_state_dict_type(
            model,
            StateDictType.SHARDED_STATE_DICT,
            state_dict_config=ShardedStateDictConfig(offload_to_cpu=offload_to_cpu),
        )
        checkpoint = io.BytesIO()
        torch.save(model.state_dict(), checkpoint)
        ref_state_dict = deepcopy(model.state_dict())
        model(model.get_input()).sum().backward()
        optim.step()
        checkpoint.seek(0)
        model.load_state_dict(torch.load(checkpoint))
        new_state_dict = model.state_dict()
        self.assertEqual(list(new_state_dict), list(ref_state_dict))
        for fqn, value in new_state_dict.items():
            self.assertEqual(type(value), DTensor)
            self.assertEqual(type(ref_state_dict[fqn]), DTensor)
            self.assertEqual(value, ref_state_dict[fqn])

    def test_raises_warning_or_errors(self) -> None:
        """``LOCAL_STATE_DICT`` with a device mesh is refused for saving and loading
        the model and for the optimizer state dict."""
        model, optim = self._create_model(True, self._mesh())
        local_state_dict = model.state_dict()  # FULL_STATE_DICT: the default type
        with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            with self.assertRaisesRegex(RuntimeError, _LOCAL_WITH_MESH):
                model.state_dict()
            with self.assertRaisesRegex(RuntimeError, _LOCAL_WITH_MESH):
                model.load_state_dict(local_state_dict)
            with self.assertRaisesRegex(RuntimeError, _LOCAL_WITH_MESH):
                FSDP.optim_state_dict(model, optim)

    def test_a_full_state_dict_is_refused_under_sharded(self) -> None:
        """A FULL_STATE_DICT (plain tensors) loaded while SHARDED_STATE_DICT is in
        effect is refused on every rank, with or without a mesh, whether the type
        was entered as a context or set (set inside a summon, it outlives the
        summon). Without a mesh both raise torch's "Expected ShardedTensor"; with
        one torch's gather fails on the plain tensor (AttributeError), ours names
        the key and the DTensor it expected. The parameters are left as they were."""
        self.run_subtests(
            {"with_mesh": [True, False], "set_in_summon": [True, False]},
            self._test_a_full_state_dict_is_refused_under_sharded,
        )

    def _test_a_full_state_dict_is_refused_under_sharded(
        self, with_mesh: bool, set_in_summon: bool
    ) -> None:
        model, _ = self._create_model(False, self._mesh() if with_mesh else None)
        full = model.state_dict()  # FULL_STATE_DICT: the default type
        edited = {key: value + 1 for key, value in full.items()}
        if set_in_summon:
            with FSDP.summon_full_params(model):
                FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)
        else:
            FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)
        expected = (AssertionError, "^Expected ShardedTensor, got <class 'torch.Tensor'>$")
        if with_mesh:
            torch_impl = ADAPTER.known_defects.refuses_sharded_load_across_meshes
            expected = (
                (AttributeError, "has no attribute 'device_mesh'")
                if torch_impl
                else (AssertionError, "^Expected DTensor, got <class 'torch.Tensor'> for 'net")
            )
        with self.assertRaisesRegex(*expected):
            model.load_state_dict(edited)
        FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT)
        self.assertEqual(self._full_params(model), full)

    def test_sharded_state_dicts_load_into_the_other_kind(self) -> None:
        """A sharded model state dict of a mesh's unit (DTensor) loads into a
        group's unit (ShardedTensor) and the other way round under ours, with the
        saved values; torch's refuses both. Sharded optimizer state dicts load
        either way under both."""
        self.run_subtests(
            {"save_with_mesh": [True, False], "load_with_mesh": [True, False]},
            self._test_sharded_state_dicts_load_into_the_other_kind,
        )

    def _test_sharded_state_dicts_load_into_the_other_kind(
        self, save_with_mesh: bool, load_with_mesh: bool
    ) -> None:
        source, source_optim = self._create_model(False, self._mesh() if save_with_mesh else None)
        target, target_optim = self._create_model(False, self._mesh() if load_with_mesh else None)
        with FSDP.state_dict_type(source, StateDictType.SHARDED_STATE_DICT):
            state_dict = source.state_dict()
            osd = FSDP.optim_state_dict(source, source_optim)
        with FSDP.state_dict_type(target, StateDictType.SHARDED_STATE_DICT):
            target_optim.load_state_dict(FSDP.optim_state_dict_to_load(target, target_optim, osd))
            if (
                ADAPTER.known_defects.refuses_sharded_load_across_meshes
                and save_with_mesh != load_with_mesh
            ):
                self._assert_torch_refuses(target, state_dict, save_with_mesh)
            else:
                target.load_state_dict(state_dict)
                self.assertEqual(self._full_params(target), self._full_params(source))
        self.assertEqual(target_optim.state_dict()["state"], source_optim.state_dict()["state"])

    def _assert_torch_refuses(
        self, target: nn.Module, state_dict: dict[str, Any], saved_with_mesh: bool
    ) -> None:
        if saved_with_mesh:
            with self.assertRaisesRegex(AssertionError, "Expected ShardedTensor, got"):
                target.load_state_dict(state_dict)
        else:
            with self.assertRaisesRegex(AttributeError, "has no attribute 'device_mesh'"):
                target.load_state_dict(state_dict)
