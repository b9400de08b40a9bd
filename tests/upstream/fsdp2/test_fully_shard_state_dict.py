# An FSDP2 test file in the style of upstream's
# test/distributed/_composable/fsdp/test_fully_shard_state_dict.py, written for this
# project. Only its imports differ from a file written against torch.testing._internal;
# each says what it replaces. It names its device "cuda" and counts GPUs: on CPU ranks
# it runs under --map-cuda-to-cpu (the folder's conftest).

import copy
import functools
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fsdptest.api import CPUOffloadPolicy, FSDPModule, fully_shard  # torch.distributed.fsdp
from upstream.common_distributed import skip_if_lt_x_gpu  # ..._internal.common_distributed
from upstream.common_fsdp import MLP, FSDPTest, MLPStack  # ..._internal.common_fsdp
from upstream.common_utils import run_tests  # torch.testing._internal.common_utils


class TestFullyShardStateDictMultiProcess(FSDPTest):
    @property
    def world_size(self) -> int:
        return min(4, torch.cuda.device_count())

    @skip_if_lt_x_gpu(2)
    def test_dp_state_dict_save_load(self):
        fsdp_mesh = init_device_mesh("cuda", (self.world_size,))
        self.run_subtests(
            {"mlp_dim": [2, 3, 4, 5], "mesh": [fsdp_mesh]},
            self._test_dp_state_dict_save_load,
        )
        self.run_subtests(
            {"mlp_dim": [16], "mesh": [fsdp_mesh], "use_shard_placement_fn": [True]},
            self._test_dp_state_dict_save_load,
        )
        if self.world_size % 2 != 0:
            return
        hsdp_mesh = init_device_mesh(
            "cuda", (self.world_size // 2, 2), mesh_dim_names=("dp_replicate", "dp_shard")
        )
        self.run_subtests(
            {"mlp_dim": [2, 3, 4, 5], "mesh": [hsdp_mesh]},
            self._test_dp_state_dict_save_load,
        )

    def _test_dp_state_dict_save_load(self, mlp_dim, mesh, use_shard_placement_fn=False):
        torch.manual_seed(42)
        base_model = nn.Sequential(
            MLP(mlp_dim), nn.Sequential(MLP(mlp_dim), nn.Linear(mlp_dim, mlp_dim)), MLP(mlp_dim)
        )

        def _shard_placement_fn(param: nn.Parameter):
            largest_dim = max(range(param.ndim), key=lambda d: param.shape[d])
            return Shard(largest_dim)

        shard_placement_fn = _shard_placement_fn if use_shard_placement_fn else None
        fully_shard_fn = functools.partial(
            fully_shard, mesh=mesh, shard_placement_fn=shard_placement_fn
        )
        # Resharding after forward or not, and the root's not, must not change the state dict
        model1 = copy.deepcopy(base_model)
        for module in model1:
            fully_shard_fn(module)
        fully_shard_fn(model1, reshard_after_forward=False)
        model2 = copy.deepcopy(base_model)
        for module in model2:
            fully_shard_fn(module, reshard_after_forward=False)
        fully_shard_fn(model2, reshard_after_forward=False)
        self._test_state_dict_save_load(model1)
        self._test_state_dict_save_load(model2)

    def _test_state_dict_save_load(self, model: nn.Module):
        for param_name, param in model.named_parameters():
            self.assertIsInstance(param, DTensor, f"{param_name} should be a DTensor")
        # The state dict holds the sharded parameters, also while unsharded after forward
        state_dict = model.state_dict()
        for param_name, param in model.named_parameters():
            self.assertEqual(param.to_local(), state_dict[param_name].to_local())
        inp = torch.randn((2, next(model.parameters()).shape[-1]), device="cuda")
        model(inp)
        state_dict = model.state_dict()
        for param_name, _ in model.named_parameters():
            self.assertIsInstance(state_dict[param_name], DTensor, param_name)
        # Loading new values (distributed full tensors) into the model
        new_full = {
            name: torch.randn_like(value.full_tensor()) for name, value in state_dict.items()
        }
        for tensor in new_full.values():
            dist.broadcast(tensor, src=0)
        new_state_dict = {
            name: distribute_tensor(
                new_full[name], state_dict[name].device_mesh, state_dict[name].placements
            )
            for name in state_dict
        }
        model.load_state_dict(new_state_dict, assign=True)
        for param_name, param in model.named_parameters():
            self.assertEqual(param.full_tensor(), new_full[param_name])
        # Training after the load with assign=True works
        model(inp).sum().backward()
        for param in model.parameters():
            self.assertIsInstance(param.grad, DTensor)

    @skip_if_lt_x_gpu(2)
    def test_dp_state_dict_cpu_offload(self):
        self.run_subtests(
            {
                # Pinning needs an accelerator: CPU ranks offload without
                "offload_policy": [
                    CPUOffloadPolicy(pin_memory=pin_memory)
                    for pin_memory in ((True, False) if torch.cuda.is_available() else (False,))
                ],
                "cpu_state_dict": [True, False],
            },
            self._test_dp_state_dict_cpu_offload,
        )

    def _test_dp_state_dict_cpu_offload(self, offload_policy, cpu_state_dict):
        mlp_dim = 4
        torch.manual_seed(42)
        with torch.device("meta"):
            model = nn.Sequential(
                nn.Linear(mlp_dim, mlp_dim, bias=False), nn.Linear(mlp_dim, mlp_dim, bias=False)
            )
        for module in model:
            fully_shard(module, offload_policy=offload_policy)
        fully_shard(model, offload_policy=offload_policy)
        # split full sd into multiple pieces to test loading with `strict=False`
        state_dicts = []
        for name, dtensor in model.named_parameters():
            full_tensor = torch.randn(dtensor.size())
            sharded_tensor = distribute_tensor(full_tensor, dtensor.device_mesh, dtensor.placements)
            if cpu_state_dict:
                sharded_tensor = sharded_tensor.cpu()
            state_dicts.append({name: sharded_tensor})
        # check that we can load with some parameters still on meta device
        for sd in state_dicts:
            model.load_state_dict(sd, assign=True, strict=False)
        # lazy init without error; a state dict on the GPU is refused (on CPU ranks
        # the mesh, and so every state dict, is on the CPU)
        inp = torch.rand((mlp_dim, mlp_dim), device="cuda")
        context = (
            self.assertRaisesRegex(
                RuntimeError,
                r"Found following parameters on non-CPU device: \[\('0.weight', device\(type='cuda'",
            )
            if not cpu_state_dict and torch.cuda.is_available()
            else nullcontext()
        )
        with context:
            model(inp).sum()
            state_dict = model.state_dict()
            for name, dtensor in state_dict.items():
                self.assertEqual(dtensor.device.type, "cpu", name)

    @skip_if_lt_x_gpu(2)
    def test_cached_state_dict(self):
        self.run_subtests(
            {"mlp_dim": [2, 3, 4, 5], "mutate_after_state_dict": [True, False]},
            self._test_cached_state_dict,
        )

    def _test_cached_state_dict(self, mlp_dim, mutate_after_state_dict):
        torch.manual_seed(42)
        model = nn.Sequential(*[MLP(mlp_dim) for _ in range(2)]).cuda()
        for module in model:
            fully_shard(module)
        fully_shard(model)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        # A state dict taken once is kept by reference: it follows the training
        # when the parameters are changed in place
        state_dict = model.state_dict()
        for _ in range(3):
            inp = torch.randn((2, mlp_dim), device="cuda")
            model(inp).sum().backward()
            optim.step()
            optim.zero_grad()
            if mutate_after_state_dict:
                with torch.no_grad():
                    for param in model.parameters():
                        param.add_(1.0)
        for name, param in model.named_parameters():
            self.assertEqual(state_dict[name], param)
        self.assertIsInstance(model, FSDPModule)

    @skip_if_lt_x_gpu(2)
    def test_2d_state_dict_correctness(self):
        if self.world_size % 2 != 0:
            return
        dp_size = 2
        global_mesh = init_device_mesh(
            "cuda", (dp_size, self.world_size // dp_size), mesh_dim_names=("dp", "tp")
        )
        dp_mesh, tp_mesh = global_mesh["dp"], global_mesh["tp"]
        torch.manual_seed(42)
        model = MLPStack(4)
        ref_state_dict = copy.deepcopy(model.state_dict())
        model.parallelize(tp_mesh, dp_mesh, use_activation_checkpointing=False)
        sharded_sd = model.state_dict()
        self.assertEqual(list(sharded_sd), list(ref_state_dict))
        for key, value in sharded_sd.items():
            self.assertIsInstance(value, DTensor, key)
            self.assertEqual(value.full_tensor(), ref_state_dict[key], msg=key)
            self.assertTrue(any(isinstance(p, (Shard, Replicate)) for p in value.placements))


if __name__ == "__main__":
    run_tests()
