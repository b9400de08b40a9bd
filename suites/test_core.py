"""Parity with DDP and the core runtime (port of upstream ``test_fsdp_core.py``).

[Note: Delays on the CPU]
The delayed tests inject a delay after the loss, before each gradient
reduce-scatter or before each reshard. On CUDA the delay is a spin kernel that
FSDP's communication streams must wait for. Upstream uses 250 ms; the kernels of
these models take microseconds, so 50 ms opens the same window for a missing
synchronisation to show, at a fifth of the GPU time (the MoE and reduce-scatter
tests sleep several times per step, in hundreds of subtests). On the CPU the
ranks run on gloo, whose collectives are synchronous, and there are no streams
to race: the delay only has to be on the path, so it is 25 ms there.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import pkgutil
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
from torch import nn

from fsdptest import FSDPTest
from fsdptest.api import (
    FSDP,
    SEAMS,
    BackwardPrefetch,
    CPUOffload,
    FlatParamHandle,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
)
from fsdptest.interface import DeviceInitMode, FSDPInitMode, ModelFactory
from harness import parametrize, subtest_name
from models import (
    AlwaysWrapNestedWrappedModule,
    DummyDDP,
    MixtureOfExperts,
    NestedWrappedModule,
    NestedWrappedModuleWithDelay,
    TransformerWithSharedParams,
)

params = "cpu_offload,sharding_strategy"
cpu_offload_config = [CPUOffload(offload_params=True), CPUOffload(offload_params=False)]
sharding_strategy_config = [None, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD]
configs = list(itertools.product(cpu_offload_config, sharding_strategy_config))
test_name_mapping = {
    str(CPUOffload(offload_params=True)): "offload_true",
    str(CPUOffload(offload_params=False)): "offload_false",
    str(ShardingStrategy.SHARD_GRAD_OP): "shard_grad_op",
    str(ShardingStrategy.NO_SHARD): "no_shard",
}
config_name = functools.partial(subtest_name, test_name_mapping)

CUDA_DELAY_MS = 50  # see [Note: Delays on the CPU]
CPU_DELAY_MS = 25  # see [Note: Delays on the CPU]


def init_mode(cuda_first: bool) -> DeviceInitMode:
    return DeviceInitMode.BEFORE if cuda_first else DeviceInitMode.AFTER


def fsdp_kwargs_with(mixed_precision: MixedPrecision | None) -> dict[str, Any]:
    return {} if mixed_precision is None else {"mixed_precision": mixed_precision}


class TestParityWithDDP(FSDPTest):
    """Compares losses and parameter values after several updates when using
    PyTorch DDP vs. FullyShardedDataParallel."""

    def _get_cuda_init_modes(self, cpu_offload: CPUOffload) -> list[DeviceInitMode]:
        modes = [DeviceInitMode.AFTER, DeviceInitMode.BEFORE]
        # NEVER works only with parameter offloading, which brings the parameters
        # to the device explicitly; otherwise a CUDA run would all-gather CPU
        # tensors, which NCCL does not support.
        if cpu_offload.offload_params:
            modes.append(DeviceInitMode.NEVER)
        return modes

    def _get_subtest_config(self, cpu_offload: CPUOffload) -> dict[str, list[Any]]:
        """Subtests the device initialization modes and prefetching settings together."""
        return {
            "cuda_init_mode": self._get_cuda_init_modes(cpu_offload),
            "backward_prefetch": [
                None,
                BackwardPrefetch.BACKWARD_PRE,
                BackwardPrefetch.BACKWARD_POST,
            ],
            "forward_prefetch": [False, True],
            "use_orig_params": [False, True],
        }

    def _delay_ms(self) -> int:
        """See [Note: Delays on the CPU]."""
        return CUDA_DELAY_MS if self.device.type == "cuda" else CPU_DELAY_MS

    def _run_parity_subtests(
        self,
        model_class: ModelFactory,
        cpu_offload: CPUOffload,
        sharding_strategy: ShardingStrategy | None,
        **kwargs: Any,
    ) -> None:
        self.run_subtests(
            self._get_subtest_config(cpu_offload),
            self._test_fsdp_parity,
            model_class,
            FSDPInitMode.RECURSIVE,
            cpu_offload=cpu_offload,
            sharding_strategy=sharding_strategy,
            **kwargs,
        )

    @parametrize(params, configs, config_name)
    def test_nested_wrapped_model(
        self, cpu_offload: CPUOffload, sharding_strategy: ShardingStrategy | None
    ) -> None:
        """NestedWrappedModule under FSDP trains like under DDP."""
        self._run_parity_subtests(NestedWrappedModule, cpu_offload, sharding_strategy)

    @parametrize(params, configs, config_name)
    def test_nested_wrapped_model_single_iteration_mixed_precision(
        self, cpu_offload: CPUOffload, sharding_strategy: ShardingStrategy | None
    ) -> None:
        """One fp16 mixed-precision iteration of NestedWrappedModule matches the
        reference under autocast."""
        mixed_precision = MixedPrecision(
            param_dtype=torch.float16,
            buffer_dtype=torch.float16,
            reduce_dtype=torch.float16,
        )
        self._run_parity_subtests(
            NestedWrappedModule,
            cpu_offload,
            sharding_strategy,
            num_iters=1,
            mixed_precision=mixed_precision,
        )

    @parametrize(params, configs, config_name)
    def test_nested_always_wrap_model(
        self, cpu_offload: CPUOffload, sharding_strategy: ShardingStrategy | None
    ) -> None:
        """NestedWrappedModule with every module its own unit trains like under DDP."""
        self._run_parity_subtests(AlwaysWrapNestedWrappedModule, cpu_offload, sharding_strategy)

    @parametrize(params, configs, config_name)
    def test_transformer(
        self, cpu_offload: CPUOffload, sharding_strategy: ShardingStrategy | None
    ) -> None:
        """The transformer with shared parameters trains like under DDP."""
        self._run_parity_subtests(TransformerWithSharedParams, cpu_offload, sharding_strategy)

    @parametrize(params, configs, config_name)
    def test_delayed_optim_step(
        self, cpu_offload: CPUOffload, sharding_strategy: ShardingStrategy | None
    ) -> None:
        """A long device delay after the loss (before the optimizer step) changes no
        result: the next forward's all-gathers wait for the step to complete."""
        self._run_parity_subtests(
            NestedWrappedModuleWithDelay,
            cpu_offload,
            sharding_strategy,
            init_kwargs={"delay_after_loss_ms": self._delay_ms()},
        )

    @parametrize(params, configs, config_name)
    def test_delayed_reduce_scatter(
        self, cpu_offload: CPUOffload, sharding_strategy: ShardingStrategy | None
    ) -> None:
        """A long device delay before each gradient reduce-scatter changes no result:
        the backward waits for the reductions to finish."""
        self._run_parity_subtests(
            NestedWrappedModuleWithDelay,
            cpu_offload,
            sharding_strategy,
            init_kwargs={"delay_before_reduction_ms": self._delay_ms()},
        )

    def _dummy_ddp_fn(self, model: nn.Module) -> nn.Module:
        # MixtureOfExperts reduces its gradients by its own logic, which the
        # reference must follow instead of DDP's.
        return DummyDDP(model)

    @parametrize(params, configs, config_name)
    def test_mixture_of_experts(
        self, cpu_offload: CPUOffload, sharding_strategy: ShardingStrategy | None
    ) -> None:
        """MixtureOfExperts (rank-local experts) trains like its hand-reduced reference."""
        self._run_parity_subtests(
            MixtureOfExperts, cpu_offload, sharding_strategy, ref_init_fn=self._dummy_ddp_fn
        )

    @parametrize(params, configs, config_name)
    def test_mixture_of_experts_with_delay_before_free(
        self, cpu_offload: CPUOffload, sharding_strategy: ShardingStrategy | None
    ) -> None:
        """A long device delay before each free of unsharded parameters in forward
        changes no result of MixtureOfExperts."""
        self._run_parity_subtests(
            MixtureOfExperts,
            cpu_offload,
            sharding_strategy,
            ref_init_fn=self._dummy_ddp_fn,
            init_kwargs={"delay_before_free_ms": self._delay_ms()},
        )


class TestParamInit(FSDPTest):
    @parametrize("mixed_precision", [True, False])
    def test_param_change_after_init(self, mixed_precision: bool) -> None:
        """Changing an FSDP model's parameter values in place after FSDP
        initialization persists into the next forward."""
        fsdp_kwargs = fsdp_kwargs_with(MixedPrecision() if mixed_precision else None)
        # The reference behavior.
        fsdp_model = self._init_transformer(fsdp_kwargs)
        input = fsdp_model.module.get_input(self.device)
        ref_output = fsdp_model(*input)
        # The same model with its first parameter changed after FSDP init.
        new_fsdp_model = self._init_transformer(fsdp_kwargs)
        first_param = next(new_fsdp_model.parameters())
        nn.init.normal_(first_param.data)
        new_output = new_fsdp_model(*input)
        self.assertNotEqual(
            ref_output,
            new_output,
            msg="new_output did not reflect change to param after init",
        )

    def _init_transformer(self, fsdp_kwargs: dict[str, Any]) -> nn.Module:
        return TransformerWithSharedParams.init(
            self.process_group,
            FSDPInitMode.RECURSIVE,
            DeviceInitMode.AFTER,
            fsdp_kwargs,
            deterministic=True,
        )


class TestHooks(FSDPTest):
    @parametrize("cuda_first", [False, True])
    def test_pre_backward_hook_registration(self, cuda_first: bool) -> None:
        """FSDP registers one pre-backward hook on the forward output, and it stays
        through backward and the optimizer step."""
        fsdp_model = TransformerWithSharedParams.init(
            self.process_group, FSDPInitMode.RECURSIVE, init_mode(cuda_first)
        )
        self._test_pre_backward_hook_registration(fsdp_model)

    def test_pre_backward_hook_registration_after_state_dict(self) -> None:
        """The pre-backward hook is registered the same after training and a state
        dict save and load."""
        fsdp_model = TransformerWithSharedParams.init(
            self.process_group, FSDPInitMode.RECURSIVE, DeviceInitMode.AFTER
        )
        self._train_for_several_steps(fsdp_model, num_steps=2, autocast=False)
        state_dict = fsdp_model.state_dict()
        fsdp_model.load_state_dict(state_dict)
        self._test_pre_backward_hook_registration(fsdp_model)

    def _test_pre_backward_hook_registration(self, model: nn.Module) -> None:
        optim = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        optim.zero_grad()
        # Inputs are always on the device, where the computation happens.
        input = model.module.get_input(self.device)
        output = model(*input)
        # One pre-backward hook is registered ...
        self.assertEqual(len(output._backward_hooks), 1)
        loss = model.module.get_loss(input, output).to(self.device)
        loss.backward()
        # ... and it is not removed.
        self.assertEqual(len(output._backward_hooks), 1)
        optim.step()
        self.assertEqual(len(output._backward_hooks), 1)

    @parametrize("cuda_first", [False, True])
    @parametrize("mixed_precision", [True, False])
    def test_register_functions_called(self, cuda_first: bool, mixed_precision: bool) -> None:
        """``_register_{pre|post}_backward_hooks()`` are called during the FSDP forward."""
        fsdp_kwargs = fsdp_kwargs_with(MixedPrecision() if mixed_precision else None)
        fsdp_model = TransformerWithSharedParams.init(
            self.process_group, FSDPInitMode.RECURSIVE, init_mode(cuda_first), fsdp_kwargs
        )
        input = fsdp_model.module.get_input(self.device)

        # `_register_pre_backward_hooks()` changes the forward output, so it cannot be
        # replaced by a mock: a wrapper counts its calls instead.
        orig_register_pre_backward_hooks = pkgutil.resolve_name(SEAMS.register_pre_backward_hooks)
        register_pre_backward_hooks_call_count = 0

        def _register_pre_backward_hooks_with_count(*args: Any, **kwargs: Any) -> Any:
            nonlocal register_pre_backward_hooks_call_count
            register_pre_backward_hooks_call_count += 1
            return orig_register_pre_backward_hooks(*args, **kwargs)

        with (
            mock.patch(SEAMS.register_pre_backward_hooks, _register_pre_backward_hooks_with_count),
            mock.patch(SEAMS.register_post_backward_hook) as register_post_bwd_mock,
        ):
            self.assertEqual(register_pre_backward_hooks_call_count, 0)
            self.assertFalse(register_post_bwd_mock.called)
            fsdp_model(*input)
            self.assertTrue(register_pre_backward_hooks_call_count > 0)
            self.assertTrue(register_post_bwd_mock.called)


class TestNoGrad(FSDPTest):
    @parametrize("mixed_precision", [True, False])
    def test_transformer_no_grad(self, mixed_precision: bool) -> None:
        """After one training step of the FSDP transformer with shared parameters, a
        forward in ``eval()`` gives the same output as one under ``torch.no_grad()``."""
        fp16 = MixedPrecision(
            param_dtype=torch.float16,
            reduce_dtype=torch.float16,
            buffer_dtype=torch.float16,
        )
        fsdp_kwargs = {"mixed_precision": fp16 if mixed_precision else None}
        fsdp_model = TransformerWithSharedParams.init(
            self.process_group, FSDPInitMode.RECURSIVE, DeviceInitMode.AFTER, fsdp_kwargs
        )
        self._train_for_several_steps(
            fsdp_model,
            num_steps=1,
            autocast=False,
            mixed_precision=fsdp_kwargs["mixed_precision"],
        )
        input = fsdp_model.module.get_input(self.device)
        # Forward in eval mode ...
        fsdp_model.eval()
        ref_output = fsdp_model(*input)
        # ... and under `no_grad()`.
        with torch.no_grad():
            no_grad_output = fsdp_model(*input)
        self.assertEqual(ref_output, no_grad_output)


NUM_LINEARS = 5
UseUnshardedViews = Callable[[FlatParamHandle, bool], None]


class TestAutograd(FSDPTest):
    def test_unshard_params_as_tensors(self) -> None:
        """FSDP unshards the logical parameters as ``Tensor`` views (not parameter
        views) for forward and backward, also when prefetching forward or backward."""
        self.run_subtests(
            {
                # NO_SHARD is left out: it checks sharded views through
                # `_use_unsharded_views()`. FULL_SHARD and SHARD_GRAD_OP suffice to
                # check the `as_params` logic.
                "sharding_strategy": [
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.SHARD_GRAD_OP,
                ],
                "use_orig_params": [False, True],
                "forward_prefetch": [False, True],
                "backward_prefetch": [
                    BackwardPrefetch.BACKWARD_PRE,
                    BackwardPrefetch.BACKWARD_POST,
                    None,
                ],
            },
            self._test_unshard_params_as_tensors,
        )

    def _test_unshard_params_as_tensors(
        self,
        sharding_strategy: ShardingStrategy,
        use_orig_params: bool,
        forward_prefetch: bool,
        backward_prefetch: BackwardPrefetch | None,
    ) -> None:
        orig_use_unsharded_views = FlatParamHandle._use_unsharded_views

        def _use_unsharded_views_assert_as_tensors(self: FlatParamHandle, as_params: bool) -> None:
            if as_params:
                raise AssertionError("Expects to use Tensor views but using parameter views")
            return orig_use_unsharded_views(self, as_params)

        fsdp_kwargs = {
            "sharding_strategy": sharding_strategy,
            "use_orig_params": use_orig_params,
            "forward_prefetch": forward_prefetch,
            "backward_prefetch": backward_prefetch,
            "auto_wrap_policy": ModuleWrapPolicy({nn.Linear}),
        }
        # Enough FSDP instances to prefetch.
        model = nn.Sequential(*[nn.Linear(3, 3, device=self.device) for _ in range(NUM_LINEARS)])
        fsdp_model = FSDP(model, **fsdp_kwargs)
        self.assertEqual(len(list(FSDP.fsdp_modules(fsdp_model))), NUM_LINEARS + 1)
        for _ in range(3):
            inp = torch.randn((2, 3), device=self.device)
            with self._patch_use_unsharded_views(_use_unsharded_views_assert_as_tensors):
                loss = fsdp_model(inp).sum()
                loss.backward()

    @contextlib.contextmanager
    def _patch_use_unsharded_views(
        self, new_use_unsharded_views: UseUnshardedViews
    ) -> Iterator[None]:
        orig_use_unsharded_views = FlatParamHandle._use_unsharded_views
        FlatParamHandle._use_unsharded_views = new_use_unsharded_views
        try:
            yield
        finally:
            FlatParamHandle._use_unsharded_views = orig_use_unsharded_views
