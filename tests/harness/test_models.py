"""The test models in every init mode, and the parity harness on each of them."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdptest import FSDPTest
from fsdptest.api import FSDP, BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from fsdptest.interface import DeviceInitMode, FSDPInitMode, ModelFactory, unwrap_test_model
from fsdptest.parity import (
    EXACT,
    REORDERED_FP32,
    ParityConfig,
    check_fsdp_parity,
    full_parameters,
    low_precision_tolerance,
    reference_parameters,
)
from harness import current_device
from models import (
    AlwaysWrapNestedWrappedModule,
    BatchNormNet,
    DummyDDP,
    DummyProcessGroup,
    LoraModel,
    MixtureOfExperts,
    NestedSequentialModel,
    NestedWrappedModule,
    NestedWrappedModuleWithDelay,
    NonUniformReqGradNWM,
    SaveForwardInputsModel,
    TransformerWithSharedParams,
    resnet50,
    sleep_ms,
)

# FSDP units each model's RECURSIVE init builds (the root counts when it is one).
# AlwaysWrapNestedWrappedModule: one unit per module of the bare model, computed.
RECURSIVE_UNITS: dict[ModelFactory, int] = {
    NestedWrappedModule: 3,
    NonUniformReqGradNWM: 3,
    NestedWrappedModuleWithDelay: 3,
    MixtureOfExperts: 2,
    TransformerWithSharedParams: 5,  # the root, 2 encoder and 2 decoder layers
}
ALL_MODELS: list[ModelFactory] = [*RECURSIVE_UNITS, AlwaysWrapNestedWrappedModule]
# NonUniformReqGradNWM freezes parameters by their original names, which FSDP
# keeps visible only with use_orig_params=True (else all would be frozen).
FSDP_KWARGS: dict[ModelFactory, dict[str, Any]] = {NonUniformReqGradNWM: {"use_orig_params": True}}

STRATEGIES = [
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.NO_SHARD,
]
PARITY_SUBTESTS: dict[str, list[Any]] = {
    "cuda_init_mode": [DeviceInitMode.BEFORE, DeviceInitMode.AFTER],
    "sharding_strategy": STRATEGIES,
    "use_orig_params": [False, True],
}
# Short delays: on the CPU they are real sleeps (see models.delays), and they
# only need to be on the path, not long.
DELAY_MS = 5


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, FSDP)]


class TestModelInit(FSDPTest):
    def test_every_model_builds_in_every_init_mode_and_trains(self) -> None:
        """Each model builds under both FSDP init modes and all device modes, with its
        FSDP units and parameter devices as documented, and runs a step."""
        self.run_subtests(
            {
                "model_class": ALL_MODELS,
                "fsdp_init_mode": list(FSDPInitMode),
                "device_init_mode": list(DeviceInitMode),
            },
            self._check_init,
        )

    def _check_init(
        self,
        model_class: ModelFactory,
        fsdp_init_mode: FSDPInitMode,
        device_init_mode: DeviceInitMode,
    ) -> None:
        wraps = fsdp_init_mode is FSDPInitMode.RECURSIVE
        if wraps and device_init_mode is DeviceInitMode.NEVER and self.device.type != "cpu":
            self.skipTest("FSDP keeps a CPU model's parameters on the CPU only when offloading")
        fsdp_kwargs = FSDP_KWARGS.get(model_class, {})
        model = model_class.init(self.process_group, fsdp_init_mode, device_init_mode, fsdp_kwargs)
        self.assertEqual(len(fsdp_units(model)), self._expected_units(model_class, wraps))
        moved = device_init_mode.is_before() or (wraps and device_init_mode.is_after())
        expected_device = self.device if moved else torch.device("cpu")
        for name, param in model.named_parameters():
            self.assertEqual(param.device, expected_device, f"{name} on the wrong device")
        if expected_device == self.device:  # inputs are always on the test's device
            trained = _data_parallel(model, self.process_group, fsdp_kwargs)
            self._train_for_several_steps(trained, num_steps=1, autocast=False)

    def _expected_units(self, model_class: ModelFactory, wraps: bool) -> int:
        if not wraps:
            return 0
        if model_class is AlwaysWrapNestedWrappedModule:
            bare = model_class.init(self.process_group, FSDPInitMode.NO_FSDP, DeviceInitMode.NEVER)
            return len(list(bare.modules()))
        return RECURSIVE_UNITS[model_class]

    def test_deterministic_models_are_equal_across_constructions_and_ranks(self) -> None:
        """``deterministic=True`` gives the same parameters on every construction, and
        the same on every rank except the experts of ``MixtureOfExperts``."""
        self.run_subtests({"model_class": ALL_MODELS}, self._check_deterministic)

    def _check_deterministic(self, model_class: ModelFactory) -> None:
        def build() -> dict[str, torch.Tensor]:
            model = model_class.init(
                self.process_group, FSDPInitMode.NO_FSDP, DeviceInitMode.BEFORE, deterministic=True
            )
            return reference_parameters(DummyDDP(model))

        first = build()
        self.assertEqual(build(), first, rtol=EXACT.rtol, atol=EXACT.atol)
        peer = 1 if self.rank == 0 else 0
        for name, param in first.items():
            # Tensor all-gather, not ``all_gather_object``: that one needs numpy.
            gathered = [torch.empty_like(param) for _ in range(self.world_size)]
            dist.all_gather(gathered, param.contiguous())
            rank_local = model_class is MixtureOfExperts and name.startswith("module.2.")
            same = torch.equal(param, gathered[peer])
            self.assertEqual(same, not rank_local, f"{name}: equal across ranks is {same}")

    def test_mixture_of_experts_expert_unit_is_rank_local(self) -> None:
        """The expert unit shards over a group of this rank alone, the shared unit over all."""
        model = MixtureOfExperts.init(
            self.process_group, FSDPInitMode.RECURSIVE, DeviceInitMode.BEFORE
        )
        shared, expert = unwrap_test_model(model).module[1], unwrap_test_model(model).module[2]
        self.assertEqual(dist.get_world_size(expert.process_group), 1)
        self.assertEqual(dist.get_world_size(shared.process_group), self.world_size)

    def test_non_uniform_req_grad_trains_only_the_last_linear(self) -> None:
        """Every parameter is frozen except those of ``module.2.1``."""
        model = NonUniformReqGradNWM.init(
            self.process_group, FSDPInitMode.NO_FSDP, DeviceInitMode.BEFORE
        )
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        self.assertEqual(trainable, {"module.2.1.weight", "module.2.1.bias"})

    def test_transformer_init_leaves_fsdp_kwargs_alone(self) -> None:
        """``init`` reads its default auto-wrap policy without adding it to the caller's kwargs."""
        fsdp_kwargs: dict[str, Any] = {"use_orig_params": True}
        TransformerWithSharedParams.init(
            self.process_group, FSDPInitMode.RECURSIVE, DeviceInitMode.BEFORE, fsdp_kwargs
        )
        self.assertEqual(fsdp_kwargs, {"use_orig_params": True})

    @pytest.mark.requires_module("torchvision")
    def test_resnet50_builds(self) -> None:
        """``resnet50()`` returns torchvision's model where torchvision imports."""
        self.assertGreater(sum(p.numel() for p in resnet50().parameters()), 25_000_000)


def _data_parallel(
    model: nn.Module, group: dist.ProcessGroup, fsdp_kwargs: dict[str, Any]
) -> nn.Module:
    """A wrapper to train ``model`` with: itself if FSDP is its root, else a top-level
    FSDP over its inner units, else (no FSDP at all) ``DummyDDP``."""
    if isinstance(model, FSDP):
        return model
    if fsdp_units(model):
        return FSDP(model, group, **fsdp_kwargs)
    return DummyDDP(model)


class TestParity(FSDPTest):
    """Each parity case of the core seed, on a small grid of configurations."""

    def test_nested_wrapped_model_matches_ddp(self) -> None:
        """NestedWrappedModule under FSDP trains exactly like under DDP."""
        self.run_subtests(
            {**PARITY_SUBTESTS, "backward_prefetch": [None, BackwardPrefetch.BACKWARD_PRE]},
            self._test_fsdp_parity,
            NestedWrappedModule,
            FSDPInitMode.RECURSIVE,
        )

    def test_always_wrap_model_matches_ddp(self) -> None:
        """AlwaysWrapNestedWrappedModule (every module a unit) trains exactly like DDP."""
        self.run_subtests(
            PARITY_SUBTESTS,
            self._test_fsdp_parity,
            AlwaysWrapNestedWrappedModule,
            FSDPInitMode.RECURSIVE,
        )

    def test_transformer_matches_ddp(self) -> None:
        """TransformerWithSharedParams (tied weights, int64 buffer) trains exactly like DDP."""
        self.run_subtests(
            {**PARITY_SUBTESTS, "forward_prefetch": [False, True]},
            self._test_fsdp_parity,
            TransformerWithSharedParams,
            FSDPInitMode.RECURSIVE,
        )

    def test_delays_keep_parity_with_ddp(self) -> None:
        """A delay after the loss or before each reduce-scatter changes no result."""
        self.run_subtests(
            {
                "init_kwargs": [
                    {"delay_after_loss_ms": DELAY_MS},
                    {"delay_before_reduction_ms": DELAY_MS},
                ],
                "sharding_strategy": STRATEGIES,
            },
            self._test_fsdp_parity,
            NestedWrappedModuleWithDelay,
            FSDPInitMode.RECURSIVE,
            cuda_init_mode=DeviceInitMode.AFTER,
        )

    def test_mixture_of_experts_matches_dummy_ddp(self) -> None:
        """MixtureOfExperts under FSDP matches the model reducing its shared gradients by hand."""
        self.run_subtests(
            PARITY_SUBTESTS,
            self._test_fsdp_parity,
            MixtureOfExperts,
            FSDPInitMode.RECURSIVE,
            ref_init_fn=DummyDDP,
        )

    def test_mixture_of_experts_with_delay_before_free_matches_dummy_ddp(self) -> None:
        """Delaying every reshard during forward changes no result."""
        self.run_subtests(
            {"sharding_strategy": STRATEGIES},
            self._test_fsdp_parity,
            MixtureOfExperts,
            FSDPInitMode.RECURSIVE,
            cuda_init_mode=DeviceInitMode.BEFORE,
            ref_init_fn=DummyDDP,
            init_kwargs={"delay_before_free_ms": DELAY_MS},
        )

    def test_nested_wrapped_model_single_iteration_mixed_precision(self) -> None:
        """One mixed-precision step of FSDP matches the reference (under fp16 autocast
        when parameters compute in fp16)."""
        fp16 = MixedPrecision(
            param_dtype=torch.float16, buffer_dtype=torch.float16, reduce_dtype=torch.float16
        )
        reduce_only = MixedPrecision(reduce_dtype=torch.float16)
        self.run_subtests(
            {
                "mixed_precision": [fp16, reduce_only],
                "sharding_strategy": STRATEGIES,
                "use_orig_params": [False, True],
            },
            self._test_fsdp_parity,
            NestedWrappedModule,
            FSDPInitMode.RECURSIVE,
            cuda_init_mode=DeviceInitMode.BEFORE,
            num_iters=1,
        )

    @pytest.mark.parametrize(
        "cpu_offload", [CPUOffload(offload_params=False), CPUOffload(offload_params=True)]
    )
    def test_nested_wrapped_model_with_offload_config_matches_ddp(
        self, cpu_offload: CPUOffload
    ) -> None:
        """Parity holds with and without parameter offloading; moving an offloading
        model to the GPU after wrapping fails as documented."""
        modes = [DeviceInitMode.BEFORE, DeviceInitMode.AFTER]
        if cpu_offload.offload_params or self.device.type == "cpu":
            modes.append(DeviceInitMode.NEVER)  # else FSDP finds CPU parameters on the GPU
        self.run_subtests(
            {"cuda_init_mode": modes},
            self._test_fsdp_parity,
            NestedWrappedModule,
            FSDPInitMode.RECURSIVE,
            cpu_offload=cpu_offload,
        )

    def test_parity_fails_when_the_reference_differs(self) -> None:
        """A reference whose first weight was nudged by one ulp fails the comparison."""

        def nudged_ddp(model: nn.Module) -> nn.Module:
            with torch.no_grad():
                first = next(model.parameters())
                first.copy_(torch.nextafter(first, torch.full_like(first, torch.inf)))
            return DummyDDP(model)

        config = ParityConfig(FSDPInitMode.RECURSIVE, DeviceInitMode.BEFORE, num_iters=1)
        with self.assertRaisesRegex(AssertionError, "FSDP loss differs|FSDP parameters differ"):
            check_fsdp_parity(self, self.process_group, MixtureOfExperts, config, nudged_ddp)

    def test_parity_refuses_no_fsdp(self) -> None:
        """Parity needs an init mode that wraps."""
        config = ParityConfig(FSDPInitMode.NO_FSDP, DeviceInitMode.BEFORE)
        with self.assertRaisesRegex(ValueError, "wraps with FSDP"):
            check_fsdp_parity(self, self.process_group, NestedWrappedModule, config)


class TestTrainForSeveralSteps(FSDPTest):
    def test_losses_are_finite_and_change(self) -> None:
        """Training the FSDP transformer changes its loss and keeps it finite."""
        model = TransformerWithSharedParams.init(
            self.process_group, FSDPInitMode.RECURSIVE, DeviceInitMode.AFTER
        )
        first = self._train_for_several_steps(model, num_steps=1, autocast=False)
        later = self._train_for_several_steps(model, num_steps=2, autocast=False, save_model=True)
        self.assertTrue(bool(torch.isfinite(first)) and bool(torch.isfinite(later)))
        self.assertNotEqual(first, later)

    def test_save_model_round_trip_keeps_parameters(self) -> None:
        """Zeroing and reloading the state dict after a step leaves the parameters as
        a run without the round trip."""
        losses = []
        params = []
        for save_model in (False, True):
            model = NestedWrappedModule.init(
                self.process_group,
                FSDPInitMode.RECURSIVE,
                DeviceInitMode.BEFORE,
                deterministic=True,
            )
            fsdp_model = FSDP(model, self.process_group)
            losses.append(
                self._train_for_several_steps(fsdp_model, 3, autocast=False, save_model=save_model)
            )
            params.append(full_parameters(fsdp_model))
        self.assertEqual(losses[0], losses[1], rtol=EXACT.rtol, atol=EXACT.atol)
        self.assertEqual(params[0], params[1], rtol=EXACT.rtol, atol=EXACT.atol)


# Single-process checks of the parity configuration and of the plain models.


def test_tolerance_is_exact_in_full_precision_with_two_ranks() -> None:
    """``MixedPrecision()`` sets no dtype, so it is full precision."""
    for mixed_precision in (None, MixedPrecision()):
        config = ParityConfig(
            FSDPInitMode.RECURSIVE, DeviceInitMode.BEFORE, mixed_precision=mixed_precision
        )
        assert config.full_precision()
        assert config.tolerance(world_size=2) == EXACT
        assert config.tolerance(world_size=4) == REORDERED_FP32


def test_tolerance_follows_the_least_precise_dtype() -> None:
    fp16_bf16 = MixedPrecision(param_dtype=torch.float16, buffer_dtype=torch.bfloat16)
    for mixed_precision, use_pure_fp16, dtype in (
        (MixedPrecision(reduce_dtype=torch.float16), False, torch.float16),
        (fp16_bf16, False, torch.bfloat16),
        (None, True, torch.float16),
    ):
        config = ParityConfig(
            FSDPInitMode.RECURSIVE,
            DeviceInitMode.BEFORE,
            mixed_precision=mixed_precision,
            use_pure_fp16=use_pure_fp16,
        )
        assert not config.full_precision()
        assert config.tolerance(world_size=2) == low_precision_tolerance(dtype)


def test_reference_autocasts_only_with_a_param_dtype() -> None:
    """Without ``param_dtype`` FSDP computes in full precision, so the reference must too."""
    for mixed_precision, autocast in (
        (MixedPrecision(param_dtype=torch.float16), True),
        (MixedPrecision(reduce_dtype=torch.float16), False),
    ):
        config = ParityConfig(
            FSDPInitMode.RECURSIVE, DeviceInitMode.BEFORE, mixed_precision=mixed_precision
        )
        assert config.train_options(reference=True).autocast is autocast
        assert config.train_options(reference=False).autocast is False


def test_lora_model_trains_only_the_adapters() -> None:
    """Only ``lora_A``/``lora_B`` are trainable, and a forward keeps the shape."""
    model = LoraModel()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    expected = {f"layers.{i}.attn.lora_{ab}.weight" for i in range(4) for ab in "AB"}
    assert trainable == expected
    tokens = torch.randint(0, 100, (2, 7))
    out = model(tokens)
    assert out.shape == (2, 7, 32)
    out.sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if n in expected)


def test_batchnorm_net_has_one_norm_of_each_kind() -> None:
    model = BatchNormNet()
    kinds = [type(m) for m in (model.lin, model.bn1, model.bn2, model.bn3, model.sync_bn)]
    assert kinds == [nn.Linear, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm]
    assert model.lin.bias is None


@pytest.mark.parametrize("cast_forward_inputs", [False, True])
def test_save_forward_inputs_model_records_every_input(cast_forward_inputs: bool) -> None:
    """Each module stores the input it received; casting makes a half input run."""
    inputs: dict[nn.Module, torch.Tensor] = {}
    model = SaveForwardInputsModel(inputs, cast_forward_inputs=cast_forward_inputs)
    x = torch.zeros(2, 100)
    model(x)
    assert inputs[model] is x and inputs[model.c1] is x
    assert inputs[model.c2].shape == (2, 100)
    if cast_forward_inputs:
        model(x.half())
        assert inputs[model.c1].dtype == torch.float16
    else:
        with pytest.raises(RuntimeError, match="dtype"):
            model(x.half())


def test_nested_sequential_model_sizes() -> None:
    """Four ``Linear(5, 5)`` of 30 parameters each, the last two nested."""
    model = NestedSequentialModel.get_model()
    assert [p.numel() for p in model.parameters()] == [25, 5] * 4
    assert isinstance(model[2], nn.Sequential) and len(model[2]) == 2


def test_dummy_process_group_answers_without_ranks() -> None:
    group = DummyProcessGroup(rank=0, size=2)
    assert (group.rank(), group.size()) == (0, 2)
    work = group.allreduce(torch.ones(3))
    assert work.wait() and work.get_future().wait() == 1


def test_dummy_ddp_forwards() -> None:
    inner = nn.Linear(3, 3)
    x = torch.ones(1, 3)
    assert torch.equal(DummyDDP(inner)(x), inner(x))


def test_unwrap_test_model_rejects_a_plain_module() -> None:
    with pytest.raises(TypeError, match="wraps no FSDPTestModel"):
        unwrap_test_model(nn.Linear(1, 1))


@pytest.mark.skipif(current_device().type != "cpu", reason="a CUDA delay does not block the host")
def test_sleep_ms_sleeps_on_cpu() -> None:
    """On the CPU a delay is a real sleep; a zero delay returns at once."""
    start = time.monotonic()
    sleep_ms(50)
    assert time.monotonic() - start >= 0.05
    start = time.monotonic()
    sleep_ms(0)
    assert time.monotonic() - start < 0.05
