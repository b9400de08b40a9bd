"""Base classes for distributed tests.

A test class subclasses :class:`DistributedTest` (or :class:`FSDPTest`) and may
declare ``world_size`` as a class attribute or a property; a class that does
not declare one runs with ``--world-size`` ranks (default 2). Each test method
runs on every rank, in its own spawned process, with the default process group
initialised; ``setUp``/``tearDown`` run in every rank around the body.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from harness import _rank
from harness.assertions import Assertions

if TYPE_CHECKING:
    from torch import nn

    from harness.fsdp_api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
    from models import DeviceInitMode, FSDPInitMode, ModelFactory


def current_device() -> torch.device:
    """The device of the rank this code runs in (``cuda:<rank>`` under NCCL, the
    CPU under gloo). Outside a rank: the current CUDA device if any, else the CPU."""
    context = _rank.current_or_none()
    if context is not None:
        return context.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class DistributedTest(Assertions):
    """A pytest test class whose test methods run on every rank."""

    @property
    def world_size(self) -> int:
        return _rank.current().world_size

    @property
    def rank(self) -> int:
        return _rank.current().rank

    @property
    def device(self) -> torch.device:
        """This rank's device: ``cuda:<rank>`` under NCCL, the CPU under gloo."""
        return _rank.current().device

    @property
    def backend(self) -> str:
        return _rank.current().backend

    @property
    def process_group(self) -> dist.ProcessGroup:
        return dist.distributed_c10d._get_default_group()

    def setUp(self) -> None:
        """Runs in every rank before the test body."""

    def tearDown(self) -> None:
        """Runs in every rank after the test body, also when it failed."""

    def run_subtests(
        self,
        subtest_config: Mapping[str, Sequence[object]],
        test_fn: Callable[..., object],
        *test_args: object,
        **test_kwargs: object,
    ) -> None:
        """Runs ``test_fn`` for every combination of ``subtest_config``.

        Every combination runs, also after one fails; the report names each
        failing combination with its configuration and every failing rank.
        """
        _rank.current().run_subtests(subtest_config, test_fn, test_args, dict(test_kwargs))


def declared_world_size(cls: type) -> int | None:
    """The world size a class pins, or None when it leaves it to ``--world-size``."""
    for klass in cls.__mro__:
        if "world_size" in vars(klass):
            if klass is DistributedTest:
                return None
            attr = vars(klass)["world_size"]
            value: Any = attr.fget(cls.__new__(cls)) if isinstance(attr, property) else attr
            return int(value)
    return None


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
        from harness import parity  # lazily: it imports the FSDP implementation chosen at startup

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
        from harness import parity  # lazily: see _test_fsdp_parity

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
