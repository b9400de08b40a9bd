"""Fine-tuning with frozen units (port of upstream ``test_fsdp_fine_tune.py``).

A unit whose flat parameter needs no gradient has no post-backward hook; it is
resharded by a "reshard-only" hook once the gradients of its inputs are
computed, or, when no input needs a gradient, by the end of backward. Upstream
counts the calls of torch's ``_runtime_utils._post_backward_reshard``, which
both post-backward hooks go through and the end of backward does not; our FSDP
has the same seam (``fsdptest.api.SEAMS.post_backward_reshard``).
"""

from __future__ import annotations

import copy
import pkgutil
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdptest import FSDPTest
from fsdptest.api import (
    FSDP,
    SEAMS,
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
)
from harness import current_device


class LinearUnusedInput(nn.Linear):
    def forward(self, frozen_input: torch.Tensor, learnable_input: torch.Tensor) -> torch.Tensor:
        return super().forward(frozen_input)


class ModelUnusedInput(nn.Module):
    def __init__(self, freeze: bool) -> None:
        super().__init__()
        self.layer0 = LinearUnusedInput(4, 4)
        self.layer1_frozen = LinearUnusedInput(4, 4)
        if freeze:
            for param in self.layer1_frozen.parameters():
                param.requires_grad = False
        self.layer2 = LinearUnusedInput(4, 4)

    def forward(self, frozen_input: torch.Tensor, learnable_input: torch.Tensor) -> torch.Tensor:
        x = self.layer0(frozen_input, learnable_input)
        y = self.layer1_frozen(frozen_input, learnable_input)
        z = self.layer2(frozen_input, learnable_input)
        return torch.concat([x, y, z, learnable_input])


def _ddp(module: nn.Module) -> DDP:
    device = current_device()
    return DDP(module, device_ids=[device.index]) if device.type == "cuda" else DDP(module)


class TestFSDPFineTune(FSDPTest):
    """Tests fine-tuning cases where some parameters are frozen."""

    NUM_LINEARS = 6

    world_size = 2

    def _init_seq_module(self, device: torch.device) -> nn.Module:
        torch.manual_seed(42)
        modules = []
        for _ in range(self.NUM_LINEARS):
            modules += [nn.Linear(5, 5, device=device), nn.ReLU()]
        seq = nn.Sequential(*modules)
        self._set_seq_module_requires_grad(seq, False)
        return seq

    def _set_seq_module_requires_grad(self, seq: nn.Module, requires_grad: bool) -> None:
        # Assume that the linears are leaf modules, so recursive parameters
        # (including those of an FSDP child) are that linear's.
        for i in range(self.NUM_LINEARS):
            # Only set for every other linear to test mixing frozen/non-frozen.
            if i % 2 == 0:
                for param in seq[i * 2].parameters(recurse=True):
                    param.requires_grad = requires_grad

    def test_backward_reshard_hooks(self) -> None:
        """Frozen units are resharded in backward through the post-backward
        reshard seam once their inputs' gradients are done; the first linear's
        only when its input needs a gradient (else the end of backward does it)."""
        self.run_subtests(
            {
                "device_id": [self.device],
                "sharding_strategy": [
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.SHARD_GRAD_OP,
                    ShardingStrategy.NO_SHARD,
                ],
                "use_orig_params": [False, True],
                "inp_requires_grad": [False, True],
                "unfreeze_params": [False, True],
            },
            self._test_backward_reshard_hooks,
        )

    def _test_backward_reshard_hooks(
        self,
        device_id: torch.device,
        sharding_strategy: ShardingStrategy,
        use_orig_params: bool,
        inp_requires_grad: bool,
        unfreeze_params: bool,
    ) -> None:
        seq = self._init_seq_module(device_id)
        policy = ModuleWrapPolicy({nn.Linear})
        seq = FSDP(
            seq,
            auto_wrap_policy=policy,
            sharding_strategy=sharding_strategy,
            use_orig_params=use_orig_params,
            device_id=device_id,
        )
        orig_post_backward_reshard = pkgutil.resolve_name(SEAMS.post_backward_reshard)
        post_backward_reshard_count = 0

        def _post_backward_reshard_with_count(*args: Any, **kwargs: Any) -> Any:
            nonlocal post_backward_reshard_count
            post_backward_reshard_count += 1
            return orig_post_backward_reshard(*args, **kwargs)

        def _assert_post_backward_requires_grad(seq: nn.Module) -> None:
            if step_idx == num_steps - 1 and unfreeze_params:
                self.assertTrue(
                    all(p.requires_grad for p in seq.parameters()),
                    msg="Expected all parameters to require grad but some did not!",
                )

        def _assert_post_backward_reshard_count(step_idx: int, num_steps: int) -> None:
            if step_idx < num_steps - 1 or not unfreeze_params:
                # If the input does not require gradient, then the 0th
                # frozen linear gets resharded in the catch-all reshard
                # since we cannot register an autograd hook on it.
                expected_post_backward_reshard_count = (
                    self.NUM_LINEARS if inp_requires_grad else self.NUM_LINEARS - 1
                )
            else:
                # All parameters require gradient, so this should always be
                # the number of linears.
                expected_post_backward_reshard_count = self.NUM_LINEARS
            self.assertEqual(post_backward_reshard_count, expected_post_backward_reshard_count)

        with mock.patch(SEAMS.post_backward_reshard, _post_backward_reshard_with_count):
            num_steps = 3
            # Interleave a `no_grad` step to check that post-backward hooks are
            # not registered then, nor left behind for the next step.
            nograd_step_idx = 1
            for step_idx in range(num_steps):
                if unfreeze_params and step_idx == num_steps - 1:
                    # Unfreeze the parameters on the last step to emulate some
                    # kinds of fine-tuning.
                    self._set_seq_module_requires_grad(seq, True)
                inp = torch.randn((8, 5), device=self.device, requires_grad=inp_requires_grad)
                if step_idx == nograd_step_idx:
                    with torch.no_grad():
                        output = seq(inp)
                else:
                    output = seq(inp)
                if step_idx != nograd_step_idx:
                    output.sum().backward()
                    _assert_post_backward_requires_grad(seq)
                    _assert_post_backward_reshard_count(step_idx, num_steps)
                    post_backward_reshard_count = 0

    def _init_multi_traversal_module(self) -> nn.Module:
        torch.manual_seed(42)

        class TestModule(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.layer_0 = nn.Linear(5, 5, device=current_device())
                self.layer_no_grad = nn.Linear(5, 5, device=current_device())
                self.layer_with_grad = nn.Linear(5, 5, device=current_device())
                self.layer_no_grad.requires_grad_(False)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                # Layers `layer_no_grad` and `layer_with_grad` are called
                # multiple times, i.e. their parameters are used multiple times
                # during forward pass.
                x = self.layer_0(x)
                for _ in range(10):
                    x = self.layer_no_grad(self.layer_with_grad(x))
                    # Make sure calling the same layer multiple times works
                    # regardless of whether gradient is enabled.
                    with torch.no_grad():
                        x += self.layer_with_grad(x)
                return x

        return TestModule()

    def test_hooks_multi_traversal(self) -> None:
        """Units used several times per forward, with and without gradient,
        train like DDP."""
        self.run_subtests(
            {
                "sharding_strategy": [
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.SHARD_GRAD_OP,
                    ShardingStrategy.NO_SHARD,
                ],
                "use_orig_params": [False, True],
                "inp_requires_grad": [False, True],
                "forward_prefetch": [False, True],
            },
            self._test_hooks_multi_traversal,
        )

    def _test_hooks_multi_traversal(
        self,
        sharding_strategy: ShardingStrategy,
        use_orig_params: bool,
        inp_requires_grad: bool,
        forward_prefetch: bool,
    ) -> None:
        seq = self._init_multi_traversal_module()
        policy = ModuleWrapPolicy({nn.Linear})
        fsdp_seq = FSDP(
            copy.deepcopy(seq),
            auto_wrap_policy=policy,
            sharding_strategy=sharding_strategy,
            use_orig_params=use_orig_params,
            forward_prefetch=forward_prefetch,
            device_id=self.device,
        )
        ddp_seq = _ddp(copy.deepcopy(seq))
        fsdp_optim = torch.optim.Adam(fsdp_seq.parameters(), lr=1e-2)
        ddp_optim = torch.optim.Adam(ddp_seq.parameters(), lr=1e-2)
        torch.manual_seed(self.rank + 1)
        losses = []
        for _ in range(6):
            inp = torch.randn((8, 5), device=self.device, requires_grad=inp_requires_grad)
            for seq, optim in ((fsdp_seq, fsdp_optim), (ddp_seq, ddp_optim)):
                loss = seq(inp).sum()
                losses.append(loss)
                loss.backward()
                optim.step()
                optim.zero_grad()
            torch.testing.assert_close(losses[0], losses[1])
            losses.clear()

    def test_parity_with_ddp(self) -> None:
        """A model with alternating frozen linears trains like DDP."""
        self.run_subtests(
            {
                "sharding_strategy": [
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.SHARD_GRAD_OP,
                    ShardingStrategy.NO_SHARD,
                ],
                "use_orig_params": [False, True],
            },
            self._test_parity_with_ddp,
        )

    def _test_parity_with_ddp(
        self, sharding_strategy: ShardingStrategy, use_orig_params: bool
    ) -> None:
        seq = self._init_seq_module(self.device)
        policy = ModuleWrapPolicy({nn.Linear})
        fsdp_seq = FSDP(
            copy.deepcopy(seq),
            auto_wrap_policy=policy,
            sharding_strategy=sharding_strategy,
            use_orig_params=use_orig_params,
            device_id=self.device,
        )
        ddp_seq = _ddp(copy.deepcopy(seq))
        fsdp_optim = torch.optim.Adam(fsdp_seq.parameters(), lr=1e-2)
        ddp_optim = torch.optim.Adam(ddp_seq.parameters(), lr=1e-2)
        torch.manual_seed(self.rank + 1)
        losses = []
        for _ in range(6):
            inp = torch.randn((8, 5), device=self.device)
            for seq, optim in ((fsdp_seq, fsdp_optim), (ddp_seq, ddp_optim)):
                loss = seq(inp).sum()
                losses.append(loss)
                loss.backward()
                optim.step()
                optim.zero_grad()
            if self.device.type == "cuda":
                torch.testing.assert_close(losses[0], losses[1])
            else:
                # upstream's tolerance for devices other than CUDA
                torch.testing.assert_close(losses[0], losses[1], atol=1e-03, rtol=1e-03)
            losses.clear()

    def test_parity_with_non_frozen_fsdp(self) -> None:
        """A frozen unit whose output needs no gradient (it may be resharded
        without a backward unshard) trains exactly like the same unit left out
        of the optimizer, with offloading, mixed precision and both prefetches."""
        self.run_subtests(
            {
                "device_id": [self.device],
                "sharding_strategy": [
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.SHARD_GRAD_OP,
                ],
                "use_orig_params": [True, False],
                "offload_params": [True, False],
                "mixed_precision": [
                    MixedPrecision(),
                    MixedPrecision(
                        param_dtype=torch.float16,
                        buffer_dtype=torch.float16,
                        reduce_dtype=torch.float16,
                    ),
                ],
                "backward_prefetch": [
                    BackwardPrefetch.BACKWARD_PRE,
                    BackwardPrefetch.BACKWARD_POST,
                ],
            },
            self._test_parity_with_non_frozen_fsdp,
        )

    def _test_parity_with_non_frozen_fsdp(
        self,
        device_id: torch.device,
        sharding_strategy: ShardingStrategy,
        use_orig_params: bool,
        offload_params: bool,
        mixed_precision: MixedPrecision,
        backward_prefetch: BackwardPrefetch,
    ) -> None:
        torch.manual_seed(42)
        model = ModelUnusedInput(freeze=True).to(self.device)
        torch.manual_seed(42)
        ref_model = ModelUnusedInput(freeze=False).to(self.device)
        fsdp_kwargs = {
            "device_id": device_id,
            "auto_wrap_policy": ModuleWrapPolicy({LinearUnusedInput}),
            "sharding_strategy": sharding_strategy,
            "use_orig_params": use_orig_params,
            "cpu_offload": CPUOffload(offload_params=offload_params),
            "mixed_precision": mixed_precision,
            "backward_prefetch": backward_prefetch,
        }
        model = FSDP(model, **fsdp_kwargs)
        ref_model = FSDP(ref_model, **fsdp_kwargs)
        model_optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        ref_optim = torch.optim.Adam(
            [
                param
                for name, param in ref_model.named_parameters()
                if not name.startswith("_fsdp_wrapped_module.layer1_frozen")
            ],
            lr=1e-2,
        )
        torch.manual_seed(self.rank + 1)
        losses = []
        for _ in range(6):
            frozen_input = torch.randn((4, 4), device=self.device, requires_grad=False)
            for _model, _optim in ((model, model_optim), (ref_model, ref_optim)):
                loss = _model(frozen_input, frozen_input).sum()
                losses.append(loss)
                loss.backward()
                _optim.step()
                _optim.zero_grad()
            self.assertEqual(losses[0], losses[1])
            losses.clear()
        with FSDP.summon_full_params(model), FSDP.summon_full_params(ref_model):
            for param, ref_param in zip(model.parameters(), ref_model.parameters()):
                self.assertEqual(param, ref_param)
