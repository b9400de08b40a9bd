"""``torch.testing._internal.common_fsdp`` for this harness: ``FSDPTest``, the
init modes, the test models and the helpers upstream's FSDP tests import, on the
FSDP under test (``fsdptest.api``: ours, or torch's with ``--fsdp-impl torch``),
with the FSDP2 helpers (``patch_*``, ``check_sharded_parity``,
``compiled_fsdp_test``: ``upstream._fsdp2_helpers``; ``MLPStack.parallelize``).

[Note: Upstream's device init modes]
Upstream names the modes ``DEVICEInitMode.DEVICE_BEFORE/AFTER/NEVER`` (older
files: ``CUDAInitMode.CUDA_BEFORE/AFTER/NEVER``); both mean what
``fsdptest.interface.DeviceInitMode`` means, "the device" being the test's
device. Each member's value is that ``DeviceInitMode``, and each answers
``is_before()``/``is_after()``, which is all the models (``models``) ask of a
mode, so they accept any of the three enums. ``_test_fsdp_parity`` converts with
``as_device_init_mode`` before anything reaches ``fsdptest.parity``.

[Note: Module constants that depend on the device]
``DEVICE_TYPE`` and ``DEVICE_COUNT`` are computed when read (a module
``__getattr__``), not at import: the device is the rank's, and the module is
also imported in the pytest process, which must not initialise CUDA.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping
from contextlib import ExitStack, nullcontext
from copy import deepcopy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdptest import FSDPTest as _LayerFSDPTest
from fsdptest.api import (
    FSDP,
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
)
from fsdptest.interface import DeviceInitMode, FSDPInitMode, FSDPTestModel, ModelFactory
from harness import current_device, current_device_type
from models import (
    MLP,
    AlwaysWrapNestedWrappedModule,
    DeterministicModel,
    DoubleLinear,
    DummyDDP,
    DummyProcessGroup,
    MixtureOfExperts,
    MLPStack,
    ModuleWithDelay,
    NestedLinear,
    NestedWrappedModule,
    NestedWrappedModuleWithDelay,
    NonUniformReqGradNWM,
    SkipModel,
    SkipModule,
    TransformerWithSharedParams,
)
from upstream._fsdp2_helpers import (
    FullyShardMode,
    check_sharded_parity,
    compiled_fsdp_test,
    patch_all_gather,
    patch_all_reduce,
    patch_post_backward,
    patch_reduce_scatter,
    patch_register_post_backward_hook_backward,
    patch_reshard,
    patch_unshard,
    reduce_scatter_with_assert,
)
from upstream._runtime_bridge import runtime_seams_bridged
from upstream.common_device_type import get_devtype
from upstream.common_distributed import MultiProcessTestCase

# The device types upstream's FSDP files instantiate for (``only_for=``): "cuda"
# is the test's device here (see upstream.common_device_type).
FSDP_DEVICES = ("cuda", "hpu", "xpu")


class _UpstreamDeviceInitMode(enum.Enum):
    """See [Note: Upstream's device init modes]."""

    def is_before(self) -> bool:
        return self.device_init_mode.is_before()

    def is_after(self) -> bool:
        return self.device_init_mode.is_after()

    @property
    def device_init_mode(self) -> DeviceInitMode:
        value: DeviceInitMode = self.value
        return value


class DEVICEInitMode(_UpstreamDeviceInitMode):
    """When the model moves to the test's device: before FSDP wraps it, after, or never."""

    DEVICE_BEFORE = DeviceInitMode.BEFORE
    DEVICE_AFTER = DeviceInitMode.AFTER
    DEVICE_NEVER = DeviceInitMode.NEVER


class CUDAInitMode(_UpstreamDeviceInitMode):
    """The older name of ``DEVICEInitMode`` (``.cuda()`` meant the test's device)."""

    CUDA_BEFORE = DeviceInitMode.BEFORE
    CUDA_AFTER = DeviceInitMode.AFTER
    CUDA_NEVER = DeviceInitMode.NEVER


AnyDeviceInitMode = DeviceInitMode | DEVICEInitMode | CUDAInitMode


def as_device_init_mode(mode: AnyDeviceInitMode) -> DeviceInitMode:
    """The ``fsdptest.interface.DeviceInitMode`` an upstream mode means."""
    return mode if isinstance(mode, DeviceInitMode) else mode.device_init_mode


def __getattr__(name: str) -> Any:
    """See [Note: Module constants that depend on the device]."""
    if name == "DEVICE_TYPE":
        return current_device_type()
    if name == "DEVICE_COUNT":
        # The ranks' GPUs; upstream counted 1 on machines without an accelerator.
        return torch.cuda.device_count() if current_device_type() == "cuda" else 1
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- helpers --------------------------------------------------------------------------------


def _assert_module_states(
    model: nn.Module,
    process_group: dist.ProcessGroup,
    assert_fn: Callable[[torch.Tensor, torch.Tensor], object],
) -> None:
    """Calls ``assert_fn(rank 0's, rank r's)`` (on the CPU) for every parameter, then
    every buffer, of ``model`` and every other rank ``r`` of ``process_group``.

    Upstream gathers pickled states (``all_gather_object``, which needs numpy);
    here each tensor is gathered as a tensor, after checking that every rank
    holds as many states of the same sizes."""
    states = [t.detach() for _, t in (*model.named_parameters(), *model.named_buffers())]
    _assert_same_on_ranks(torch.tensor([len(states)]), process_group, "number of module states")
    for state in states:
        _assert_same_on_ranks(torch.tensor([state.numel()]), process_group, "module state sizes")
        gathered = _all_gather(state, process_group)
        for other in gathered[1:]:
            assert_fn(gathered[0], other)


def _all_gather(tensor: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (of one size on all ranks), on the CPU, in rank order."""
    local = tensor.contiguous().to(current_device())
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    return [t.cpu() for t in gathered]


def _assert_same_on_ranks(value: torch.Tensor, group: dist.ProcessGroup, what: str) -> None:
    gathered = _all_gather(value, group)
    if any(not torch.equal(other, gathered[0]) for other in gathered[1:]):
        raise AssertionError(f"ranks differ in their {what}: {[t.tolist() for t in gathered]}")


def _zero_model(model: nn.Module, zero_buffers: bool = False, summon_full: bool = True) -> None:
    """Zeros ``model``'s parameters (all of them, summoned, unless ``summon_full`` is
    False) and, with ``zero_buffers``, its buffers, in place."""
    with FSDP.summon_full_params(model) if summon_full else nullcontext(), torch.no_grad():
        for param in model.parameters():
            param.zero_()
        if zero_buffers:
            for buffer in model.buffers():
                buffer.zero_()


def _get_state_dict(model: nn.Module, cpu_offload: bool = False, half: bool = False) -> Any:
    """``model.state_dict()``, after moving it to the test's device (unless
    ``cpu_offload``) and casting it to fp16 (if ``half``), both in place."""
    if not cpu_offload:
        model = model.to(current_device())
    if half:
        model.half()
    return model.state_dict()


def subtest_name(test_name_mapping: Mapping[str, str], *args: object) -> str:
    """Upstream's ``name_fn`` for ``@parametrize``: each value through the mapping
    (by ``str``), ``None`` as ``none``, joined by ``_``."""
    return "_".join(test_name_mapping[str(a)] if a is not None else "none" for a in args)


def _broadcast_state_dict(
    rank: int, state_dict: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Rank 0's ``state_dict`` on every rank, on the test's device.

    Upstream broadcasts rank 0's dict as a pickled object (which needs numpy);
    here rank 0 first broadcasts its keys, dtypes and shapes (as UTF-8 bytes in a
    tensor), then each tensor, so a rank passes any dict: its own copy of the
    state, or an empty one (a ``rank0_only`` full state dict). ``rank`` is not
    needed."""
    device = current_device()
    source = dist.get_rank() == 0
    layout = [
        (name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in state_dict.items()
    ]
    layout = json.loads(_broadcast_bytes(json.dumps(layout).encode() if source else b"", device))
    received = {}
    for name, dtype, shape in layout:
        if source:
            tensor = state_dict[name].detach().to(device).contiguous()
        else:
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        dist.broadcast(tensor, src=0)
        received[name] = tensor
    return received


def _broadcast_bytes(payload: bytes, device: torch.device) -> bytes:
    """Rank 0's ``payload`` on every rank (the others' is ignored)."""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    data = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if dist.get_rank() == 0 and payload:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(data, src=0)
    return bytes(data.cpu().tolist())


def get_full_params(model: nn.Module, recurse: bool = True) -> list[nn.Parameter]:
    """Copies of ``model``'s unsharded parameters (``summon_full_params``), in
    ``parameters()`` order; offloaded ones come back on the test's device."""
    with FSDP.summon_full_params(model, recurse=recurse):
        return deepcopy(list(model.parameters()))


def _move_to_device(model: nn.Module, move_to_device: bool) -> nn.Module:
    return model.to(current_device()) if move_to_device else model


def _maybe_wrap_fsdp(model: nn.Module, wrap_fsdp: bool, *args: Any, **kwargs: Any) -> nn.Module:
    return FSDP(model, *args, **kwargs) if wrap_fsdp else model


# -- test classes ---------------------------------------------------------------------------


class FSDPTest(_LayerFSDPTest, MultiProcessTestCase):
    """Upstream's ``FSDPTest`` on the harness: ``fsdptest.FSDPTest`` (ranks, subtests,
    assertions, parity) with upstream's attributes and keyword names.

    ``world_size`` is ``--world-size`` (default 2) unless the class sets it:
    upstream's default, one rank per GPU, would make a CPU run, a GPU run and each
    xdist worker check different configurations.

    Each test runs with torch's runtime function names leading to the
    implementation's ([Note: Upstream's patches of torch's runtime functions] in
    ``upstream._runtime_bridge``), so upstream's ``mock.patch`` of them sees its calls.
    """

    _runtime_bridge: ExitStack | None = None

    def setUp(self) -> None:
        super().setUp()
        self._runtime_bridge = ExitStack()
        self._runtime_bridge.enter_context(runtime_seams_bridged())

    def tearDown(self) -> None:
        if self._runtime_bridge is not None:
            self._runtime_bridge.close()
            self._runtime_bridge = None
        super().tearDown()

    @property
    def device_type(self) -> str:
        """The test's device type: ``"cuda"`` on GPU ranks, ``"cpu"`` on CPU ranks."""
        return current_device_type()

    @property
    def destroy_pg_upon_exit(self) -> bool:
        return False

    @property
    def init_method(self) -> str:
        """``file://`` + ``file_name``: a rendezvous every rank agrees on."""
        return f"file://{self.file_name}"

    def _test_fsdp_parity(
        self,
        model_class: ModelFactory,
        fsdp_init_mode: FSDPInitMode,
        device_init_mode: AnyDeviceInitMode | None = None,
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
        *,
        cuda_init_mode: AnyDeviceInitMode | None = None,
        **fsdp_kwargs: Any,
    ) -> None:
        """``fsdptest.FSDPTest._test_fsdp_parity`` with upstream's keywords: the mode
        is ``device_init_mode`` (or, in older files, ``cuda_init_mode``), of any of the
        init-mode enums; ``cpu_offload=None`` is upstream's ``CPUOffload()``."""
        if (device_init_mode is None) == (cuda_init_mode is None):
            raise TypeError("pass exactly one of device_init_mode and cuda_init_mode")
        mode = device_init_mode if device_init_mode is not None else cuda_init_mode
        assert mode is not None
        super()._test_fsdp_parity(
            model_class,
            fsdp_init_mode,
            as_device_init_mode(mode),
            ref_init_fn=ref_init_fn,
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
            init_kwargs=init_kwargs,
            sharded_grad_scaler_kwargs=sharded_grad_scaler_kwargs,
            **fsdp_kwargs,
        )


class FSDPTestContinuous(FSDPTest):
    """Upstream's ``FSDPTest`` that reuses its worker processes across tests; every
    ``FSDPTest`` here runs in reused rank pools, so it is ``FSDPTest``."""


class FSDPTestMultiThread(FSDPTest):
    """Upstream runs these ranks as threads over a threaded process group; here they
    are processes with a real group, like every ``FSDPTest`` (pooled and reused).
    ``world_size`` is ``--world-size`` unless the class sets one (upstream's was the
    device count); upstream's patches act on the process's own FSDP, so they need
    no barriers ([Note: Upstream's FSDP2 patches on any implementation] in
    ``upstream._fsdp2_helpers``)."""


__all__ = [
    "FSDP_DEVICES",
    "MLP",
    "AlwaysWrapNestedWrappedModule",
    "CUDAInitMode",
    "DEVICEInitMode",
    "DeterministicModel",
    "DoubleLinear",
    "DummyDDP",
    "DummyProcessGroup",
    "FSDPInitMode",
    "FSDPTest",
    "FSDPTestContinuous",
    "FSDPTestModel",
    "FSDPTestMultiThread",
    "FullyShardMode",
    "MLPStack",
    "MixtureOfExperts",
    "ModuleWithDelay",
    "NestedLinear",
    "NestedWrappedModule",
    "NestedWrappedModuleWithDelay",
    "NonUniformReqGradNWM",
    "SkipModel",
    "SkipModule",
    "TransformerWithSharedParams",
    "_assert_module_states",
    "_broadcast_state_dict",
    "_get_state_dict",
    "_maybe_wrap_fsdp",
    "_move_to_device",
    "_zero_model",
    "as_device_init_mode",
    "check_sharded_parity",
    "compiled_fsdp_test",
    "get_devtype",
    "get_full_params",
    "patch_all_gather",
    "patch_all_reduce",
    "patch_post_backward",
    "patch_reduce_scatter",
    "patch_register_post_backward_hook_backward",
    "patch_reshard",
    "patch_unshard",
    "reduce_scatter_with_assert",
    "subtest_name",
]
