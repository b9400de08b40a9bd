# An FSDP2 test file in the style of upstream's
# test/distributed/_composable/fsdp/test_fully_shard_autograd.py, written for this
# project. Only its imports differ from a file written against torch.testing._internal;
# each says what it replaces. It names its device "cuda" and counts GPUs, as
# upstream's does: on CPU ranks it runs under --map-cuda-to-cpu (the folder's conftest).

import collections
import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel.scatter_gather import _is_namedtuple

from fsdptest.api import fully_shard  # torch.distributed.fsdp
from upstream.common_distributed import skip_if_lt_x_gpu  # ..._internal.common_distributed
from upstream.common_fsdp import (  # torch.testing._internal.common_fsdp
    DoubleLinear,
    FSDPTest,
    check_sharded_parity,
)
from upstream.common_utils import run_tests  # torch.testing._internal.common_utils


class TestFullyShardAutograd(FSDPTest):
    @property
    def world_size(self) -> int:
        return min(4, torch.cuda.device_count())

    def _reduce_1d_partial_grads(self, module: nn.Module, group=None) -> None:
        group = group or dist.distributed_c10d._get_default_group()
        for param in module.parameters():
            if param.grad is not None:
                param.grad.div_(group.size())

    def _reshard_values(self):
        return [True, False, self.world_size]

    @skip_if_lt_x_gpu(2)
    def test_unused_forward_output(self):
        """Gradients propagate when some forward output is not used in the loss."""
        self.run_subtests(
            {"reshard_after_forward": self._reshard_values()},
            self._test_unused_forward_output,
        )

    def _test_unused_forward_output(self, reshard_after_forward):
        torch.manual_seed(42)
        local_batch_size = 2
        global_batch_size, dim = (self.world_size * local_batch_size, 24)
        model = DoubleLinear(dim=dim, use_second_linear=True)
        ref_model = copy.deepcopy(model).cuda()
        fully_shard(model.lin1, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(1)  # same on all ranks
        for iter_idx in range(5):
            # All outputs in the loss for the first iterations, the first only after
            global_inp = torch.rand((global_batch_size, dim), device="cuda")
            local_inp = global_inp[
                self.rank * local_batch_size : (self.rank + 1) * local_batch_size
            ].detach()
            out1, out2 = model(local_inp)
            loss = (out1 * out2).sum() if iter_idx < 3 else out1.sum()
            loss.backward()
            optim.step()
            ref_out1, ref_out2 = ref_model(global_inp)
            ref_loss = (ref_out1 * ref_out2).sum() if iter_idx < 3 else ref_out1.sum()
            ref_loss.backward()
            self._reduce_1d_partial_grads(ref_model)
            ref_optim.step()
            dist.all_reduce(loss)  # partial -> replicated
            self.assertEqual(loss, ref_loss)
            optim.zero_grad(set_to_none=(iter_idx % 2))
            ref_optim.zero_grad(set_to_none=(iter_idx % 2))
            check_sharded_parity(self, ref_model, model)

    @skip_if_lt_x_gpu(2)
    def test_unused_forward_module(self):
        """Gradients propagate when some forward module is not used at all."""
        self.run_subtests(
            {"reshard_after_forward": self._reshard_values()},
            self._test_unused_forward_module,
        )

    def _test_unused_forward_module(self, reshard_after_forward):
        torch.manual_seed(42)
        local_batch_size, dim = (2, 24)
        global_batch_size = self.world_size * local_batch_size
        model = DoubleLinear(dim=dim, use_second_linear=False)
        ref_model = copy.deepcopy(model).cuda()
        fully_shard(model.lin1, reshard_after_forward=reshard_after_forward)
        fully_shard(model.lin2, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(1)  # same on all ranks
        for iter_idx in range(5):
            global_inp = torch.rand((global_batch_size, dim), device="cuda")
            local_inp = global_inp[
                self.rank * local_batch_size : (self.rank + 1) * local_batch_size
            ].detach()
            losses = []
            for _model, inp in ((ref_model, global_inp), (model, local_inp)):
                losses.append(_model(inp).sum())
                losses[-1].backward()
            self._reduce_1d_partial_grads(ref_model)
            dist.all_reduce(losses[1])  # partial -> replicated
            self.assertEqual(losses[0], losses[1])
            check_sharded_parity(self, ref_model, model)
            for _optim in (optim, ref_optim):
                _optim.step()
                _optim.zero_grad(set_to_none=(iter_idx % 2))

    @skip_if_lt_x_gpu(2)
    def test_nontensor_activations(self):
        """Activations wrapped in non-tensor containers between sharded modules."""
        self.run_subtests(
            {"container_type": [list, collections.namedtuple, tuple, dict]},
            self._test_nontensor_activations,
        )

    def _test_nontensor_activations(self, container_type):
        torch.manual_seed(42)
        local_batch_size, dim = (2, 24)
        global_batch_size = self.world_size * local_batch_size
        model = nn.Sequential(
            ToContainerType(container_type),
            Module(dim),
            Module(dim),
            Module(dim),
            FromContainerType(container_type),
        )
        ref_model = copy.deepcopy(model).cuda()
        for module in model:
            fully_shard(module)
        fully_shard(model)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(1)  # same on all ranks
        for iter_idx in range(5):
            global_inp = torch.rand((global_batch_size, dim), device="cuda")
            local_inp = global_inp[
                self.rank * local_batch_size : (self.rank + 1) * local_batch_size
            ].detach()
            losses = []
            for _model, inp in ((ref_model, global_inp), (model, local_inp)):
                losses.append(_model(inp).sum())
                losses[-1].backward()
            self._reduce_1d_partial_grads(ref_model)
            dist.all_reduce(losses[1])  # partial -> replicated
            self.assertEqual(losses[0], losses[1])
            check_sharded_parity(self, ref_model, model)
            for _optim in (optim, ref_optim):
                _optim.step()
                _optim.zero_grad(set_to_none=(iter_idx % 2))


class Module(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)
        self.relu = nn.ReLU()

    def forward(self, inp: Any):
        # The "0th" element of the input is a tensor: computed on and packed back
        # into a container of the input's type
        if isinstance(inp, list):
            return [self._forward(inp[0])]
        elif _is_namedtuple(inp):
            return type(inp)(*([self._forward(inp[0])] + list(inp[1:])))
        elif isinstance(inp, tuple):
            return (self._forward(inp[0]),)
        elif isinstance(inp, dict):
            return {"x": self._forward(inp["x"])}
        raise NotImplementedError(f"Unsupported input type {type(inp)}: {inp}")

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.lin2(self.relu(self.lin1(x))))


class ToContainerType(nn.Module):
    def __init__(self, container_type: type):
        super().__init__()
        self.container_type = container_type

    def forward(self, x: torch.Tensor):
        if self.container_type is list:
            return [x]
        elif self.container_type is collections.namedtuple:
            nt = collections.namedtuple("NT", "x y")
            return nt(x, torch.ones_like(x))
        elif self.container_type is tuple:
            return (x,)
        elif self.container_type is dict:
            return {"x": x}
        raise NotImplementedError(f"Unsupported container type: {self.container_type}")


class FromContainerType(nn.Module):
    def __init__(self, container_type: type):
        super().__init__()
        self.container_type = container_type

    def forward(self, x: Any) -> torch.Tensor:
        if self.container_type in (list, collections.namedtuple, tuple):
            return x[0]
        elif self.container_type is dict:
            return x["x"]
        raise NotImplementedError(f"Unsupported container type: {self.container_type}")


if __name__ == "__main__":
    run_tests()
