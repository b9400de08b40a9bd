# An FSDP2 test file in the style of upstream's
# test/distributed/_composable/fsdp/test_fully_shard_training.py, written for this
# project. Only its imports differ from a file written against torch.testing._internal;
# each says what it replaces. It names its device "cuda" and counts GPUs: on CPU ranks
# it runs under --map-cuda-to-cpu (the folder's conftest).

import copy
import functools
import unittest

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdptest.api import FSDPModule, fully_shard  # torch.distributed.fsdp
from upstream.common_distributed import skip_if_lt_x_gpu  # ..._internal.common_distributed
from upstream.common_fsdp import (  # torch.testing._internal.common_fsdp
    MLP,
    FSDPTest,
    FSDPTestMultiThread,
    MLPStack,
    check_sharded_parity,
    compiled_fsdp_test,
    patch_reduce_scatter,
)
from upstream.common_utils import run_tests  # torch.testing._internal.common_utils


class TestFullyShardRegisteredParams(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 4

    def test_param_registration_after_forward(self):
        """After forward the registered parameters are the sharded ones when
        resharding (True, or an int: the copy on the smaller mesh is FSDP's own),
        else the unsharded ones; ``reshard()`` on every module shards them again."""
        for reshard_after_forward in (True, False, 2):
            torch.manual_seed(42)
            model = MLP(3, torch.device("cpu"))
            # Seed by rank so that the ranks' original parameters differ
            torch.manual_seed(42 + self.rank)
            inp = torch.randn((2, 3), device="cuda")
            for module in model.modules():
                if isinstance(module, nn.Linear):
                    fully_shard(module, reshard_after_forward=reshard_after_forward)
            fully_shard(model, reshard_after_forward=reshard_after_forward)
            self._assert_dtensor_params(model.parameters())
            model(inp)
            if reshard_after_forward is False:
                self._assert_tensor_params(model.parameters())
            else:
                self._assert_dtensor_params(model.parameters())
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
            self._assert_dtensor_params(model.parameters())

    def test_param_registration_after_backward(self):
        for reshard_after_forward in (True, False, 2):
            model = MLP(8, torch.device("cpu"))
            fully_shard(model, reshard_after_forward=reshard_after_forward)
            inp = torch.randn((2, 8), device="cuda")
            model(inp).sum().backward()
            self._assert_dtensor_params(model.parameters())

    def _assert_tensor_params(self, params):
        params = list(params)
        self.assertGreater(len(params), 0)
        for param in params:
            self.assertFalse(isinstance(param, DTensor))
            self.assertIsInstance(param, torch.Tensor)

    def _assert_dtensor_params(self, params):
        params = list(params)
        self.assertGreater(len(params), 0)
        for param in params:
            self.assertIsInstance(param, DTensor)


class TestFullyShard1DTrainingCore(FSDPTest):
    @property
    def world_size(self) -> int:
        return min(4, torch.cuda.device_count())

    @skip_if_lt_x_gpu(2)
    def test_train_parity_single_group(self):
        """One group (the root only), against DDP."""
        self.run_subtests(
            {"lin_shapes": [[(16, 15), (15, 8)], [(7, 15), (15, 3)]]},
            self._test_train_parity_single_group,
        )

    def _test_train_parity_single_group(self, lin_shapes):
        torch.manual_seed(42)
        model = nn.Sequential(nn.Linear(*lin_shapes[0]), nn.ReLU(), nn.Linear(*lin_shapes[1]))
        ref_model = copy.deepcopy(model).cuda()
        replicate_ref = DDP(ref_model, device_ids=[self.rank])
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        fully_shard(model)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + self.rank + 1)
        inp = (torch.randn((4, lin_shapes[0][0]), device="cuda"),)
        for iter_idx in range(5):
            losses = []
            for _model, _optim in ((replicate_ref, ref_optim), (model, optim)):
                _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
                losses.append(_model(*inp).sum())
                losses[-1].backward()
                _optim.step()
            self.assertEqual(losses[0], losses[1])

    @skip_if_lt_x_gpu(2)
    @compiled_fsdp_test(compile_compute_on_module=MLP)
    def test_train_parity_multi_group(self):
        """A group per MLP and the root's, under every reshard_after_forward, against DDP."""
        self.run_subtests(
            {
                "reshard_after_forward": [True, False, self.world_size],
                "device_type": ["cuda"],
                "delay_after_forward": [False, True],
            },
            self._test_train_parity_multi_group,
        )

    def _test_train_parity_multi_group(
        self, reshard_after_forward, device_type, delay_after_forward
    ):
        torch.manual_seed(42)
        num_mlps, mlp_dim = 3, 8
        model = nn.Sequential(*[MLP(mlp_dim) for _ in range(num_mlps)])
        ref_model = copy.deepcopy(model).to(device_type)
        replicate_ref = DDP(ref_model, device_ids=[self.rank])
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        for mlp in model:
            fully_shard(mlp, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + self.rank + 1)
        for iter_idx in range(4):
            inp = torch.randn((4, mlp_dim), device=device_type)
            losses = []
            for _model, _optim in ((replicate_ref, ref_optim), (model, optim)):
                _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
                losses.append(_model(inp).sum())
                if _model is model and delay_after_forward:
                    torch.distributed.barrier()  # the ranks' backwards start later
                losses[-1].backward()
                _optim.step()
            self.assertEqual(losses[0], losses[1])

    @skip_if_lt_x_gpu(2)
    def test_multi_forward_module(self):
        """A module run twice in one forward."""
        torch.manual_seed(42)
        model = MultiForwardModule()
        ref_model = copy.deepcopy(model).cuda()
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        fully_shard(model.inner)
        fully_shard(model)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + self.rank)
        inp = torch.randn((32, 4), device="cuda")
        for iter_idx in range(4):
            losses = []
            for _model, _optim in ((ref_model, ref_optim), (model, optim)):
                _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
                losses.append(_model(inp).sum())
                losses[-1].backward()
                if _model is ref_model:
                    for param in ref_model.parameters():
                        dist.all_reduce(param.grad)
                        param.grad.div_(self.world_size)
                _optim.step()
            self.assertEqual(losses[0], losses[1])


class MultiForwardModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 5)

    def forward(self, x):
        i = self.inner(x)
        j = self.inner(x)
        return self.outer(i + j)


class TestFullyShardSharedParams(FSDPTest):
    @property
    def world_size(self) -> int:
        return min(4, torch.cuda.device_count())

    @skip_if_lt_x_gpu(2)
    def test_train_parity_with_shared_params(self):
        self.run_subtests(
            {"reshard_after_forward": [False, True], "use_activation_checkpointing": [False, True]},
            self._test_train_shared_params,
        )

    def _test_train_shared_params(self, reshard_after_forward, use_activation_checkpointing):
        torch.manual_seed(42)
        model = TiedModel()
        ref_model = copy.deepcopy(model).cuda()
        replicate_ref = DDP(ref_model, device_ids=[self.rank])
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        if use_activation_checkpointing:
            from torch.distributed._composable import checkpoint

            checkpoint(model.block)
        fully_shard(model.block, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + self.rank + 1)
        for iter_idx in range(4):
            inp = torch.randint(0, 10, (2, 3), device="cuda")
            losses = []
            for _model, _optim in ((replicate_ref, ref_optim), (model, optim)):
                _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
                losses.append(_model(inp).sum())
                losses[-1].backward()
                _optim.step()
            self.assertEqual(losses[0], losses[1])
        self.assertIs(model.tok_embeddings.weight, model.output.weight)


class TiedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(10, 8)
        self.block = MLP(8)
        self.output = nn.Linear(8, 10, bias=False)
        self.output.weight = self.tok_embeddings.weight

    def forward(self, x):
        return self.output(self.block(self.tok_embeddings(x)))


class TestFullyShardGradientAccumulation(FSDPTest):
    @property
    def world_size(self) -> int:
        return min(4, torch.cuda.device_count())

    @skip_if_lt_x_gpu(2)
    def test_gradient_accumulation(self):
        """Microbatches without gradient sync, or without resharding after backward,
        then a synced one: parity with DDP, and reduce-scatters only when synced."""
        self.run_subtests(
            {
                "mode": ["all", "root_only", "some_mlps"],
                "reshard_after_backward": [False, True],
                "reshard_after_forward": [False, True],
            },
            self._test_gradient_accumulation,
        )

    def _test_gradient_accumulation(self, mode, reshard_after_backward, reshard_after_forward):
        if not reshard_after_backward and (
            reshard_after_forward is not False or mode == "some_mlps"
        ):
            raise unittest.SkipTest(
                "not resharding after backward is paired with reshard_after_forward=False "
                "and the whole model's or the root's sync only (upstream's configurations)"
            )
        torch.manual_seed(42)
        batch_size, lin_dim, num_mlps, num_microbatches = (2, 8, 3, 3)
        modules = [nn.Linear(lin_dim, lin_dim)]
        modules.extend(MLP(lin_dim) for _ in range(num_mlps))
        model = nn.Sequential(*modules)
        ref_model = copy.deepcopy(model).cuda()
        for mlp in model[1:]:
            fully_shard(mlp, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        torch.manual_seed(42 + self.rank + 1)
        orig_reduce_scatter = dist.reduce_scatter_tensor
        reduce_scatter_count = 0

        def reduce_scatter_with_count(*args, **kwargs):
            nonlocal reduce_scatter_count
            reduce_scatter_count += 1
            return orig_reduce_scatter(*args, **kwargs)

        for iter_idx in range(3):
            with patch_reduce_scatter(reduce_scatter_with_count):
                for microbatch_idx in range(num_microbatches):
                    is_last_microbatch = microbatch_idx == num_microbatches - 1
                    if mode == "all":
                        model.set_requires_gradient_sync(is_last_microbatch)
                    elif mode == "root_only":
                        model.set_requires_gradient_sync(is_last_microbatch, recurse=False)
                    elif mode == "some_mlps":
                        for mlp in model[1 : 1 + num_mlps - 1]:
                            mlp.set_requires_gradient_sync(is_last_microbatch)
                    if not reshard_after_backward:
                        model.set_reshard_after_backward(is_last_microbatch)
                    inp = torch.randn((batch_size, lin_dim), device="cuda")
                    losses = []
                    for _model in (ref_model, model):
                        losses.append(_model(inp).sum())
                        losses[-1].backward()
                    self.assertEqual(losses[0], losses[1])
            groups = num_mlps + 1
            skipped = {"all": groups, "root_only": 1, "some_mlps": num_mlps - 1}[mode]
            expected = groups * num_microbatches - skipped * (num_microbatches - 1)
            self.assertEqual(reduce_scatter_count, expected)
            reduce_scatter_count = 0
            for param in ref_model.parameters():
                dist.all_reduce(param.grad)
                param.grad.div_(self.world_size)
            check_sharded_parity(self, ref_model, model)
            for _optim in (optim, ref_optim):
                _optim.step()
                _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))


class TestFullyShardHSDPTraining(FSDPTest):
    @property
    def world_size(self) -> int:
        return min(4, torch.cuda.device_count())

    @skip_if_lt_x_gpu(4)
    def test_train_parity_hsdp(self):
        shard_size = 2
        replicate_size = self.world_size // shard_size
        global_mesh = init_device_mesh(
            "cuda", (replicate_size, shard_size), mesh_dim_names=("dp_replicate", "dp_shard")
        )
        self.run_subtests(
            {
                "reshard_after_forward": [False, True],
                "use_activation_checkpointing": [False, True],
                "mlp_dim": [3, 16],
            },
            functools.partial(self._test_train_parity_hsdp, global_mesh),
        )

    def _test_train_parity_hsdp(
        self, global_mesh, reshard_after_forward, use_activation_checkpointing, mlp_dim
    ):
        torch.manual_seed(42)
        model = nn.Sequential(
            nn.LayerNorm(mlp_dim, bias=False),
            MLP(mlp_dim, dim_multiplier=3),
            MLP(mlp_dim),
            MLP(mlp_dim, dim_multiplier=3),
        )
        ref_model = copy.deepcopy(model).cuda()
        replicate_ref = DDP(ref_model, device_ids=[self.rank])
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        for mlp in model:
            if use_activation_checkpointing:
                from torch.distributed._composable import checkpoint

                checkpoint(mlp)
            fully_shard(mlp, mesh=global_mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=global_mesh, reshard_after_forward=reshard_after_forward)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        check_sharded_parity(self, ref_model, model)
        torch.manual_seed(42 + self.rank + 1)
        inp = torch.randn((2, mlp_dim), device="cuda")
        for iter_idx in range(3):
            losses = []
            for _model, _optim in ((replicate_ref, ref_optim), (model, optim)):
                _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
                losses.append(_model(inp).sum())
                losses[-1].backward()
                _optim.step()
            self.assertEqual(losses[0], losses[1])
            check_sharded_parity(self, ref_model, model)


class TestFullyShard2DTraining(FSDPTest):
    @property
    def world_size(self) -> int:
        return min(4, torch.cuda.device_count())

    @skip_if_lt_x_gpu(4)
    def test_train_parity_2d_mlp(self):
        global_mesh = init_device_mesh(
            "cuda", (2, self.world_size // 2), mesh_dim_names=("dp", "tp")
        )
        self.run_subtests(
            {
                "reshard_after_forward": [False, True],
                "use_activation_checkpointing": [False, True],
                "mlp_dim": [4, 8],
            },
            functools.partial(self._test_train_parity_2d_mlp, global_mesh),
        )

    def _test_train_parity_2d_mlp(
        self, global_mesh, reshard_after_forward, use_activation_checkpointing, mlp_dim
    ):
        dp_mesh, tp_mesh = global_mesh["dp"], global_mesh["tp"]
        dp_pg = dp_mesh.get_group()  # used for `replicate()`
        torch.manual_seed(42)
        model = MLPStack(mlp_dim)
        ref_model = copy.deepcopy(model).cuda()
        replicate_ref = DDP(ref_model, device_ids=[self.rank], process_group=dp_pg)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2, foreach=False)
        model.parallelize(
            tp_mesh,
            dp_mesh,
            use_activation_checkpointing,
            reshard_after_forward=reshard_after_forward,
        )
        optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
        torch.manual_seed(42 + dp_pg.rank() + 1)
        for iter_idx in range(2):
            inp = torch.randn((2, mlp_dim), device="cuda")
            losses = []
            for _model, _optim in ((replicate_ref, ref_optim), (model, optim)):
                _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
                losses.append(_model(inp).sum())
                losses[-1].backward()
                _optim.step()
            # Tensor parallelism sums partial products in another order
            self.assertEqual(losses[0], losses[1], rtol=1e-5, atol=1e-4)


if __name__ == "__main__":
    run_tests()
