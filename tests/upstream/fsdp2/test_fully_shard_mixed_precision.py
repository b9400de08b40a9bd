# An FSDP2 test file in the style of upstream's
# test/distributed/_composable/fsdp/test_fully_shard_mixed_precision.py, written for
# this project. Only its imports differ from a file written against
# torch.testing._internal; each says what it replaces. It names its device "cuda" and
# counts GPUs: on CPU ranks it runs under --map-cuda-to-cpu (the folder's conftest).

import copy
import functools

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdptest.api import MixedPrecisionPolicy, fully_shard  # torch.distributed.fsdp
from upstream.common_distributed import skip_if_lt_x_gpu  # ..._internal.common_distributed
from upstream.common_fsdp import (  # torch.testing._internal.common_fsdp
    MLP,
    FSDPTest,
    check_sharded_parity,
    patch_reduce_scatter,
    reduce_scatter_with_assert,
)
from upstream.common_utils import run_tests  # torch.testing._internal.common_utils


class TestFullyShardMixedPrecisionTraining(FSDPTest):
    @property
    def world_size(self) -> int:
        return min(4, torch.cuda.device_count())

    def _init_models_and_optims(self, reshard_after_forward, param_dtype, reduce_dtype):
        torch.manual_seed(42)
        model = nn.Sequential(*[MLP(16, torch.device("cpu")) for _ in range(3)])
        ref_model = copy.deepcopy(model).cuda()
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        fully_shard_fn = functools.partial(
            fully_shard, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy
        )
        for mlp in model:
            fully_shard_fn(mlp)
        fully_shard_fn(model)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
        return ref_model, ref_optim, model, optim

    @skip_if_lt_x_gpu(2)
    def test_compute_dtype(self):
        self.run_subtests(
            {
                "param_dtype": [torch.bfloat16, torch.float16],
                "reshard_after_forward": [False, True],
            },
            self._test_compute_dtype,
        )

    def _test_compute_dtype(self, param_dtype, reshard_after_forward):
        ref_model, ref_optim, model, optim = self._init_models_and_optims(
            reshard_after_forward, param_dtype=param_dtype, reduce_dtype=None
        )
        ref_model_compute = copy.deepcopy(ref_model).to(param_dtype)
        orig_reduce_scatter = dist.reduce_scatter_tensor

        def assert_fn(output: torch.Tensor):
            self.assertEqual(output.dtype, param_dtype)

        reduce_scatter = functools.partial(
            reduce_scatter_with_assert, self, orig_reduce_scatter, assert_fn
        )
        # fp16 reductions divide by about sqrt(N) before the sum and the rest after it
        # (fp32 and bf16 ones by N after it)
        predivide_factor, postdivide_factor = (None, self.world_size)
        if param_dtype == torch.float16:
            predivide_factor = 1
            while (
                self.world_size % predivide_factor == 0
                and self.world_size / predivide_factor > predivide_factor
            ):
                predivide_factor *= 2
            postdivide_factor = self.world_size / predivide_factor
        torch.manual_seed(42 + self.rank + 1)
        inp = torch.randn((4, 16), device="cuda", dtype=param_dtype)
        for iter_idx in range(4):
            optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            fsdp_loss = model(inp).sum()
            with patch_reduce_scatter(reduce_scatter):
                fsdp_loss.backward()
            optim.step()

            ref_optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            ref_loss = ref_model_compute(inp.to(param_dtype)).sum()
            ref_loss.backward()
            for param in ref_model_compute.parameters():
                if predivide_factor is not None:
                    param.grad.div_(predivide_factor)
                dist.all_reduce(param.grad)
                param.grad.div_(postdivide_factor)
            for param_fp32, param_compute in zip(
                ref_model.parameters(), ref_model_compute.parameters()
            ):
                param_fp32.grad = param_compute.grad.to(param_fp32.dtype)
                param_compute.grad = None
            ref_optim.step()
            for param_fp32, param_compute in zip(
                ref_model.parameters(), ref_model_compute.parameters()
            ):
                param_compute.detach().copy_(param_fp32)
            self.assertEqual(fsdp_loss, ref_loss)
            check_sharded_parity(self, ref_model, model)

    @skip_if_lt_x_gpu(2)
    def test_reduce_dtype(self):
        self.run_subtests(
            {"reshard_after_forward": [False, True]},
            self._test_reduce_dtype_fp32_reduce,
        )
        self.run_subtests(
            {"reshard_after_forward": [False, True]},
            self._test_reduce_dtype_bf16_reduce,
        )

    def _test_reduce_dtype_fp32_reduce(self, reshard_after_forward):
        param_dtype, reduce_dtype = (torch.bfloat16, torch.float32)
        ref_model, ref_optim, model, optim = self._init_models_and_optims(
            reshard_after_forward, param_dtype=param_dtype, reduce_dtype=reduce_dtype
        )
        ref_model_bf16 = copy.deepcopy(ref_model).to(param_dtype)
        orig_reduce_scatter = dist.reduce_scatter_tensor

        def assert_fn(output: torch.Tensor):
            self.assertEqual(output.dtype, reduce_dtype)

        reduce_scatter = functools.partial(
            reduce_scatter_with_assert, self, orig_reduce_scatter, assert_fn
        )
        torch.manual_seed(42 + self.rank + 1)
        inp = torch.randn((4, 16), device="cuda", dtype=param_dtype)
        for iter_idx in range(4):
            optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            fsdp_loss = model(inp).sum()
            with patch_reduce_scatter(reduce_scatter):
                fsdp_loss.backward()
            optim.step()

            ref_optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            ref_loss = ref_model_bf16(inp.to(param_dtype)).sum()
            ref_loss.backward()
            for param in ref_model_bf16.parameters():
                param.grad.data = param.grad.to(torch.float32)
                dist.all_reduce(param.grad)  # fp32 all-reduce
                param.grad.div_(self.world_size)
            for param_fp32, param_bf16 in zip(ref_model.parameters(), ref_model_bf16.parameters()):
                param_fp32.grad = param_bf16.grad
                param_bf16.grad = None
            ref_optim.step()  # fp32 optimizer step
            for param_fp32, param_bf16 in zip(ref_model.parameters(), ref_model_bf16.parameters()):
                param_bf16.detach().copy_(param_fp32)
            self.assertEqual(fsdp_loss, ref_loss)
            check_sharded_parity(self, ref_model, model)

    def _test_reduce_dtype_bf16_reduce(self, reshard_after_forward):
        param_dtype, reduce_dtype = (torch.float32, torch.bfloat16)
        ref_model, ref_optim, model, optim = self._init_models_and_optims(
            reshard_after_forward, param_dtype=param_dtype, reduce_dtype=reduce_dtype
        )
        group = dist.distributed_c10d._get_default_group()
        orig_reduce_scatter = dist.reduce_scatter_tensor

        def assert_fn(output: torch.Tensor):
            self.assertEqual(output.dtype, reduce_dtype)

        reduce_scatter = functools.partial(
            reduce_scatter_with_assert, self, orig_reduce_scatter, assert_fn
        )
        torch.manual_seed(42 + self.rank + 1)
        inp = torch.randn((4, 16), device="cuda", dtype=param_dtype)
        for iter_idx in range(4):
            optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            fsdp_loss = model(inp).sum()
            with patch_reduce_scatter(reduce_scatter):
                fsdp_loss.backward()
            optim.step()

            ref_optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            ref_loss = ref_model(inp).sum()
            ref_loss.backward()
            for param in ref_model.parameters():
                param_grad = param.grad.to(reduce_dtype)
                dist.all_reduce(param_grad)
                param.grad = (param_grad / group.size()).to(param_dtype)
            ref_optim.step()
            self.assertEqual(fsdp_loss, ref_loss)
            check_sharded_parity(self, ref_model, model)


class TestFullyShardMixedPrecisionCasts(FSDPTest):
    @property
    def world_size(self) -> int:
        return 2

    @skip_if_lt_x_gpu(1)
    def test_float16_on_one_submodule(self):
        x = torch.zeros(2, 100, device="cuda")
        # Subtest 1: float16 on one submodule, default elsewhere
        model = SaveForwardInputsModel(forward_inputs := {}, cast_forward_inputs=False).cuda()
        fully_shard(model.c1, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
        fully_shard(model)
        model(x).sum().backward()
        self.assertEqual(forward_inputs[model].dtype, torch.float32)
        self.assertEqual(forward_inputs[model.c1].dtype, torch.float16)
        self.assertEqual(forward_inputs[model.c2].dtype, torch.float32)
        # Subtest 2: float16 on one submodule and bfloat16 everywhere else
        forward_inputs.clear()
        model = SaveForwardInputsModel(forward_inputs, cast_forward_inputs=False).cuda()
        fully_shard(model.c1, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        model(x).sum().backward()
        self.assertEqual(forward_inputs[model].dtype, torch.bfloat16)
        self.assertEqual(forward_inputs[model.c1].dtype, torch.float16)
        self.assertEqual(forward_inputs[model.c2].dtype, torch.bfloat16)

    @skip_if_lt_x_gpu(1)
    def test_submodules_with_external_inputs(self):
        self.run_subtests({"enable_submodule_cast": [False, True]}, self._test_external_inputs)

    def _test_external_inputs(self, enable_submodule_cast: bool):
        forward_inputs = {}
        model = ExternalInputsModel(forward_inputs).cuda()
        x = torch.zeros(2, 100, device="cuda")
        fully_shard(
            model.l2,
            mp_policy=MixedPrecisionPolicy(
                param_dtype=torch.float16, cast_forward_inputs=enable_submodule_cast
            ),
        )
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
        model(x).sum().backward()
        # l2 casts its inputs when enabled (the default); else its external input y
        # stays fp32
        self.assertEqual(forward_inputs["model_input_x"].dtype, torch.float16)
        self.assertEqual(forward_inputs["l2_input_x"].dtype, torch.float16)
        self.assertEqual(
            forward_inputs["l2_input_y"].dtype,
            torch.float16 if enable_submodule_cast else torch.float32,
        )


class SaveForwardInputsModule(nn.Module):
    def __init__(self, forward_inputs, cast_forward_inputs: bool):
        super().__init__()
        self.l = nn.Linear(100, 100)
        self.forward_inputs = forward_inputs
        self.cast_forward_inputs = cast_forward_inputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forward_inputs[self] = x
        return self.l(x.to(self.l.weight.dtype) if self.cast_forward_inputs else x)


class SaveForwardInputsModel(nn.Module):
    def __init__(self, forward_inputs, cast_forward_inputs: bool):
        super().__init__()
        self.c1 = SaveForwardInputsModule(forward_inputs, cast_forward_inputs)
        self.c2 = SaveForwardInputsModule(forward_inputs, cast_forward_inputs)
        self.forward_inputs = forward_inputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forward_inputs[self] = x
        return self.c2(self.c1(x).to(x.dtype))


class ToyModule(nn.Module):
    def __init__(self, forward_inputs):
        super().__init__()
        self.l = nn.Linear(100, 100)
        self.forward_inputs = forward_inputs

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.forward_inputs["l2_input_x"] = x
        self.forward_inputs["l2_input_y"] = y
        return self.l(x)


class ExternalInputsModel(nn.Module):
    def __init__(self, forward_inputs):
        super().__init__()
        self.l1 = nn.Linear(100, 100)
        self.l2 = ToyModule(forward_inputs)
        self.forward_inputs = forward_inputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forward_inputs["model_input_x"] = x
        y = torch.ones(2, 100, device="cuda", dtype=torch.float32)  # an external input
        return self.l2(self.l1(x), y)


if __name__ == "__main__":
    run_tests()
