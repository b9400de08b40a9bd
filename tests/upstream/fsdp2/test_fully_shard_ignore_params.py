# An FSDP2 test file in the style of upstream's
# test/distributed/_composable/fsdp/test_fully_shard_ignore_params.py, written for this
# project. Only its imports differ from a file written against torch.testing._internal;
# each says what it replaces. It names its device "cuda" and counts GPUs: on CPU ranks
# it runs under --map-cuda-to-cpu (the folder's conftest).

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

from fsdptest.api import fully_shard  # torch.distributed.fsdp
from upstream.common_distributed import skip_if_lt_x_gpu  # ..._internal.common_distributed
from upstream.common_fsdp import FSDPTest  # torch.testing._internal.common_fsdp
from upstream.common_utils import run_tests  # torch.testing._internal.common_utils


class A(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(4, 4)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


class B(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = A()
        self.l3 = nn.Linear(4, 4)

    def forward(self, x):
        return self.l3(self.a(x))


def _named_ignored(model, ignored):
    return {name for name, param in model.named_parameters() if param in ignored}


class TestFullyShardIgnoreParams(FSDPTest):
    @property
    def world_size(self) -> int:
        return min(4, torch.cuda.device_count())

    @skip_if_lt_x_gpu(2)
    def test_ddp_A_fsdp_B_ddp_C(self):
        """Parameters ignored by FSDP are left alone (plain tensors, not reduced),
        so another data-parallel scheme can manage them: here the ignored ones are
        averaged by hand, and the model trains as a replicated reference."""
        torch.manual_seed(42)
        model = B().cuda()
        ref_model = copy.deepcopy(model)
        ignored = set(model.a.l1.parameters()) | set(model.l3.parameters())
        ignored_names = _named_ignored(model, ignored)
        fully_shard(model.a, ignored_params=ignored)
        fully_shard(model, ignored_params=ignored)
        for name, param in model.named_parameters():
            self.assertEqual(isinstance(param, DTensor), name not in ignored_names, name)
        optim = torch.optim.SGD(model.parameters(), lr=1e-2)
        ref_optim = torch.optim.SGD(ref_model.parameters(), lr=1e-2)
        torch.manual_seed(42 + self.rank)
        for iter_idx in range(3):
            inp = torch.randn((2, 4), device="cuda")
            losses = []
            for _model in (model, ref_model):
                losses.append(_model(inp).sum())
                losses[-1].backward()
            self.assertEqual(losses[0], losses[1])
            # The ignored parameters' gradients are each rank's own: average them
            for name, param in model.named_parameters():
                if name in ignored_names:
                    dist.all_reduce(param.grad)
                    param.grad.div_(self.world_size)
            for param in ref_model.parameters():
                dist.all_reduce(param.grad)
                param.grad.div_(self.world_size)
            # As upstream's test, the steps run under implicit_replication: a foreach
            # step (the default on CUDA) over sharded (DTensor) and ignored (plain)
            # parameters fails otherwise (pytorch/pytorch#183207)
            with implicit_replication():
                for _optim in (optim, ref_optim):
                    _optim.step()
                    _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            for (name, param), ref_param in zip(model.named_parameters(), ref_model.parameters()):
                full = param.full_tensor() if isinstance(param, DTensor) else param
                self.assertEqual(full, ref_param, msg=name)

    @skip_if_lt_x_gpu(2)
    def test_ignored_params_are_not_moved(self):
        """Ignored parameters stay where they were (here on the CPU of the rank)."""
        torch.manual_seed(42)
        model = B()
        ignored = set(model.l3.parameters())
        fully_shard(model, ignored_params=ignored)
        for param in ignored:
            self.assertFalse(isinstance(param, DTensor))
            self.assertEqual(param.device.type, "cpu")


if __name__ == "__main__":
    run_tests()
