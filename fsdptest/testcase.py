"""``FSDPTest``: a distributed test with the helpers FSDP's upstream test files use."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from fsdptest import parity
from fsdptest.api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from fsdptest.interface import DeviceInitMode, FSDPInitMode, ModelFactory
from harness import DistributedTest


class FSDPTest(DistributedTest):
    """A distributed test with the helpers FSDP's upstream test files use."""

    def _check_cpu_offload(self, fsdp_model: Any, cpu_offload: Any) -> None:
        self.assertEqual(cpu_offload, fsdp_model.cpu_offload)

    def _check_backward_prefetch(self, fsdp_model: Any, backward_prefetch: Any) -> None:
        self.assertEqual(backward_prefetch, fsdp_model.backward_prefetch)

    def _check_forward_prefetch(self, fsdp_model: Any, forward_prefetch: bool) -> None:
        self.assertEqual(forward_prefetch, fsdp_model.forward_prefetch)

    def _test_fsdp_parity(
        self,
        model_class: ModelFactory,
        fsdp_init_mode: FSDPInitMode,
        cuda_init_mode: DeviceInitMode,
        ref_init_fn: Callable[[nn.Module], nn.Module] | None = None,
        num_iters: int = 2,
        save_model: bool = True,
        cpu_offload: CPUOffload | None = None,
        backward_prefetch: BackwardPrefetch | None = None,
        sharding_strategy: ShardingStrategy | None = None,
        mixed_precision: MixedPrecision | None = None,
        forward_prefetch: bool = False,
        use_orig_params: bool = False,
        enable_sharded_grad_scaler: bool = False,
        use_pure_fp16: bool = False,
        init_kwargs: Mapping[str, Any] | None = None,
        sharded_grad_scaler_kwargs: Mapping[str, Any] | None = None,
        **fsdp_kwargs: Any,
    ) -> None:
        """Trains ``model_class`` under FSDP and under a data-parallel reference (DDP, or
        ``ref_init_fn(model)``) in lockstep and checks that they agree (see
        ``harness.parity``). ``cuda_init_mode`` says when the model moves to the test's
        device; ``cpu_offload=None`` means no offloading, like ``CPUOffload()``."""
        config = parity.ParityConfig(
            fsdp_init_mode=fsdp_init_mode,
            device_init_mode=cuda_init_mode,
            num_iters=num_iters,
            save_model=save_model,
            cpu_offload=cpu_offload,
            backward_prefetch=backward_prefetch,
            sharding_strategy=sharding_strategy,
            mixed_precision=mixed_precision,
            forward_prefetch=forward_prefetch,
            use_orig_params=use_orig_params,
            enable_sharded_grad_scaler=enable_sharded_grad_scaler,
            use_pure_fp16=use_pure_fp16,
            init_kwargs=init_kwargs or {},
            sharded_grad_scaler_kwargs=sharded_grad_scaler_kwargs or {},
            fsdp_kwargs=fsdp_kwargs,
        )
        parity.check_fsdp_parity(self, self.process_group, model_class, config, ref_init_fn)

    def _train_for_several_steps(
        self,
        model: nn.Module,
        num_steps: int,
        autocast: bool,
        lr: float = 0.01,
        fsdp_cpu_offload: CPUOffload | None = None,
        save_model: bool = False,
        mixed_precision: MixedPrecision | None = None,
        enable_sharded_grad_scaler: bool = False,
        use_pure_fp16: bool = False,
        sharded_grad_scaler_kwargs: Mapping[str, Any] | None = None,
    ) -> torch.Tensor:
        """Trains ``model`` (a wrapper around an ``FSDPTestModel``) for ``num_steps``
        steps of SGD with momentum; returns the last loss (see ``harness.parity.Trainer``)."""
        options = parity.TrainOptions(
            autocast=autocast,
            lr=lr,
            cpu_offload=fsdp_cpu_offload,
            save_model=save_model,
            mixed_precision=mixed_precision,
            enable_sharded_grad_scaler=enable_sharded_grad_scaler,
            use_pure_fp16=use_pure_fp16,
            sharded_grad_scaler_kwargs=sharded_grad_scaler_kwargs or {},
        )
        return parity.train_for_several_steps(self, model, num_steps, options)
