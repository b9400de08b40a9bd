# An FSDP2 test file in the style of upstream's
# test/distributed/_composable/fsdp/test_fully_shard_clip_grad_norm_.py, written for
# this project. Only its imports differ from a file written against
# torch.testing._internal; each says what it replaces. It names its device "cuda":
# on CPU ranks it runs under --map-cuda-to-cpu (the folder's conftest).

import copy
import functools

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdptest.api import fully_shard  # torch.distributed.fsdp
from upstream.common_distributed import skip_if_lt_x_gpu  # ..._internal.common_distributed
from upstream.common_fsdp import MLP, FSDPTest, MLPStack  # ..._internal.common_fsdp
from upstream.common_utils import run_tests  # torch.testing._internal.common_utils


class _TestClipGradNormBase(FSDPTest):
    def _test_clip_grad_norm(
        self,
        max_norm,
        norm_type,
        ref_model,
        ref_optim,
        model,
        optim,
        inp,
        dp_mesh=None,
        tol=None,
        num_iters=4,
    ):
        tol = tol or {}
        vector_norm_fn = functools.partial(torch.linalg.vector_norm, ord=norm_type)
        dp_mesh = dp_mesh or init_device_mesh("cuda", (self.world_size,))
        torch.manual_seed(42 + dp_mesh.get_local_rank() + 1)
        for _ in range(num_iters):
            ref_optim.zero_grad()
            ref_model(inp).sum().backward()
            optim.zero_grad()
            model(inp).sum().backward()

            ref_grads = [p.grad.detach().clone() for p in ref_model.parameters()]
            local_grads = [p.grad.to_local().detach().clone() for p in model.parameters()]
            for ref_grad, param in zip(ref_grads, model.parameters()):
                self.assertEqual(ref_grad, param.grad.full_tensor(), **tol)

            # A small max norm, so the gradients are clipped
            self.assertTrue(any(vector_norm_fn(g).item() > max_norm for g in ref_grads))
            self.assertTrue(any(vector_norm_fn(g).item() > max_norm for g in local_grads))

            ref_total_norm = torch.nn.utils.clip_grad_norm_(
                ref_model.parameters(), max_norm=max_norm, norm_type=norm_type
            )
            total_norm = torch.nn.utils.clip_grad_norm_(
                model.parameters(), max_norm=max_norm, norm_type=norm_type
            )
            self.assertEqual(ref_total_norm, total_norm.full_tensor(), **tol)
            # Clipping scaled the gradients down to the norm: not all are unchanged
            # and none grew
            comparisons = [
                torch.equal(vector_norm_fn(p.grad.to_local()), vector_norm_fn(g))
                for p, g in zip(model.parameters(), local_grads)
            ]
            self.assertFalse(all(comparisons))
            for param, grad in zip(model.parameters(), local_grads):
                self.assertLessEqual(
                    vector_norm_fn(param.grad.to_local()).item(), vector_norm_fn(grad).item()
                )
            ref_optim.step()
            optim.step()


class TestClipGradNormWorldSize2(_TestClipGradNormBase):
    @property
    def world_size(self) -> int:
        return min(torch.cuda.device_count(), 2)

    @skip_if_lt_x_gpu(2)
    def test_clip_grad_norm_1d(self):
        for norm_type in (2, 1, float("inf")):
            torch.manual_seed(42)
            model_args = {"dim": 16, "dim_multiplier": 2}
            model = nn.Sequential(*[MLP(**model_args) for _ in range(3)]).cuda()
            ref_model = DDP(copy.deepcopy(model), device_ids=[self.rank])
            ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
            for mlp in model:
                fully_shard(mlp)
            fully_shard(model)
            optim = torch.optim.Adam(model.parameters(), lr=1e-2)
            inp = torch.randn((2, 16), device="cuda")
            self._test_clip_grad_norm(0.5, norm_type, ref_model, ref_optim, model, optim, inp)
            self.assertIsInstance(model[0].in_proj.weight.grad, DTensor)


class TestClipGradNormWorldSize4(_TestClipGradNormBase):
    @property
    def world_size(self) -> int:
        return min(torch.cuda.device_count(), 4)

    @skip_if_lt_x_gpu(4)
    def test_clip_grad_norm_2d(self):
        for norm_type in (2, 1, float("inf")):
            dp_size = 2
            global_mesh = init_device_mesh(
                "cuda",
                (dp_size, self.world_size // dp_size),
                mesh_dim_names=("dp", "tp"),
            )
            dp_mesh, tp_mesh = global_mesh["dp"], global_mesh["tp"]
            torch.manual_seed(42)
            # Tensor parallelism on two of the MLPs and FSDP on the data-parallel dim
            model = MLPStack(16, with_seq_parallel=True)
            ref_model = DDP(copy.deepcopy(model).cuda(), device_ids=[self.rank])
            ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
            model.parallelize(tp_mesh, dp_mesh, use_activation_checkpointing=False)
            optim = torch.optim.Adam(model.parameters(), lr=1e-2)
            inp = torch.randn(2, 16, device="cuda")
            # Tensor parallelism sums the row-parallel partial products in another
            # order than one device does: the gradients agree to fp32 rounding only,
            # and one iteration is checked (Adam's steps would amplify the rounding
            # of near-zero gradients).
            tol = {"rtol": 1e-5, "atol": 1e-4}
            self._test_clip_grad_norm(
                0.5, norm_type, ref_model, ref_optim, model, optim, inp, dp_mesh, tol, 1
            )


if __name__ == "__main__":
    run_tests()
