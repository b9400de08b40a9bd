# An FSDP2 test file in the style of upstream's
# test/distributed/_composable/fsdp/test_fully_shard_frozen.py, written for this project.
# Only its imports differ from a file written against torch.testing._internal; each
# says what it replaces. It names its device "cuda" and counts GPUs, as upstream's
# older files do: on CPU ranks it runs under --map-cuda-to-cpu (the folder's conftest).

import copy
import functools
import itertools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._composable import checkpoint
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdptest.api import fully_shard  # torch.distributed.fsdp
from upstream.common_distributed import skip_if_lt_x_gpu  # ..._internal.common_distributed
from upstream.common_fsdp import (  # torch.testing._internal.common_fsdp
    MLP,
    FSDPTest,
    check_sharded_parity,
    patch_reduce_scatter,
    patch_register_post_backward_hook_backward,
    reduce_scatter_with_assert,
)
from upstream.common_utils import run_tests  # torch.testing._internal.common_utils
from upstream.fsdp2_param_group import (  # torch.distributed.fsdp._fully_shard._fsdp_param_group
    RegisterPostBackwardFunction,
)


class TestFullyShardFrozen(FSDPTest):
    @property
    def world_size(self) -> int:
        return min(4, torch.cuda.device_count())

    @skip_if_lt_x_gpu(2)
    def test_train_mixed_requires_grad_per_group(self):
        """Frozen and trained parameters in one communication group: parity with DDP,
        reduce-scatters of the trained parameters only, run from the autograd
        backward of the post-backward function (not delayed to the end)."""
        self.run_subtests(
            {
                "reshard_after_forward": [False, True, self.world_size],
                "use_activation_checkpointing": [False, True],
                "freeze_after_init": [False, True],
            },
            self._test_train_mixed_requires_grad_per_group,
        )

    def _test_train_mixed_requires_grad_per_group(
        self, reshard_after_forward, use_activation_checkpointing, freeze_after_init
    ):
        torch.manual_seed(42)
        num_mlps, lin_dim = (3, 16)
        model = nn.Sequential(*[MLP(lin_dim, torch.device("cpu")) for _ in range(num_mlps)])
        # Train biases only (e.g. like BitFit)
        if not freeze_after_init:
            for param_name, param in model.named_parameters():
                if "bias" not in param_name:
                    param.requires_grad_(False)
        ref_model = DDP(
            copy.deepcopy(model).cuda(),
            device_ids=[self.rank],
            find_unused_parameters=freeze_after_init,
        )
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        for mlp in model:
            if use_activation_checkpointing:
                checkpoint(mlp)
            fully_shard(mlp, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        orig_reduce_scatter = dist.reduce_scatter_tensor
        if freeze_after_init:
            for param_name, param in itertools.chain(
                model.named_parameters(), ref_model.module.named_parameters()
            ):
                if "bias" not in param_name:
                    param.requires_grad_(False)
        expected_numel = sum(
            p._local_tensor.numel() for n, p in model[0].named_parameters() if "bias" in n
        )

        def assert_fn(output: torch.Tensor):
            self.assertEqual(output.numel(), expected_numel)

        reduce_scatter = functools.partial(
            reduce_scatter_with_assert, self, orig_reduce_scatter, assert_fn
        )
        orig_backward = RegisterPostBackwardFunction.backward
        backward_count = 0

        def backward_with_count(*args, **kwargs):
            nonlocal backward_count
            backward_count += 1
            return orig_backward(*args, **kwargs)

        torch.manual_seed(42 + self.rank + 1)
        with (
            patch_reduce_scatter(reduce_scatter),
            patch_register_post_backward_hook_backward(backward_with_count),
        ):
            for iter_idx in range(4):
                inp = torch.randn((8, lin_dim), device="cuda")
                losses = []
                for _model, _optim in ((ref_model, ref_optim), (model, optim)):
                    _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
                    losses.append(_model(inp).sum())
                    losses[-1].backward()
                    _optim.step()
                check_sharded_parity(self, ref_model.module, model)
                self.assertEqual(losses[0], losses[1])
                # The post-backward ran through the autograd backward (except possibly
                # for the first MLP, whose input does not require grad)
                self.assertTrue(backward_count >= num_mlps - 1)

    @skip_if_lt_x_gpu(2)
    def test_train_mixed_requires_grad_across_groups(self):
        """Frozen and trained parameters in different groups, possibly unfrozen on
        the last step: parity with DDP."""
        self.run_subtests(
            {
                "reshard_after_forward": [False, True, self.world_size],
                "unfreeze_params": [False, True],
            },
            self._test_train_mixed_requires_grad_across_groups,
        )

    def _test_train_mixed_requires_grad_across_groups(self, reshard_after_forward, unfreeze_params):
        torch.manual_seed(42)
        num_linears, lin_dim = (6, 16)
        modules = []
        for _ in range(num_linears):
            modules += [nn.Linear(lin_dim, lin_dim), nn.ReLU()]
        model = nn.Sequential(*modules)
        ref_model = DDP(
            copy.deepcopy(model).cuda(), device_ids=[self.rank], find_unused_parameters=True
        )
        for module in model.modules():
            if isinstance(module, nn.Linear):
                fully_shard(module, reshard_after_forward=reshard_after_forward)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        orig_backward = RegisterPostBackwardFunction.backward
        backward_count = 0

        def _set_requires_grad(seq: nn.Module, requires_grad: bool):
            for i in range(0, 2 * num_linears, 4):  # every other linear is frozen
                for param in seq[i].parameters():
                    param.requires_grad_(requires_grad)

        def backward_with_count(*args, **kwargs):
            nonlocal backward_count
            backward_count += 1
            return orig_backward(*args, **kwargs)

        _set_requires_grad(model, False)
        _set_requires_grad(ref_model.module, False)
        num_iters, no_grad_iter_idx = (3, 1)
        torch.manual_seed(42 + self.rank)
        inp = torch.randn((8, lin_dim), device="cuda")
        with patch_register_post_backward_hook_backward(backward_with_count):
            for iter_idx in range(num_iters):
                losses = []
                for _model, _optim in ((ref_model, ref_optim), (model, optim)):
                    # Unfreeze on the last step, as some fine-tuning does
                    if unfreeze_params and iter_idx == num_iters - 1:
                        _set_requires_grad(model, True)
                        _set_requires_grad(ref_model.module, True)
                    if iter_idx == no_grad_iter_idx:
                        with torch.no_grad():
                            losses.append(_model(inp).sum())
                    else:
                        losses.append(_model(inp).sum())
                        losses[-1].backward()
                        _optim.step()
                        _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
                self.assertEqual(losses[0], losses[1])
            self.assertTrue(backward_count >= num_linears - 1)

    @skip_if_lt_x_gpu(2)
    def test_multi_forward_mixed_requires_grad(self):
        """Trained and frozen modules that take part several times in one forward."""
        self.run_subtests(
            {"reshard_after_forward": [True, False, self.world_size]},
            self._test_multi_forward_mixed_requires_grad,
        )

    def _test_multi_forward_mixed_requires_grad(self, reshard_after_forward):
        torch.manual_seed(42)
        model = MultiForwardModule(torch.device("cpu"))
        ref_model = DDP(copy.deepcopy(model).cuda(), device_ids=[self.rank])
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        for module in model.modules():
            if isinstance(module, nn.Linear):
                fully_shard(module, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        for iter_idx in range(4):
            inp = torch.randn((8, 5), device="cuda")
            losses = []
            for _model, _optim in ((ref_model, ref_optim), (model, optim)):
                _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
                losses.append(_model(inp).sum())
                losses[-1].backward()
                _optim.step()
            self.assertEqual(losses[0], losses[1])


class MultiForwardModule(nn.Module):
    def __init__(self, device: torch.device):
        super().__init__()
        self.layer_0 = nn.Linear(5, 5, device=device)
        self.layer_no_grad = nn.Linear(5, 5, device=device)
        self.layer_with_grad = nn.Linear(5, 5, device=device)
        self.layer_no_grad.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer_0(x)
        for _ in range(3):
            x = self.layer_no_grad(F.relu(self.layer_with_grad(x)))
            # The same layer with and without gradients enabled
            with torch.no_grad():
                x += F.relu(self.layer_with_grad(x))
        return x


if __name__ == "__main__":
    run_tests()
