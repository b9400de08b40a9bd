"""Parity of an FSDP model with a data-parallel reference, trained in lockstep.

``FSDPTest._test_fsdp_parity`` and ``FSDPTest._train_for_several_steps`` are thin
entry points over this module: a frozen ``ParityConfig`` built from their
keywords, builders for the two models, a ``Trainer`` that runs one step of one
model, and one compare function, ``assert_lockstep_parity``.

[Note: The parity recipe]
Both models are built from the same seed (``deterministic=True``). The
reference is the bare model (built with ``FSDPInitMode.NO_FSDP`` and
``DeviceInitMode.BEFORE``) under DDP, or under ``ref_init_fn`` for models that
reduce their own gradients. The FSDP model is built by the model's ``init`` and,
when that stops below the root, wrapped by a top-level FSDP with the same
keyword arguments. Both train in lockstep with SGD (momentum 0.9, lr 1e-2) on
the same rank-seeded inputs: the losses are compared after every step and the
full (summoned) parameters, by name, after the last. Gradients are cleared with
``set_to_none`` alternating between steps, so that both fresh gradients and
accumulation into zeroed ones are exercised. With ``save_model`` the FSDP model
(only) round-trips its state dict after every step: saved, zeroed, loaded.

[Note: The mixed-precision reference]
FSDP with ``MixedPrecision(param_dtype=d)`` computes in ``d``. The reference
runs its forward under autocast on the test's device with ``dtype=d`` and casts
its floating-point inputs to ``d`` (integer inputs such as token ids stay), as
FSDP casts the root's inputs; without a ``param_dtype`` it runs in full
precision, as FSDP computes then. Autocast's default dtype on the CPU is bfloat16,
which would not match an fp16 FSDP, hence the explicit dtype. The reference's
loss dtype is not checked: autocast decides it (``sum`` runs in fp32 under CUDA
autocast but in ``d`` under CPU autocast). Parameters are not compared under
mixed precision or pure fp16: the reference steps fp32 parameters with
gradients reduced in fp32 (fp16 ones with pure fp16), FSDP reduces in
``reduce_dtype`` and steps its fp32 shards.

[Note: Tolerances]
In full precision both models run the same operations on the same values:
the forward and backward of each layer, the gradients divided by the world
size before the reduction (DDP and FSDP alike), a reduction of two addends per
element with two ranks (exact in any order) and SGD's elementwise update; so
with two ranks losses and parameters are compared exactly (this held on CPU
with gloo and on GPUs with NCCL); with more, see ``REORDERED_FP32``. In low
precision (mixed or pure fp16) only the losses are compared, to
``low_precision_tolerance`` of the least precise dtype in use; that is meant
for the first steps (the seeds check one): later losses also carry gradients
reduced in different precisions.

[Note: CPU offload checks]
With ``CPUOffload(offload_params=True)`` every FSDP parameter must be on the CPU
after construction, after each backward, after each state-dict round trip and
after each forward (except under the strategies that keep parameters unsharded
from forward to backward, whose parameters are then views into the unsharded
flat parameter on the device). Moving an offloading model to the device after
wrapping (``DeviceInitMode.AFTER``) must fail on the first forward with
``OFFLOAD_DEVICE_ERROR`` naming the device type; on a CPU run that move changes
nothing, so nothing fails there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fsdptest import api
from fsdptest.api import (
    FSDP,
    NO_RESHARD_AFTER_FORWARD_STRATEGIES,
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
    clean_tensor_name,
    provides,
)
from fsdptest.interface import (
    DeviceInitMode,
    FSDPInitMode,
    ModelFactory,
    to_device_if,
    unwrap_test_model,
)
from fsdptest.races import skip_torch_offload_race_in
from harness.assertions import Assertions
from harness.testcase import current_device

LR = 1e-2
MOMENTUM = 0.9
OFFLOAD_DEVICE_ERROR = (
    "An FSDP-managed module with parameter CPU offloading enabled has parameters on {device}"
)

RefInitFn = Callable[[nn.Module], nn.Module]


class Tolerance(NamedTuple):
    rtol: float
    atol: float


EXACT = Tolerance(rtol=0.0, atol=0.0)
# Full precision with more than two ranks: a sum of three or more addends
# depends on its order, which DDP's all-reduce and FSDP's reduce-scatter need
# not share; torch.testing's fp32 defaults cover that reassociation.
REORDERED_FP32 = Tolerance(rtol=1.3e-6, atol=1e-5)


def low_precision_tolerance(dtype: torch.dtype) -> Tolerance:
    """For losses computed in ``dtype`` by FSDP and by the reference (see [Note:
    Tolerances]): each side may round the loss once differently (e.g. the
    reference's ``sum`` accumulates in fp32 under CUDA autocast), hence two
    machine epsilons relative; the absolute part covers losses near zero."""
    return Tolerance(rtol=2 * torch.finfo(dtype).eps, atol=1e-5)


@dataclass(frozen=True)
class TrainOptions:
    """How a ``Trainer`` runs its steps: the keywords of ``_train_for_several_steps``.

    ``cpu_offload=None`` checks no parameter device; ``mixed_precision=None``
    means full precision; ``sharded_grad_scaler_kwargs`` go to
    ``ShardedGradScaler`` (its ``device`` defaults to the test's device type).
    """

    autocast: bool = False
    lr: float = LR
    cpu_offload: CPUOffload | None = None
    save_model: bool = False
    mixed_precision: MixedPrecision | None = None
    enable_sharded_grad_scaler: bool = False
    use_pure_fp16: bool = False
    sharded_grad_scaler_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def autocast_dtype(self, device: torch.device) -> torch.dtype:
        """The mixed-precision compute dtype, else autocast's default for the device."""
        if self.mixed_precision is not None and self.mixed_precision.param_dtype is not None:
            return self.mixed_precision.param_dtype
        return torch.get_autocast_dtype(device.type)


@dataclass(frozen=True)
class ParityConfig:
    """One parity case: the keywords of ``_test_fsdp_parity``.

    ``None`` for ``cpu_offload``, ``backward_prefetch``, ``sharding_strategy`` and
    ``mixed_precision`` is passed to FSDP as is (no offloading, no prefetch,
    ``FULL_SHARD``, full precision). ``init_kwargs`` go to the model's ``init``
    for both models; ``fsdp_kwargs`` are further FSDP constructor arguments.
    """

    fsdp_init_mode: FSDPInitMode
    device_init_mode: DeviceInitMode
    num_iters: int = 2
    save_model: bool = True
    cpu_offload: CPUOffload | None = None
    backward_prefetch: BackwardPrefetch | None = None
    sharding_strategy: ShardingStrategy | None = None
    mixed_precision: MixedPrecision | None = None
    forward_prefetch: bool = False
    use_orig_params: bool = False
    enable_sharded_grad_scaler: bool = False
    use_pure_fp16: bool = False
    init_kwargs: Mapping[str, Any] = field(default_factory=dict)
    sharded_grad_scaler_kwargs: Mapping[str, Any] = field(default_factory=dict)
    fsdp_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def all_fsdp_kwargs(self) -> dict[str, Any]:
        return {
            **self.fsdp_kwargs,
            "cpu_offload": self.cpu_offload,
            "backward_prefetch": self.backward_prefetch,
            "sharding_strategy": self.sharding_strategy,
            "mixed_precision": self.mixed_precision,
            "forward_prefetch": self.forward_prefetch,
            "use_orig_params": self.use_orig_params,
        }

    def train_options(self, reference: bool) -> TrainOptions:
        return TrainOptions(
            autocast=reference and self._mixed_param_dtype() is not None,
            cpu_offload=self.cpu_offload,
            save_model=self.save_model and not reference,
            mixed_precision=self.mixed_precision,
            enable_sharded_grad_scaler=self.enable_sharded_grad_scaler,
            use_pure_fp16=self.use_pure_fp16,
            sharded_grad_scaler_kwargs=self.sharded_grad_scaler_kwargs,
        )

    def offloads_params(self) -> bool:
        return self.cpu_offload is not None and self.cpu_offload.offload_params

    def expects_offload_error(self, device: torch.device) -> bool:
        """See [Note: CPU offload checks]."""
        return self.offloads_params() and self.device_init_mode.is_after() and device.type != "cpu"

    def _mixed_param_dtype(self) -> torch.dtype | None:
        return None if self.mixed_precision is None else self.mixed_precision.param_dtype

    def low_precision_dtype(self) -> torch.dtype | None:
        """The least precise dtype anything is computed, reduced or kept in; None in
        full precision (which ``MixedPrecision()`` with no dtype is)."""
        if self.use_pure_fp16:
            return torch.float16
        if self.mixed_precision is None:
            return None
        mp = self.mixed_precision
        dtypes = [d for d in (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype) if d is not None]
        return max(dtypes, key=lambda d: torch.finfo(d).eps, default=None)

    def full_precision(self) -> bool:
        return self.low_precision_dtype() is None

    def tolerance(self, world_size: int) -> Tolerance:
        """See [Note: Tolerances]."""
        dtype = self.low_precision_dtype()
        if dtype is not None:
            return low_precision_tolerance(dtype)
        return EXACT if world_size <= 2 else REORDERED_FP32


def _grad_scaler(options: TrainOptions) -> torch.amp.GradScaler:
    """The implementation's ``ShardedGradScaler``; a disabled ``torch.amp.GradScaler``
    when the implementation has none and the options ask for none."""
    kwargs = {"device": current_device().type, **options.sharded_grad_scaler_kwargs}
    if provides("ShardedGradScaler") or options.enable_sharded_grad_scaler:
        # without one, the attribute's error names the implementation and the name
        return api.ShardedGradScaler(enabled=options.enable_sharded_grad_scaler, **kwargs)
    return torch.amp.GradScaler(enabled=False, **kwargs)


class Trainer:
    """One model in training: its optimizer, its grad scaler, and the checks of a step.

    The model is a wrapper (DDP, FSDP, ``DummyDDP``) around an ``FSDPTestModel``,
    which provides the input, the loss and the backward.
    """

    case: Assertions
    model: nn.Module
    options: TrainOptions
    optim: torch.optim.SGD
    scaler: torch.amp.GradScaler
    steps_taken: int
    _loss_device: torch.device
    _is_fsdp: bool

    def __init__(self, case: Assertions, model: nn.Module, options: TrainOptions) -> None:
        self.case = case
        self.model = model
        self.options = options
        # SGD with momentum rather than Adam: Adam is invariant to the gradients'
        # scale, so it would hide a wrong gradient division.
        self.optim = torch.optim.SGD(model.parameters(), lr=options.lr, momentum=MOMENTUM)
        self.scaler = _grad_scaler(options)
        self.steps_taken = 0
        # Inputs are always on the test's device; the loss goes where the
        # parameters are (the CPU when offloaded).
        self._loss_device = next(model.parameters()).device
        self._is_fsdp = isinstance(model, FSDP)

    def step(self) -> torch.Tensor:
        """One iteration; returns the loss (scaled when the scaler is enabled), detached."""
        self.optim.zero_grad(set_to_none=self.steps_taken % 2 == 0)
        loss = self.scaler.scale(self._forward_loss())
        self._check_loss_dtype(loss)
        unwrap_test_model(self.model).run_backward(loss)
        self._check_offloaded("after backward")
        self.scaler.step(self.optim)
        self.scaler.update()
        if self.options.save_model:
            self._round_trip_state_dict()
            self._check_offloaded("after loading the state dict")
        self.steps_taken += 1
        return loss.detach()

    def _forward_loss(self) -> torch.Tensor:
        device = current_device()
        test_model = unwrap_test_model(self.model)
        with torch.autocast(
            device.type,
            dtype=self.options.autocast_dtype(device),
            enabled=self.options.autocast,
        ):
            inputs = _cast_floating(test_model.get_input(device), self._input_dtype())
            output = self.model(*inputs)
            if self._reshards_after_forward():
                self._check_offloaded("after forward")
            return test_model.get_loss(inputs, output).to(self._loss_device)

    def _input_dtype(self) -> torch.dtype | None:
        """See [Note: The mixed-precision reference]."""
        if self.options.use_pure_fp16:
            return torch.float16
        if self.options.mixed_precision is not None and not self._is_fsdp:
            return self.options.mixed_precision.param_dtype
        return None

    def _expected_loss_dtype(self) -> torch.dtype | None:
        """None where autocast decides (see [Note: The mixed-precision reference])."""
        if self.options.use_pure_fp16:
            return torch.float16
        if self.options.autocast:
            return None
        mixed_precision = self.options.mixed_precision
        if mixed_precision is not None and self._is_fsdp:
            return mixed_precision.param_dtype or torch.float32
        return torch.float32

    def _check_loss_dtype(self, loss: torch.Tensor) -> None:
        expected = self._expected_loss_dtype()
        if expected is not None:
            self.case.assertEqual(loss.dtype, expected, "unexpected loss dtype")

    def _offloads(self) -> bool:
        offload = self.options.cpu_offload
        return self._is_fsdp and offload is not None and offload.offload_params

    def _reshards_after_forward(self) -> bool:
        strategy = getattr(self.model, "sharding_strategy", None)
        return strategy not in NO_RESHARD_AFTER_FORWARD_STRATEGIES

    def _check_offloaded(self, when: str) -> None:
        if self._offloads():
            assert_params_on_cpu(self.case, self.model, when)

    def _round_trip_state_dict(self) -> None:
        """Saves, zeroes and reloads the model: parity then holds only if the state
        dict carries every parameter."""
        saved = {name: tensor.clone() for name, tensor in self.model.state_dict().items()}
        zero_parameters(self.model)
        self.model.load_state_dict(saved)


def _cast_floating(
    inputs: tuple[torch.Tensor, ...], dtype: torch.dtype | None
) -> tuple[torch.Tensor, ...]:
    if dtype is None:
        return inputs
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)


def assert_params_on_cpu(case: Assertions, model: nn.Module, when: str) -> None:
    for name, param in model.named_parameters():
        case.assertEqual(param.device, torch.device("cpu"), f"{name} is not offloaded {when}")


@torch.no_grad()
def zero_parameters(model: nn.Module) -> None:
    with FSDP.summon_full_params(model):
        for param in model.parameters():
            param.zero_()


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the unsharded parameters, by name without FSDP's prefixes."""
    with FSDP.summon_full_params(model):
        return {
            clean_tensor_name(name): param.detach().clone()
            for name, param in model.named_parameters()
        }


def reference_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters of the test model inside a reference wrapper, by name."""
    return {name: param.detach() for name, param in unwrap_test_model(model).named_parameters()}


def train_for_several_steps(
    case: Assertions, model: nn.Module, num_steps: int, options: TrainOptions
) -> torch.Tensor:
    """Trains one model for ``num_steps`` steps; returns the last loss."""
    trainer = Trainer(case, model, options)
    losses = [trainer.step() for _ in range(num_steps)]
    return losses[-1]


def build_reference(
    group: dist.ProcessGroup,
    model_class: ModelFactory,
    config: ParityConfig,
    ref_init_fn: RefInitFn | None,
) -> nn.Module:
    model = model_class.init(
        group,
        FSDPInitMode.NO_FSDP,
        DeviceInitMode.BEFORE,
        deterministic=True,
        **config.init_kwargs,
    )
    reference = _ddp(model) if ref_init_fn is None else ref_init_fn(model)
    return reference.half() if config.use_pure_fp16 else reference


def _ddp(model: nn.Module) -> DistributedDataParallel:
    device = current_device()
    if device.type == "cpu":
        return DistributedDataParallel(model)
    return DistributedDataParallel(model, device_ids=[device.index], output_device=device.index)


def build_fsdp_model(
    group: dist.ProcessGroup, model_class: ModelFactory, config: ParityConfig
) -> nn.Module:
    """The model's own wrapping, under a top-level FSDP if it has none (the reference
    is data parallel over the whole model, so FSDP must be too)."""
    kwargs = config.all_fsdp_kwargs()
    model = model_class.init(
        group,
        config.fsdp_init_mode,
        config.device_init_mode,
        kwargs,
        deterministic=True,
        **config.init_kwargs,
    )
    if not isinstance(model, FSDP):
        model = FSDP(model, group, **kwargs)
    if config.use_pure_fp16:
        model = model.half()  # after wrapping: FSDP then holds fp16 shards
    return to_device_if(model, config.device_init_mode.is_after())


def check_fsdp_parity(
    case: Assertions,
    group: dist.ProcessGroup,
    model_class: ModelFactory,
    config: ParityConfig,
    ref_init_fn: RefInitFn | None = None,
) -> None:
    """Builds both models and checks them; see [Note: The parity recipe]."""
    if config.fsdp_init_mode is FSDPInitMode.NO_FSDP:
        raise ValueError("parity needs an FSDP init mode that wraps with FSDP")
    device = current_device()
    ref_model = build_reference(group, model_class, config, ref_init_fn)
    reference = Trainer(case, ref_model, config.train_options(reference=True))
    fsdp_model = build_fsdp_model(group, model_class, config)
    skip_torch_offload_race_in(case, fsdp_model, config.cpu_offload, config.use_orig_params)
    fsdp = Trainer(case, fsdp_model, config.train_options(reference=False))
    if config.expects_offload_error(device):
        with case.assertRaisesRegex(RuntimeError, OFFLOAD_DEVICE_ERROR.format(device=device.type)):
            fsdp.step()
        return
    if config.offloads_params():
        assert_params_on_cpu(case, fsdp.model, "after construction")
    tolerance = config.tolerance(dist.get_world_size(group))
    assert_lockstep_parity(case, reference, fsdp, config, tolerance)


def assert_lockstep_parity(
    case: Assertions,
    reference: Trainer,
    fsdp: Trainer,
    config: ParityConfig,
    tolerance: Tolerance,
) -> None:
    """Steps both trainers ``config.num_iters`` times, comparing the losses after
    every step, then, in full precision, the full parameters (see [Note:
    Tolerances])."""
    for step in range(config.num_iters):
        ref_loss = reference.step()
        fsdp_loss = fsdp.step().to(ref_loss.device)
        case.assertEqual(
            fsdp_loss,
            ref_loss,
            f"FSDP loss differs from the reference at step {step}",
            exact_dtype=False,
            rtol=tolerance.rtol,
            atol=tolerance.atol,
        )
    if config.full_precision():
        case.assertEqual(
            full_parameters(fsdp.model),
            reference_parameters(reference.model),
            "FSDP parameters differ from the reference",
            exact_device=True,
            rtol=tolerance.rtol,
            atol=tolerance.atol,
        )
