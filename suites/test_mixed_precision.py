"""Mixed precision (port of upstream ``test_fsdp_mixed_precision.py``).

What is pinned down: the dtypes FSDP gives inputs, parameters, buffers and
gradients under ``MixedPrecision``, and the dtype each gradient reduce-scatter
runs in (checked on the collective's input through ``patch_reduce_scatter``).

[Note: bfloat16 configurations]
Upstream adds ``mp_diff_buffer_and_reduce`` (bfloat16 buffers) only when NCCL
reduces bfloat16. Here it is added when a backend the ranks may run on does:
NCCL from 2.10 on where CUDA is present, gloo from torch 2.13 on. The
parametrization is decided at import, in the pytest process, where CUDA must
not be initialised: only the torch version and the NCCL library version are
read. A rank that lands on a backend without bfloat16 reductions (gloo before
torch 2.13: a CPU run, or a GPU machine whose xdist worker owns too few GPUs)
skips a bfloat16 configuration with that reason, and the single-configuration
tests fall back to ``default_mp`` there.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn import TransformerDecoderLayer, TransformerEncoderLayer
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.torch_version import TorchVersion

from fsdptest import FSDPTest
from fsdptest.api import (
    _FSDP_USE_FULL_PREC_IN_EVAL,
    ADAPTER,
    COMPOSABLE_FULLY_SHARD_MISSING,
    FSDP,
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardedGradScaler,
    ShardingStrategy,
    composable_fully_shard,
    size_based_auto_wrap_policy,
)
from fsdptest.interface import DeviceInitMode, FSDPInitMode
from harness import collectives, parametrize, subtest_name
from harness.collectives import Collective, current
from models import SaveForwardInputsModel, TransformerWithSharedParams, resnet50


def _gloo_supports_bf16() -> bool:
    return TorchVersion(torch.__version__) >= "2.13"


def _nccl_supports_bf16() -> bool:
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        return False
    return torch.cuda.nccl.version() >= (2, 10)


# See [Note: bfloat16 configurations].
backend_supports_bf16 = _gloo_supports_bf16() or _nccl_supports_bf16()


def _rank_supports_bf16() -> bool:
    """Whether this rank's backend reduces bfloat16 (called in a rank)."""
    return dist.get_backend() != "gloo" or _gloo_supports_bf16()


def _uses_bf16(mp: MixedPrecision) -> bool:
    return torch.bfloat16 in (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype)


# Parameters, buffers and reductions all in fp16.
default_mp = MixedPrecision(
    param_dtype=torch.float16,
    buffer_dtype=torch.float16,
    reduce_dtype=torch.float16,
)
# Parameters and buffers stay in full precision; only the reduction is in fp16.
mp_only_reduce = MixedPrecision(reduce_dtype=torch.float16)
# Parameters and buffers in fp16, so the reduction runs in the parameter dtype.
mp_only_param_and_buf = MixedPrecision(param_dtype=torch.float16, buffer_dtype=torch.float16)
# Nothing is cast: parameters, reductions, gradients and buffers in full precision.
mp_no_mixed_precision = MixedPrecision()

mp_diff_buffer_and_reduce = MixedPrecision(
    param_dtype=torch.float16,
    buffer_dtype=torch.bfloat16,
    reduce_dtype=torch.float32,
)

mp_configs = [default_mp, mp_only_reduce, mp_only_param_and_buf, mp_no_mixed_precision]
if backend_supports_bf16:
    mp_configs.extend([mp_diff_buffer_and_reduce])

# The buffers' original dtype, which differs from the parameters'.
_BUFFER_ORIG_DTYPE = torch.float64

params = "mp_config,cpu_offload,full_precision_param_dtype,enable_sharded_grad_scaler"
cpu_offload_config = [CPUOffload(offload_params=True), CPUOffload(offload_params=False)]
full_precision_param_dtype_config = [torch.float32, torch.float64]
enable_sharded_grad_scaler = ["enable_sharded_grad_scaler", None]

configs = list(
    itertools.product(
        mp_configs,
        cpu_offload_config,
        full_precision_param_dtype_config,
        enable_sharded_grad_scaler,
    )
)

test_name_mapping = {
    str(CPUOffload(offload_params=True)): "offload_true",
    str(CPUOffload(offload_params=False)): "offload_false",
    str(default_mp): "mp_fp16",
    str(mp_only_reduce): "mp_only_reduce",
    str(mp_only_param_and_buf): "mp_only_param_and_buf",
    str(mp_no_mixed_precision): "mp_no_mp",
    str(torch.float32): "fp32",
    str(torch.float64): "fp64",
    "enable_sharded_grad_scaler": "enable_sharded_grad_scaler",
}
if backend_supports_bf16:
    test_name_mapping.update({str(mp_diff_buffer_and_reduce): "mp_diff_buffer_reduce"})

e2e_subtest_name = partial(subtest_name, test_name_mapping)

_CURRENT_FULL_PRECISION_PARAM_DTYPE: torch.dtype | None = None


@contextlib.contextmanager
def patch_reduce_scatter(
    new_reduce_scatter: Callable[..., Any], full_precision_param_dtype: torch.dtype
) -> Iterator[None]:
    """Routes every reduce-scatter through ``new_reduce_scatter`` and publishes the
    full-precision dtype its validation expects, both undone on exit. The harness
    patch replaces every name of the collective, for both implementations."""
    global _CURRENT_FULL_PRECISION_PARAM_DTYPE
    _CURRENT_FULL_PRECISION_PARAM_DTYPE = full_precision_param_dtype
    try:
        with collectives.patch_reduce_scatter(new_reduce_scatter):
            yield
    finally:
        _CURRENT_FULL_PRECISION_PARAM_DTYPE = None


# What ``LinearMixedPrecision`` takes and returns: (input or activation, the
# test case, the FSDP model, the mixed precision config, the full-precision dtype).
CheckedTuple = tuple[torch.Tensor, "TestFSDPMixedPrecision", nn.Module, MixedPrecision, torch.dtype]


class LinearMixedPrecision(nn.Module):
    """A bias-free ``Linear(10, 10)`` in ``param_dtype`` and a float64 buffer whose
    forward (with ``run_checks``) checks the dtypes of its input, its buffer and of
    every flat parameter of the FSDP model it is given."""

    lin: nn.Linear
    buffer_name: str
    _orig_param_type: torch.dtype
    _orig_buffer_dtype: torch.dtype
    run_checks: bool

    def __init__(
        self, param_dtype: torch.dtype, buffer_name: str = "buffer", run_checks: bool = True
    ) -> None:
        super().__init__()
        self.lin = nn.Linear(10, 10, bias=False).to(param_dtype)
        # A configurable buffer name, so that submodules do not share one, which
        # could hide prefixed vs. unprefixed name bugs.
        self.buffer_name = buffer_name
        self.register_buffer(buffer_name, torch.randn((1, 2), dtype=_BUFFER_ORIG_DTYPE))
        self._orig_param_type = param_dtype
        self._orig_buffer_dtype = _BUFFER_ORIG_DTYPE
        self.run_checks = run_checks

    def forward(self, tup: CheckedTuple) -> CheckedTuple:
        inp, cls, fsdp, mp_config, full_precision_param_dtype = tup
        if self.run_checks:
            expected_param_type = mp_config.param_dtype or self._orig_param_type
            expected_buffer_type = mp_config.buffer_dtype or self._orig_buffer_dtype
            # Input and buffer are in the mixed precision dtypes.
            cls.assertEqual(inp.dtype, expected_param_type)
            cls.assertEqual(getattr(self, self.buffer_name).dtype, expected_buffer_type)
            num_active = _check_flat_param_dtypes(
                cls, fsdp, mp_config, expected_param_type, full_precision_param_dtype
            )
            # With one rank the parameter always points to the local shard, so an
            # active unit cannot be told apart; the forward itself then shows that
            # the parameter is in the low precision (the input is).
            if cls.world_size > 1:
                cls.assertGreater(num_active, 0)
        return (self.lin(inp), cls, fsdp, mp_config, full_precision_param_dtype)


def _check_flat_param_dtypes(
    cls: FSDPTest,
    fsdp: nn.Module,
    mp_config: MixedPrecision,
    expected_param_type: torch.dtype,
    full_precision_param_dtype: torch.dtype,
) -> int:
    """Checks that an active (unsharded) unit's flat parameter is in the parameter
    dtype with its low-precision shard freed, and an inactive sharded one in full
    precision; returns how many units were active."""
    num_active_fsdp = 0
    for fsdp_module in FSDP.fsdp_modules(fsdp):
        fsdp_managed_params = fsdp_module.params
        cls.assertEqual(1, len(fsdp_managed_params))  # one flat parameter per unit
        for param in fsdp_managed_params:
            param_is_sharded = (
                fsdp_module.sharding_strategy != ShardingStrategy.NO_SHARD
                and fsdp_module.world_size > 1
            )
            # A unit is active when its parameter does not point to the local
            # shard (FULL_SHARD and SHARD_GRAD_OP alike).
            is_fsdp_unit_active = (
                param_is_sharded and param.data.data_ptr() != param._local_shard.data_ptr()
            )
            if is_fsdp_unit_active:
                num_active_fsdp += 1
                cls.assertEqual(param.dtype, expected_param_type)
                # The unshard freed the low-precision shard, which exists only
                # with parameter mixed precision.
                if mp_config.param_dtype is not None:
                    cls.assertEqual(0, param._mp_shard.untyped_storage().size())
                else:
                    cls.assertFalse(hasattr(param, "_mp_shard"))
            elif param_is_sharded:
                # Freed or not yet unsharded: the parameter is the full-precision shard.
                cls.assertEqual(param.dtype, full_precision_param_dtype)
    return num_active_fsdp


class TestFSDPMixedPrecision(FSDPTest):
    @property
    def world_size(self) -> int:
        raise ValueError("To be implemented by child classes")

    def _get_simple_nested_model(
        self, param_dtype: torch.dtype, run_checks: bool, *fsdp_args: Any, **fsdp_kwargs: Any
    ) -> nn.Module:
        return FSDP(
            nn.Sequential(
                FSDP(
                    LinearMixedPrecision(
                        param_dtype, buffer_name="buffer0", run_checks=run_checks
                    ).to(self.device),
                    *fsdp_args,
                    **fsdp_kwargs,
                ),
                LinearMixedPrecision(param_dtype, buffer_name="buffer1", run_checks=run_checks).to(
                    self.device
                ),
            ),
            *fsdp_args,
            **fsdp_kwargs,
        )

    def _get_simple_nested_model_composable(
        self, param_dtype: torch.dtype, run_checks: bool, *fsdp_args: Any, **fsdp_kwargs: Any
    ) -> nn.Module:
        model = nn.Sequential(
            LinearMixedPrecision(param_dtype, buffer_name="buffer0", run_checks=run_checks).to(
                self.device
            ),
            LinearMixedPrecision(param_dtype, buffer_name="buffer1", run_checks=run_checks).to(
                self.device
            ),
        )
        composable_fully_shard(model[0], *fsdp_args, **fsdp_kwargs)
        composable_fully_shard(model, *fsdp_args, **fsdp_kwargs)
        return model

    def _get_simple_model(
        self, param_dtype: torch.dtype, *fsdp_args: Any, **fsdp_kwargs: Any
    ) -> nn.Module:
        return FSDP(LinearMixedPrecision(param_dtype).to(self.device), *fsdp_args, **fsdp_kwargs)

    def _skip_if_composable_missing(self, use_composable: bool) -> None:
        if use_composable and composable_fully_shard is None:
            pytest.skip(COMPOSABLE_FULLY_SHARD_MISSING)

    def _validate_no_mp_shard(self, fsdp_model: nn.Module) -> None:
        """Validates that no mixed precision ``_mp_shard`` was allocated."""
        for fsdp in FSDP.fsdp_modules(fsdp_model):
            for param in fsdp.params:
                self.assertFalse(hasattr(param, "_mp_shard"))

    def _validate_mp_shard_freed(self, fsdp_model: nn.Module) -> None:
        """Ensures that the mixed precision shard is freed for all FSDP units."""
        for fsdp in FSDP.fsdp_modules(fsdp_model):
            for param in fsdp.params:
                self.assertEqual(0, param._mp_shard.untyped_storage().size())

    def _validate_mp_shard(self, fsdp_model: nn.Module, mp_config: MixedPrecision) -> None:
        """Freed with parameter mixed precision, never allocated without."""
        if mp_config.param_dtype is not None:
            self._validate_mp_shard_freed(fsdp_model)
        else:
            self._validate_no_mp_shard(fsdp_model)

    def _assert_buffers_in_mixed_precision(
        self, buffers: Iterable[torch.Tensor], mp_config: MixedPrecision
    ) -> None:
        expected = mp_config.buffer_dtype or _BUFFER_ORIG_DTYPE
        for buf in buffers:
            self.assertEqual(buf.dtype, expected)

    def _reduce_scatter_validate_mp(
        self,
        orig_reduce_scatter: Callable[..., Any],
        mp_config: MixedPrecision,
        should_run_low_prec: bool,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """Runs reduce-scatter but verifies mixed precision settings before. This
        is to test mixed precision is working as expected during backward pass.
        In particular it ensures that the gradients were cast to the right type
        and comm. is going to happen in the right type."""
        tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
        # reduce_dtype has priority over param_dtype (it overrides the reduction
        # precision); without either the reduction runs in full precision.
        if should_run_low_prec:
            expected_dtype = (
                mp_config.reduce_dtype
                or mp_config.param_dtype
                or _CURRENT_FULL_PRECISION_PARAM_DTYPE
            )
        else:
            expected_dtype = _CURRENT_FULL_PRECISION_PARAM_DTYPE
        for t in tensors:
            self.assertEqual(
                expected_dtype,
                t.dtype,
                f"Expected to reduce in {expected_dtype} but got tensors in {t.dtype}",
            )
        return orig_reduce_scatter(*args, **kwargs)

    def _test_grads_reduced_precision(self, offload_params: bool, use_orig_params: bool) -> None:
        class MyModel(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin1 = nn.Linear(10, 10)
                self.lin2 = nn.Linear(10, 10)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.lin2(self.lin1(x))

        m: nn.Module = MyModel().to(self.device)
        mp = MixedPrecision(
            param_dtype=torch.float16,
            reduce_dtype=torch.float16,
            buffer_dtype=torch.float16,
            keep_low_precision_grads=True,
        )
        fsdp_kwargs = {
            "mixed_precision": mp,
            "cpu_offload": CPUOffload(offload_params=offload_params),
            "use_orig_params": use_orig_params,
        }
        m.lin1 = FSDP(m.lin1, **fsdp_kwargs)
        m = FSDP(m, **fsdp_kwargs)
        for _ in range(6):
            inp = torch.ones(1, 10)
            m(inp).sum().backward()
            for param in m.parameters():
                if param.grad is not None:
                    self.assertEqual(torch.float16, param.grad.dtype)
        dist.barrier()

    def _run_test_mixed_precision_e2e(
        self,
        mp_config: MixedPrecision,
        cpu_offload: CPUOffload,
        backward_prefetch: BackwardPrefetch | None,
        forward_prefetch: bool,
        full_precision_param_dtype: torch.dtype,
        sharding_strategy: ShardingStrategy,
        enable_sharded_grad_scaler: str | bool | None,
    ) -> None:
        if _uses_bf16(mp_config) and not _rank_supports_bf16():
            pytest.skip("gloo before torch 2.13 cannot reduce bfloat16")
        fsdp_kwargs = {
            "sharding_strategy": sharding_strategy,
            "cpu_offload": cpu_offload,
            "mixed_precision": mp_config,
            "backward_prefetch": backward_prefetch,
            "forward_prefetch": forward_prefetch,
        }
        fsdp_models = [
            self._get_simple_model(param_dtype=full_precision_param_dtype, **fsdp_kwargs),
            self._get_simple_nested_model(
                param_dtype=full_precision_param_dtype, run_checks=True, **fsdp_kwargs
            ),
        ]
        for model in fsdp_models:
            if not cpu_offload.offload_params:
                model.to(self.device)
            # Every reduce-scatter of the backward validates its dtype.
            orig_reduce_scatter = current(Collective.REDUCE_SCATTER)
            test_reduce_scatter = partial(
                self._reduce_scatter_validate_mp, orig_reduce_scatter, mp_config, True
            )
            with patch_reduce_scatter(test_reduce_scatter, full_precision_param_dtype):
                scaler = ShardedGradScaler(
                    device=self.device.type, enabled=bool(enable_sharded_grad_scaler)
                )
                optim = torch.optim.Adam(model.parameters())
                for _ in range(3):
                    self._run_e2e_step(model, scaler, optim, mp_config, full_precision_param_dtype)

    def _run_e2e_step(
        self,
        model: nn.Module,
        scaler: ShardedGradScaler,
        optim: torch.optim.Optimizer,
        mp_config: MixedPrecision,
        full_precision_param_dtype: torch.dtype,
    ) -> None:
        """One forward/backward/step, checking dtypes after each, then under
        ``summon_full_params`` and in the state dict."""
        inp = torch.randn(3, 10, device=self.device, dtype=full_precision_param_dtype)
        # LinearMixedPrecision's forward checks the casting of inputs, params, buffers.
        act, *_ = model((inp, self, model, mp_config, full_precision_param_dtype))
        self._assert_buffers_in_mixed_precision(model.buffers(), mp_config)
        self._validate_mp_shard(model, mp_config)
        loss = scaler.scale(act.sum())
        self.assertEqual(loss.dtype, mp_config.param_dtype or full_precision_param_dtype)
        loss.backward()  # runs the validating reduce-scatter
        # Buffers stay cast after backward.
        self._assert_buffers_in_mixed_precision(model.buffers(), mp_config)
        self._validate_mp_shard(model, mp_config)
        # FSDP keeps full-precision shards: parameters and gradients are in full
        # precision after backward.
        for param in model.parameters():
            self.assertEqual(param.dtype, full_precision_param_dtype)
            if param.grad is not None:
                self.assertEqual(param.grad.dtype, full_precision_param_dtype)
        scaler.step(optim)
        scaler.update()
        self._check_summoned_and_state_dict(model, mp_config, full_precision_param_dtype)

    def _check_summoned_and_state_dict(
        self, model: nn.Module, mp_config: MixedPrecision, full_precision_param_dtype: torch.dtype
    ) -> None:
        with FSDP.summon_full_params(model):
            # Summoning does not allocate a low-precision shard.
            self._validate_mp_shard(model, mp_config)
            for p in model.parameters():
                self.assertEqual(p.dtype, full_precision_param_dtype)
            # Buffers are cast once and restored to their original dtype only in
            # the state dict, so summoning leaves them cast.
            named_buffers = dict(model.named_buffers())
            self._assert_buffers_in_mixed_precision(named_buffers.values(), mp_config)
        # The state dict holds parameters and buffers in their original dtypes.
        state_dict = {k: v.clone() for k, v in model.state_dict().items()}
        for name, tensor in state_dict.items():
            if name in named_buffers:
                self.assertEqual(tensor.dtype, _BUFFER_ORIG_DTYPE)
            else:
                self.assertEqual(
                    tensor.dtype,
                    full_precision_param_dtype,
                    f"{name}: {tensor.dtype} vs {full_precision_param_dtype}",
                )
        # After the state dict, buffers are back in the mixed precision dtype.
        self._assert_buffers_in_mixed_precision(model.buffers(), mp_config)


# The subtests of the three FSDP_USE_FULL_PREC_IN_EVAL tests.
_FULL_PREC_IN_EVAL_SUBTESTS: dict[str, list[Any]] = {
    "use_composable": [True, False],
    "cast_forward_inputs": [True, False],
    "use_full_prec_in_eval": [True, False],
}


class TestFSDPMixedPrecisionSharded(TestFSDPMixedPrecision):
    @property
    def world_size(self) -> int:
        return 2

    def _get_subtest_config(self) -> dict[str, list[Any]]:
        """Returns a subtest configuration that subtests prefetching settings
        together."""
        return {
            "forward_prefetch": [False, True],
            "backward_prefetch": [
                None,
                BackwardPrefetch.BACKWARD_PRE,
                BackwardPrefetch.BACKWARD_POST,
            ],
        }

    def test_mixed_precision_no_reshard_after_forward(self) -> None:
        """SHARD_GRAD_OP with offloading and fp64 parameters keeps every dtype right."""
        # Not every configuration, to keep the test time down.
        mp = mp_diff_buffer_and_reduce if _rank_supports_bf16() else default_mp
        self._run_test_mixed_precision_e2e(
            mp_config=mp,
            cpu_offload=CPUOffload(offload_params=True),
            backward_prefetch=None,
            forward_prefetch=False,
            full_precision_param_dtype=torch.float64,
            sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
            enable_sharded_grad_scaler=False,
        )

    @parametrize(params, configs, e2e_subtest_name)
    def test_mixed_precision_e2e_full_shard(
        self,
        mp_config: MixedPrecision,
        cpu_offload: CPUOffload,
        full_precision_param_dtype: torch.dtype,
        enable_sharded_grad_scaler: str | None,
    ) -> None:
        """FULL_SHARD casts inputs, parameters, buffers and reductions as configured,
        under every prefetch setting."""
        self.run_subtests(
            self._get_subtest_config(),
            self._run_test_mixed_precision_e2e,
            mp_config=mp_config,
            cpu_offload=cpu_offload,
            full_precision_param_dtype=full_precision_param_dtype,
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            enable_sharded_grad_scaler=enable_sharded_grad_scaler,
        )

    def _test_mixed_precision_embedding_table(self, mp_config: MixedPrecision) -> None:
        # Integer inputs must not be cast, which would break embedding tables.
        param_dtype = mp_config.param_dtype or torch.float32
        orig_reduce_scatter = current(Collective.REDUCE_SCATTER)
        test_reduce_scatter = partial(
            self._reduce_scatter_validate_mp, orig_reduce_scatter, mp_config, True
        )
        with patch_reduce_scatter(test_reduce_scatter, param_dtype):
            # TODO (upstream): `test_mp_embedding_reduce()` fails if the whole
            # `TransformerWithSharedParams` is not under one top-level FSDP.
            model = TransformerWithSharedParams.init(
                self.process_group,
                FSDPInitMode.NO_FSDP,
                DeviceInitMode.BEFORE,
                {"mixed_precision": mp_config},
            )
            fsdp_model = FSDP(model, mixed_precision=mp_config)
            optim = torch.optim.SGD(fsdp_model.parameters(), lr=0.1)
            for _ in range(6):
                inp = fsdp_model.module.get_input(self.device)
                # This would fail if integer module inputs were cast.
                output = fsdp_model(*inp)
                loss = fsdp_model.module.get_loss(inp, output).to(self.device)
                self.assertEqual(loss.dtype, param_dtype)
                fsdp_model.module.run_backward(loss)
                optim.step()

    def test_mp_embedding_reduce(self) -> None:
        """Token ids stay integers; gradients are reduced in fp16."""
        self._test_mixed_precision_embedding_table(
            mp_config=MixedPrecision(reduce_dtype=torch.float16)
        )

    def test_mp_embedding_only_params_and_bufs(self) -> None:
        """Token ids stay integers with fp16 parameters and buffers."""
        self._test_mixed_precision_embedding_table(
            mp_config=MixedPrecision(
                param_dtype=torch.float16,
                buffer_dtype=torch.float16,
            )
        )

    def test_mp_embedding_default(self) -> None:
        """Token ids stay integers with everything in fp16."""
        default_mp_config = MixedPrecision(
            param_dtype=torch.float16,
            buffer_dtype=torch.float16,
            reduce_dtype=torch.float16,
        )
        self._test_mixed_precision_embedding_table(mp_config=default_mp_config)

    def test_mp_embedding_params_and_reduce_diff(self) -> None:
        """Token ids stay integers with fp16 parameters and fp32 reductions."""
        params_and_reduce_different = MixedPrecision(
            param_dtype=torch.float16,
            reduce_dtype=torch.float32,
            buffer_dtype=torch.float16,
        )
        self._test_mixed_precision_embedding_table(mp_config=params_and_reduce_different)

    @pytest.mark.requires_gpu("SyncBatchNorm forward needs CUDA")
    @pytest.mark.requires_module("torchvision")
    def test_mixed_precision_resnet(self) -> None:
        """Mixed precision with size-based auto wrap trains a ResNet-50 with SyncBatchNorm,
        each batch norm in a unit of its own."""
        resnet_model = resnet50().to(self.device)
        resnet_model = nn.SyncBatchNorm.convert_sync_batchnorm(
            resnet_model, process_group=dist.distributed_c10d._get_default_group()
        )
        n_bn = sum(1 if isinstance(x, _BatchNorm) else 0 for x in resnet_model.modules())
        inp = torch.ones(1, 3, 1000, 1000, device=self.device)
        mp_config = MixedPrecision(
            param_dtype=torch.float16,
            reduce_dtype=torch.float16,
            buffer_dtype=torch.float16,
        )
        fsdp = FSDP(
            resnet_model,
            auto_wrap_policy=size_based_auto_wrap_policy,
            mixed_precision=mp_config,
        )
        # Batch norms are wrapped individually: as many FSDP units wrap a batch
        # norm as the model has batch norms.
        fsdp_bn = 0
        for module in fsdp.fsdp_modules(fsdp):
            wrapped_module = module.module
            if isinstance(wrapped_module, _BatchNorm):
                fsdp_bn += 1
        self.assertEqual(fsdp_bn, n_bn)
        # Would fail with a dtype mismatch without the mixed precision auto wrapping.
        loss = fsdp(inp).sum()
        loss.backward()

    def test_grads_reduced_precision(self) -> None:
        """keep_low_precision_grads leaves the gradients in fp16."""
        self.run_subtests(
            {
                "offload_params": [False, True],
                "use_orig_params": [False, True],
            },
            self._test_grads_reduced_precision,
        )

    @pytest.mark.parametrize(
        "convert_sync_bn",
        [
            pytest.param(
                True,
                marks=pytest.mark.requires_gpu("SyncBatchNorm forward needs CUDA"),
                id="True",
            ),
            pytest.param(False, id="False"),
        ],
    )
    def test_mp_batchnorm(self, convert_sync_bn: bool) -> None:
        """Batch and layer norms ignored by mixed precision become separate full-precision
        units (with a warning), and the model trains."""

        class BatchNormNet(nn.Module):
            def __init__(self, affine: bool = True) -> None:
                super().__init__()
                self.fc1 = nn.Linear(2, 40, bias=False)
                self.bn = nn.BatchNorm1d(4, affine=affine)
                self.fc2 = nn.Linear(40, 4, bias=False)
                self.ln = nn.LayerNorm(4)
                self.fc3 = nn.Linear(4, 4, bias=False)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                x = torch.reshape(self.fc1(x), (-1, 4, 10))
                x = self.bn(x)
                x = torch.reshape(x, (-1, 40))
                x = self.fc2(x)
                x = self.ln(x)
                x = self.fc3(x)
                return F.softmax(x, dim=1)

        def never_wrap_policy(*args: Any, **kwargs: Any) -> bool:
            return False

        net: nn.Module = BatchNormNet().to(self.device)
        if convert_sync_bn:
            net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
        # FSDP detects that mixed precision would break the norms and wraps them
        # in distinct units without mixed precision.
        mp_config = MixedPrecision(
            param_dtype=torch.float16,
            reduce_dtype=torch.float16,
            buffer_dtype=torch.float16,
            _module_classes_to_ignore=[_BatchNorm, nn.LayerNorm],
        )
        with self.assertWarnsRegex(
            expected_warning=UserWarning,
            expected_regex="These modules will be wrapped as separate FSDP",
        ):
            model = FSDP(net, mixed_precision=mp_config, auto_wrap_policy=never_wrap_policy)

        no_mp = MixedPrecision()
        for mod in [model.ln, model.bn]:
            self.assertTrue(isinstance(mod, FSDP))
            self.assertEqual(no_mp, mod.mixed_precision)
        # The policy wrapped no other submodule.
        for mod in [model.fc1, model.fc2, model.fc3]:
            self.assertFalse(isinstance(mod, FSDP))
        # Mixed precision is still enabled overall.
        self.assertEqual(mp_config, model.mixed_precision)

        inp = torch.randn((1, 2), device=self.device)
        # Without the batch norm fix this fails for SyncBatchNorm with
        # "Expected counts to have type Half but got Float".
        model(inp).sum().backward()

    def test_eval_root_cast_inputs(self) -> None:
        """In eval, the forward inputs of a root that manages no parameters are in full
        precision exactly when FSDP_USE_FULL_PREC_IN_EVAL is set."""
        low_prec_dtype = torch.float16

        class MyModel(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = nn.Linear(5, 5)

            def forward(self, x: torch.Tensor, expect_use_full_prec_in_eval: bool) -> torch.Tensor:
                if expect_use_full_prec_in_eval:
                    assert x.dtype == torch.float32, f"Expected fp32, got {x.dtype}"
                else:
                    assert x.dtype == low_prec_dtype, f"Expected {low_prec_dtype}, got {x.dtype}"
                return self.a(x)

        mp_config = MixedPrecision(
            param_dtype=low_prec_dtype,
            reduce_dtype=low_prec_dtype,
            buffer_dtype=low_prec_dtype,
        )
        for use_full_prec_in_eval in [True, False]:
            os.environ[_FSDP_USE_FULL_PREC_IN_EVAL] = "1" if use_full_prec_in_eval else "0"
            m = MyModel().to(self.device)
            m.a = FSDP(m.a, mixed_precision=mp_config)
            model = FSDP(m, mixed_precision=mp_config)
            model.eval()
            inp = torch.randn(5, 5)
            model(inp, use_full_prec_in_eval).sum().backward()

    def test_full_precision_in_eval(self) -> None:
        """Eval runs in full precision if FSDP_USE_FULL_PREC_IN_EVAL is set, else in fp16;
        training always in fp16 with fp32 gradients."""
        self.run_subtests(
            _FULL_PREC_IN_EVAL_SUBTESTS,
            self._test_full_precision_in_eval,
        )

    def _test_full_precision_in_eval(
        self, use_composable: bool, cast_forward_inputs: bool, use_full_prec_in_eval: bool
    ) -> None:
        self._skip_if_composable_missing(use_composable)
        mp_config = MixedPrecision(
            param_dtype=torch.float16,
            reduce_dtype=torch.float16,
            buffer_dtype=torch.float16,
            cast_forward_inputs=cast_forward_inputs,
        )
        os.environ[_FSDP_USE_FULL_PREC_IN_EVAL] = "1" if use_full_prec_in_eval else "0"
        model = self._transformer(use_composable, mp_config)
        inp = model.get_input(self.device)
        output = model(*inp)
        loss = model.get_loss(inp, output).to(self.device)
        self.assertEqual(torch.float16, loss.dtype)
        model.run_backward(loss)
        # Gradients are upcast to fp32.
        for p in model.parameters():
            if p.grad is not None:
                self.assertEqual(torch.float32, p.grad.dtype)
        # In eval the loss is fp32 if use_full_prec_in_eval is set.
        model.eval()
        inp = model.get_input(self.device)
        output = model(*inp)
        loss = model.get_loss(inp, output).to(self.device)
        expected_dtype = torch.float32 if use_full_prec_in_eval else torch.float16
        self.assertEqual(expected_dtype, loss.dtype)

    def _transformer(self, use_composable: bool, mp_config: MixedPrecision) -> nn.Module:
        """The transformer under the wrapper (RECURSIVE) or under composable
        ``fully_shard`` with the same encoder/decoder layer policy."""
        model = TransformerWithSharedParams.init(
            self.process_group,
            FSDPInitMode.NO_FSDP if use_composable else FSDPInitMode.RECURSIVE,
            DeviceInitMode.BEFORE,
            {"mixed_precision": mp_config},
        )
        if use_composable:
            auto_wrap_policy = ModuleWrapPolicy({TransformerEncoderLayer, TransformerDecoderLayer})
            composable_fully_shard(model, policy=auto_wrap_policy, mixed_precision=mp_config)
        return model

    def test_full_precision_in_eval_buffers(self) -> None:
        """With FSDP_USE_FULL_PREC_IN_EVAL set, eval keeps buffers in their original
        precision, and training casts them back."""
        self.run_subtests(
            _FULL_PREC_IN_EVAL_SUBTESTS,
            self._test_full_precision_in_eval_buffers,
        )

    def _test_full_precision_in_eval_buffers(
        self, use_composable: bool, cast_forward_inputs: bool, use_full_prec_in_eval: bool
    ) -> None:
        self._skip_if_composable_missing(use_composable)
        os.environ[_FSDP_USE_FULL_PREC_IN_EVAL] = "1" if use_full_prec_in_eval else "0"
        mp_config = MixedPrecision(
            param_dtype=torch.float16,
            reduce_dtype=torch.float16,
            buffer_dtype=torch.float16,
            cast_forward_inputs=cast_forward_inputs,
        )
        model_getter = (
            self._get_simple_nested_model_composable
            if use_composable
            else self._get_simple_nested_model
        )
        fsdp_model = model_getter(
            param_dtype=torch.float32, run_checks=False, mixed_precision=mp_config
        )
        inp = torch.randn(3, 10, device=self.device)
        fsdp_model((inp, self, fsdp_model, mp_config, torch.float32))
        for buf in fsdp_model.buffers():
            self.assertEqual(torch.float16, buf.dtype)

        # eval() and a forward bring the buffers back to full precision (if set),
        # already when each submodule's forward starts.
        eval_buffer_dtype = _BUFFER_ORIG_DTYPE if use_full_prec_in_eval else torch.float16

        def verify_eval_buffer_dtype(module: nn.Module, input: Any) -> None:
            for buf in module.buffers():
                self.assertEqual(eval_buffer_dtype, buf.dtype)

        def _get_underlying_module(m: nn.Module) -> nn.Module:
            return m.module if isinstance(m, FSDP) else m

        hook_handles = [
            _get_underlying_module(fsdp_model[i]).register_forward_pre_hook(
                verify_eval_buffer_dtype
            )
            for i in (0, 1)
        ]
        fsdp_model.eval()
        fsdp_model((inp, self, fsdp_model, mp_config, torch.float32))
        for hook_handle in hook_handles:
            hook_handle.remove()
        for buf in fsdp_model.buffers():
            self.assertEqual(eval_buffer_dtype, buf.dtype)

        # train() and a forward cast the buffers to fp16 again.
        fsdp_model.train()
        fsdp_model((inp, self, fsdp_model, mp_config, torch.float32))
        for buf in fsdp_model.buffers():
            self.assertEqual(torch.float16, buf.dtype)

    def test_full_precision_in_eval_comm(self) -> None:
        """A backward in eval reduces gradients in full precision exactly when
        FSDP_USE_FULL_PREC_IN_EVAL is set."""
        self.run_subtests(
            _FULL_PREC_IN_EVAL_SUBTESTS,
            self._test_full_precision_in_eval_comm,
        )

    def _test_full_precision_in_eval_comm(
        self, use_composable: bool, cast_forward_inputs: bool, use_full_prec_in_eval: bool
    ) -> None:
        self._skip_if_composable_missing(use_composable)
        os.environ[_FSDP_USE_FULL_PREC_IN_EVAL] = "1" if use_full_prec_in_eval else "0"
        mp_config = MixedPrecision(
            param_dtype=torch.float32,
            reduce_dtype=torch.float16,
            buffer_dtype=torch.float32,
            cast_forward_inputs=cast_forward_inputs,
            # Cast batch norms too, to keep the validation simple.
            _module_classes_to_ignore=[],
        )
        model = self._transformer(use_composable, mp_config)
        model_accessor = model if use_composable else model.module
        # The reduce-scatter validates the mixed precision dtype.
        orig_reduce_scatter = current(Collective.REDUCE_SCATTER)
        test_reduce_scatter = partial(
            self._reduce_scatter_validate_mp,
            orig_reduce_scatter,
            mp_config,
            not use_full_prec_in_eval,
        )
        model.eval()
        with patch_reduce_scatter(test_reduce_scatter, torch.float32):
            inp = model_accessor.get_input(self.device)
            output = model(*inp)
            loss = model_accessor.get_loss(inp, output).to(self.device)
            model_accessor.run_backward(loss)

    def test_input_grads_with_param_mixed_precision(self) -> None:
        """An fp32 input that requires grad gets an fp32 gradient through the cast to
        the fp16 parameter dtype."""
        self.run_subtests(
            {
                "sharding_strategy": [
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.SHARD_GRAD_OP,
                    ShardingStrategy.NO_SHARD,
                ],
                "use_orig_params": [False, True],
            },
            self._test_input_grads_with_param_mixed_precision,
        )

    def _test_input_grads_with_param_mixed_precision(
        self, sharding_strategy: ShardingStrategy, use_orig_params: bool
    ) -> None:
        model = nn.Linear(1024, 1024, bias=False)
        mixed_precision = MixedPrecision(
            param_dtype=torch.float16,
            reduce_dtype=torch.float32,
            buffer_dtype=torch.float32,
        )
        fsdp_model = FSDP(
            model,
            sharding_strategy=sharding_strategy,
            mixed_precision=mixed_precision,
            device_id=self.device,
            use_orig_params=use_orig_params,
        )
        # fp32 input to an fp16 model: FSDP casts it.
        x_float = torch.randn(
            (32, 1024), device=self.device, dtype=torch.float32, requires_grad=True
        )
        fsdp_model(x_float).sum().backward()
        self.assertTrue(x_float.grad is not None)
        # The gradient flows back through the cast (ToCopyBackward0) in fp32.
        self.assertEqual(x_float.grad.dtype, torch.float32)


class TestFSDPMixedPrecisionUnsharded(TestFSDPMixedPrecision):
    """Smaller test suite for the unsharded (world_size == 1) case."""

    @property
    def world_size(self) -> int:
        return 1

    def test_grads_reduced_precision(self) -> None:
        """keep_low_precision_grads leaves the gradients in fp16 on one rank."""
        self.run_subtests(
            {"offload_params": [False, True], "use_orig_params": [False, True]},
            self._test_grads_reduced_precision,
        )

    def test_mixed_precision_no_reshard_after_forward(self) -> None:
        """SHARD_GRAD_OP on one rank keeps every dtype right."""
        # Not every configuration, to keep the test time down.
        mp = mp_diff_buffer_and_reduce if _rank_supports_bf16() else default_mp
        self._run_test_mixed_precision_e2e(
            mp_config=mp,
            cpu_offload=CPUOffload(offload_params=True),
            backward_prefetch=None,
            forward_prefetch=False,
            full_precision_param_dtype=torch.float64,
            sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
            enable_sharded_grad_scaler=False,
        )

    def test_mixed_precision_e2e_full_shard(self) -> None:
        """FULL_SHARD on one rank keeps every dtype right."""
        mp = mp_diff_buffer_and_reduce if _rank_supports_bf16() else default_mp
        self._run_test_mixed_precision_e2e(
            mp_config=mp,
            cpu_offload=CPUOffload(offload_params=True),
            backward_prefetch=None,
            forward_prefetch=False,
            full_precision_param_dtype=torch.float64,
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            enable_sharded_grad_scaler=False,
        )


class IgnoredModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(100, 100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x)


class ModelWithIgnoredModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(100, 100)
        self.ignored = IgnoredModule()
        self.l2 = nn.Linear(100, 100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.ignored(self.l1(x)))


class TestFSDPMixedPrecisionIgnoredModules(FSDPTest):
    @property
    def world_size(self) -> int:
        return 1

    def test_mixed_precision_with_ignored_module(self) -> None:
        """An ignored module keeps its fp32 parameters, so fp16 activations reaching it
        fail with a dtype mismatch."""
        model = ModelWithIgnoredModule().to(self.device)
        float16 = MixedPrecision(param_dtype=torch.float16)
        model = FSDP(model, ignored_modules=[model.ignored], mixed_precision=float16)
        x = torch.ones(2, 100, device=self.device)
        with self.assertRaisesRegex(RuntimeError, "must have the same dtype"):
            model(x).sum().backward()


class TestFSDPDifferentSubmodulePrecision(FSDPTest):
    @property
    def world_size(self) -> int:
        return 2

    def test_float16_on_one_submodule(self) -> None:
        """cast_forward_inputs casts the input of the one fp16 unit; the rest stays fp32."""
        forward_inputs: dict[nn.Module, torch.Tensor] = {}
        float16 = MixedPrecision(param_dtype=torch.float16, cast_forward_inputs=True)
        model = SaveForwardInputsModel(forward_inputs, cast_forward_inputs=False).to(self.device)
        c1, c2 = model.c1, model.c2
        x = torch.zeros(2, 100, device=self.device)
        # float16 on one submodule, float32 on the rest.
        model.c2 = FSDP(model.c2, mixed_precision=float16)
        fsdp = FSDP(model)
        fsdp(x).sum().backward()
        self.assertEqual(forward_inputs[model].dtype, torch.float32)
        self.assertEqual(forward_inputs[c1].dtype, torch.float32)
        self.assertEqual(forward_inputs[c2].dtype, torch.float16)

    def test_float16_on_one_submodule_skip_inputs(self) -> None:
        """Without cast_forward_inputs the fp16 unit receives fp32 inputs (the module
        casts them itself)."""
        forward_inputs: dict[nn.Module, torch.Tensor] = {}
        float16 = MixedPrecision(param_dtype=torch.float16, cast_forward_inputs=False)
        model = SaveForwardInputsModel(forward_inputs=forward_inputs, cast_forward_inputs=True).to(
            self.device
        )
        c1, c2 = model.c1, model.c2
        x = torch.zeros(2, 100, device=self.device)
        # float16 on one submodule, float32 on the rest.
        model.c2 = FSDP(model.c2, mixed_precision=float16)
        fsdp = FSDP(model)
        fsdp(x).sum().backward()
        self.assertEqual(forward_inputs[model].dtype, torch.float32)
        self.assertEqual(forward_inputs[c1].dtype, torch.float32)
        self.assertEqual(forward_inputs[c2].dtype, torch.float32)

    def test_float16_on_one_submodule_skip_inputs_error(self) -> None:
        """Without any input cast, the fp16 unit fails on its fp32 input."""
        forward_inputs: dict[nn.Module, torch.Tensor] = {}
        float16 = MixedPrecision(param_dtype=torch.float16, cast_forward_inputs=False)
        model = SaveForwardInputsModel(forward_inputs=forward_inputs, cast_forward_inputs=False).to(
            self.device
        )
        x = torch.zeros(2, 100, device=self.device)
        # float16 on one submodule, float32 on the rest.
        model.c2 = FSDP(model.c2, mixed_precision=float16)
        fsdp = FSDP(model)
        with self.assertRaisesRegex(RuntimeError, "mat1 and mat2 must have the same dtype"):
            fsdp(x).sum().backward()

    def test_submodules_with_different_precisions_error(self) -> None:
        """An fp16 unit that runs first under an fp32 root fails: the next module's
        input (its output) is not cast back."""
        forward_inputs: dict[nn.Module, torch.Tensor] = {}
        float16 = MixedPrecision(param_dtype=torch.float16, cast_forward_inputs=True)
        float32 = MixedPrecision(param_dtype=torch.float32, cast_forward_inputs=True)
        model = SaveForwardInputsModel(forward_inputs=forward_inputs, cast_forward_inputs=False).to(
            self.device
        )
        x = torch.zeros(2, 100, device=self.device)
        # The design does not support a root whose wrapped submodule of another
        # precision is not the first to run: the output of that submodule (the
        # next one's input) is not cast; the root casts only its own inputs,
        # before its forward.
        model.c1 = FSDP(model.c1, mixed_precision=float16)
        fsdp = FSDP(model, mixed_precision=float32)
        with self.assertRaisesRegex(RuntimeError, "mat1 and mat2 must have the same dtype"):
            fsdp(x).sum().backward()

    def test_submodules_with_different_precisions(self) -> None:
        """An fp16 unit that runs last under an fp32 root gets fp16 inputs; the rest fp32."""
        forward_inputs: dict[nn.Module, torch.Tensor] = {}
        float16 = MixedPrecision(param_dtype=torch.float16, cast_forward_inputs=True)
        float32 = MixedPrecision(param_dtype=torch.float32, cast_forward_inputs=True)
        model = SaveForwardInputsModel(forward_inputs=forward_inputs, cast_forward_inputs=False).to(
            self.device
        )
        c1, c2 = model.c1, model.c2
        x = torch.zeros(2, 100, device=self.device)
        model.c2 = FSDP(model.c2, mixed_precision=float16)
        fsdp = FSDP(model, mixed_precision=float32)
        fsdp(x).sum().backward()
        self.assertEqual(forward_inputs[model].dtype, torch.float32)
        self.assertEqual(forward_inputs[c1].dtype, torch.float32)
        self.assertEqual(forward_inputs[c2].dtype, torch.float16)

    def test_submodules_with_external_inputs(self) -> None:
        """Inputs a submodule gets from outside the root's inputs are not cast by default."""

        class ToyModule(nn.Module):
            def __init__(self, forward_inputs: dict[str, torch.Tensor]) -> None:
                super().__init__()
                self.l = nn.Linear(100, 100)
                self.forward_inputs = forward_inputs

            def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                self.forward_inputs["l2_input_x"] = x
                self.forward_inputs["l2_input_y"] = y
                return self.l(x)

        class ToyModel(nn.Module):
            def __init__(self, forward_inputs: dict[str, torch.Tensor]) -> None:
                super().__init__()
                self.l1 = nn.Linear(100, 100)
                self.l2 = ToyModule(forward_inputs)
                self.forward_inputs = forward_inputs

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                self.forward_inputs["model_input_x"] = x
                y = torch.ones(2, 100, device=x.device, dtype=torch.float32)
                return self.l2(self.l1(x), y)

        forward_inputs: dict[str, torch.Tensor] = {}
        float16 = MixedPrecision(param_dtype=torch.float16)
        model = ToyModel(forward_inputs).to(self.device)
        x = torch.zeros(2, 100, device=self.device, dtype=torch.float32)
        model.l2 = FSDP(model.l2, mixed_precision=float16)
        fsdp = FSDP(model, mixed_precision=float16)
        fsdp(x).sum().backward()
        # The root's input is cast to fp16 by default; the external input y of the
        # submodule is not.
        self.assertEqual(forward_inputs["model_input_x"].dtype, torch.float16)
        self.assertEqual(forward_inputs["l2_input_x"].dtype, torch.float16)
        self.assertEqual(forward_inputs["l2_input_y"].dtype, torch.float32)


class TestFSDPTrainEval(FSDPTest):
    @property
    def world_size(self) -> int:
        return 2

    def test_train_ema_eval_flow(self) -> None:
        """Train -> EMA update -> eval with mixed precision evaluates with the updated EMA
        parameters (eval outputs change every iteration)."""
        self.run_subtests(
            {
                "sharding_strategy": [
                    # SHARD_GRAD_OP mainly: it exposed the original bug (eval did
                    # not use the right EMA parameters); the others for completeness.
                    ShardingStrategy.SHARD_GRAD_OP,
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.NO_SHARD,
                ]
            },
            self._test_train_ema_eval_flow,
        )

    def _test_train_ema_eval_flow(self, sharding_strategy: ShardingStrategy) -> None:
        # Upstream's nn.Transformer() (d_model 512, 6 + 6 layers) on accelerator
        # ranks; on CPU ranks, where its float16 matmuls took 158 s for the three
        # subtests, one of d_model 64 and 2 + 2 layers: the flow under test (an
        # EMA updated inside a summon, then evaluated) is the same.
        sizes: dict[str, int] = {}
        if self.device.type == "cpu":
            sizes = {
                "d_model": 64,
                "nhead": 4,
                "num_encoder_layers": 2,
                "num_decoder_layers": 2,
                "dim_feedforward": 128,
            }
        d_model = sizes.get("d_model", 512)

        class TransformerWithEMA(nn.Module):
            def __init__(self, device: torch.device) -> None:
                super().__init__()
                self.module = nn.Transformer(device=device, **sizes)
                self.ema_module = AveragedModel(
                    nn.Transformer(device=device, **sizes),
                    multi_avg_fn=get_ema_multi_avg_fn(),
                    use_buffers=True,
                )

            def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
                # Train with the module, evaluate with its EMA.
                if self.training:
                    return self.module(*args, **kwargs)
                return self.ema_module(*args, **kwargs)

        device = self.device
        model = TransformerWithEMA(device=device)
        policy = ModuleWrapPolicy(
            {nn.Transformer, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}
        )
        mixed_precision = MixedPrecision(param_dtype=torch.float16)
        fsdp_model = FSDP(
            model,
            auto_wrap_policy=policy,
            mixed_precision=mixed_precision,
            sharding_strategy=sharding_strategy,
        )
        optim = torch.optim.Adam(fsdp_model.module.parameters(), lr=1e-2)
        if self.rank == 0:
            print(fsdp_model)
        torch.manual_seed(1 + self.rank)
        eval_src = torch.randn((8, 1, d_model), device=device)
        eval_tgt = torch.randn((16, 1, d_model), device=device)
        eval_out_sums: list[torch.Tensor] = []
        # Each iteration: train, update the EMA, evaluate.
        for _ in range(3):
            fsdp_model.train()
            train_src = torch.randn((8, 4, d_model), device=device)
            train_tgt = torch.randn((16, 4, d_model), device=device)
            train_out = fsdp_model(train_src, train_tgt)
            train_out.sum().backward()
            optim.step()
            optim.zero_grad()
            with FSDP.summon_full_params(fsdp_model):
                fsdp_model.ema_module.update_parameters(fsdp_model.module)
            fsdp_model.eval()
            with torch.no_grad():
                eval_out = fsdp_model(eval_src, eval_tgt)
            eval_out_sums.append(eval_out.sum())
        # Evaluation used the updated EMA parameters: the outputs differ.
        for i in range(len(eval_out_sums) - 1):
            self.assertNotEqual(eval_out_sums[i], eval_out_sums[i + 1])
        self.assertNotEqual(eval_out_sums[0], eval_out_sums[-1])

    def test_eval_after_a_step_sees_the_step(self) -> None:
        """With ``FSDP_USE_FULL_PREC_IN_EVAL`` and a ``param_dtype``, eval forwards run
        in full precision. Eval, a training step, eval again: the second eval must
        compute with the stepped parameters, like an unwrapped model stepped alike
        (fp16 gradients: 1e-2). Torch's FSDP keeps the first eval's full-precision
        copy of a unit not resharded after forward (the root; every unit under
        ``SHARD_GRAD_OP``) and computes with it again (a known defect, asserted)."""
        self.run_subtests(
            {
                "sharding_strategy": [
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.SHARD_GRAD_OP,
                    ShardingStrategy.NO_SHARD,
                ],
                "use_orig_params": [False, True],
                "nested": [False, True],
            },
            self._test_eval_after_a_step_sees_the_step,
        )

    def _test_eval_after_a_step_sees_the_step(
        self, sharding_strategy: ShardingStrategy, use_orig_params: bool, nested: bool
    ) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).to(self.device)
        reference = copy.deepcopy(model)
        previous = os.environ.get(_FSDP_USE_FULL_PREC_IN_EVAL)
        os.environ[_FSDP_USE_FULL_PREC_IN_EVAL] = "1"
        try:
            if nested:
                model[2] = FSDP(
                    model[2],
                    sharding_strategy=sharding_strategy,
                    mixed_precision=MixedPrecision(param_dtype=torch.float16),
                    use_orig_params=use_orig_params,
                    device_id=self.device,
                )
            fsdp_model = FSDP(
                model,
                sharding_strategy=sharding_strategy,
                mixed_precision=MixedPrecision(param_dtype=torch.float16),
                use_orig_params=use_orig_params,
                device_id=self.device,
            )
        finally:
            if previous is None:
                os.environ.pop(_FSDP_USE_FULL_PREC_IN_EVAL)
            else:
                os.environ[_FSDP_USE_FULL_PREC_IN_EVAL] = previous
        optim = torch.optim.SGD(fsdp_model.parameters(), lr=0.5)
        ref_optim = torch.optim.SGD(reference.parameters(), lr=0.5)
        x = torch.arange(8.0, device=self.device).reshape(2, 4) / 8  # the same on every rank
        fsdp_model.eval()
        with torch.no_grad():
            first = fsdp_model(x)
        self.assertEqual(first.dtype, torch.float32)
        fsdp_model.train()
        fsdp_model(x).float().sum().backward()
        optim.step()
        reference(x).sum().backward()
        ref_optim.step()
        fsdp_model.eval()
        with torch.no_grad():
            second = fsdp_model(x)
            expected = reference(x)
        sees_step = torch.allclose(second, expected, atol=1e-2, rtol=1e-2)
        keeps = sharding_strategy is not ShardingStrategy.NO_SHARD
        if keeps and ADAPTER.known_defects.keeps_full_precision_eval_copy:
            self.assertFalse(sees_step, "torch's kept full-precision copy is gone: a fix")
            return
        self.assertTrue(sees_step, f"eval after a step: {second} != {expected}")
        self.assertFalse(torch.allclose(second, first))
