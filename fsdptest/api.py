"""The FSDP API under test: this project's ``fsdp`` package or ``torch.distributed.fsdp``.

Suites and models import every FSDP name from here. ``--fsdp-impl`` (default
``local``) is exported by the plugin as ``FSDP_HARNESS_IMPL`` before any test
module is imported, and the rank processes inherit it, so every process of a
session sees the same implementation.

[Note: Running torch's FSDP on CPU]
Torch's ``FullyShardedDataParallel`` refuses to run without an accelerator
unless ``device_id=torch.device("cpu")`` is passed. The torch side of this
module therefore exports a subclass that supplies the rank's device when a test
gives none, so seed tests run unchanged on CPU; ``isinstance`` checks against it
accept every torch FSDP instance (auto-wrapped children are built from torch's
own class). Torch's FSDP cannot offload parameters to the CPU without an
accelerator (it pins memory and synchronises accelerator streams); such a
configuration is skipped with ``TORCH_CPU_OFFLOAD_SKIP`` as the reason.
"""

from __future__ import annotations

import inspect
import os
import unittest
from dataclasses import dataclass
from typing import Any

import torch

from fsdptest._constants import IMPL_ENV, TORCH_CPU_OFFLOAD_SKIP
from harness import current_device

IMPL: str = os.environ.get(IMPL_ENV, "local")
if IMPL not in ("local", "torch"):
    raise ValueError(f"{IMPL_ENV} must be 'local' or 'torch', got {IMPL!r}")


@dataclass(frozen=True)
class Seams:
    """Dotted paths of the runtime functions the seed tests patch with ``mock.patch``."""

    register_pre_backward_hooks: str
    register_post_backward_hook: str
    reshard: str


if IMPL == "torch":
    import torch.distributed.fsdp as _torch_fsdp
    from torch.distributed.fsdp import (
        BackwardPrefetch,
        CPUOffload,
        FullStateDictConfig,
        LocalStateDictConfig,
        MixedPrecision,
        ShardedStateDictConfig,
        ShardingStrategy,
        StateDictType,
    )
    from torch.distributed.fsdp._common_utils import FSDP_PREFIX, clean_tensor_name
    from torch.distributed.fsdp._flat_param import (
        _FSDP_SKIP_WRITEBACK_CHECK,
        _FSDP_USE_FULL_PREC_IN_EVAL,
        FlatParameter,
        FlatParamHandle,
        FlatParamShardMetadata,
        HandleShardingStrategy,
    )
    from torch.distributed.fsdp._init_utils import NO_RESHARD_AFTER_FORWARD_STRATEGIES
    from torch.distributed.fsdp._unshard_param_utils import FLAT_PARAM
    from torch.distributed.fsdp._wrap_utils import _validate_frozen_params
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torch.distributed.fsdp.wrap import (
        CustomPolicy,
        ModuleWrapPolicy,
        _or_policy,
        _Policy,
        _wrap_module_cls_individually,
        always_wrap_policy,
        enable_wrap,
        lambda_auto_wrap_policy,
        size_based_auto_wrap_policy,
        transformer_auto_wrap_policy,
        wrap,
    )

    _TorchFSDP = _torch_fsdp.FullyShardedDataParallel
    _SIGNATURE = inspect.signature(_TorchFSDP.__init__)

    class _AcceptsEveryTorchFSDP(type):
        def __instancecheck__(cls, obj: object) -> bool:
            return isinstance(obj, _TorchFSDP)

        def __subclasscheck__(cls, sub: type) -> bool:
            return issubclass(sub, _TorchFSDP)

    class FullyShardedDataParallel(_TorchFSDP, metaclass=_AcceptsEveryTorchFSDP):  # type: ignore[misc]
        """Torch's FSDP, given the rank's device on CPU runs (see the module note)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if current_device().type == "cpu":
                bound = _SIGNATURE.bind_partial(self, *args, **kwargs).arguments
                offload = bound.get("cpu_offload")
                if offload is not None and offload.offload_params:
                    raise unittest.SkipTest(TORCH_CPU_OFFLOAD_SKIP)
                if bound.get("device_id") is None:
                    kwargs["device_id"] = torch.device("cpu")
            super().__init__(*args, **kwargs)

    fully_shard = None
    FULLY_SHARD_MISSING = (
        "torch.distributed.fsdp no longer has the composable fully_shard(module, policy=...) "
        "of FSDP1 (torch.distributed._composable.fully_shard is FSDP2, another API)"
    )
    SEAMS = Seams(
        register_pre_backward_hooks="torch.distributed.fsdp._runtime_utils._register_pre_backward_hooks",
        register_post_backward_hook="torch.distributed.fsdp._runtime_utils._register_post_backward_hook",
        reshard="torch.distributed.fsdp._runtime_utils._reshard",
    )
else:
    from fsdp import (
        BackwardPrefetch,
        CPUOffload,
        FullStateDictConfig,
        FullyShardedDataParallel,
        LocalStateDictConfig,
        MixedPrecision,
        ShardedStateDictConfig,
        ShardingStrategy,
        StateDictType,
    )
    from fsdp._common import (
        _FSDP_SKIP_WRITEBACK_CHECK,
        _FSDP_USE_FULL_PREC_IN_EVAL,
        FLAT_PARAM,
        FSDP_PREFIX,
        NO_RESHARD_AFTER_FORWARD_STRATEGIES,
        clean_tensor_name,
    )
    from fsdp._composable import fully_shard
    from fsdp._flat_param import (
        FlatParameter,
        FlatParamHandle,
        FlatParamShardMetadata,
        HandleShardingStrategy,
    )
    from fsdp.sharded_grad_scaler import ShardedGradScaler
    from fsdp.wrap import (
        CustomPolicy,
        ModuleWrapPolicy,
        _or_policy,
        _Policy,
        _validate_frozen_params,
        _wrap_module_cls_individually,
        always_wrap_policy,
        enable_wrap,
        lambda_auto_wrap_policy,
        size_based_auto_wrap_policy,
        transformer_auto_wrap_policy,
        wrap,
    )

    FULLY_SHARD_MISSING = ""
    SEAMS = Seams(
        register_pre_backward_hooks="fsdp._runtime.FSDPState._register_pre_backward_hooks",
        register_post_backward_hook="fsdp._runtime.FSDPState._register_post_backward_hook",
        reshard="fsdp._flat_param.FlatParamHandle.reshard",
    )

FSDP = FullyShardedDataParallel

__all__ = [
    "FLAT_PARAM",
    "FSDP",
    "FSDP_PREFIX",
    "FULLY_SHARD_MISSING",
    "IMPL",
    "NO_RESHARD_AFTER_FORWARD_STRATEGIES",
    "SEAMS",
    "_FSDP_SKIP_WRITEBACK_CHECK",
    "_FSDP_USE_FULL_PREC_IN_EVAL",
    "BackwardPrefetch",
    "CPUOffload",
    "CustomPolicy",
    "FlatParamHandle",
    "FlatParamShardMetadata",
    "FlatParameter",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "HandleShardingStrategy",
    "LocalStateDictConfig",
    "MixedPrecision",
    "ModuleWrapPolicy",
    "ShardedGradScaler",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictType",
    "_Policy",
    "_or_policy",
    "_validate_frozen_params",
    "_wrap_module_cls_individually",
    "always_wrap_policy",
    "clean_tensor_name",
    "current_device",
    "enable_wrap",
    "fully_shard",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]
