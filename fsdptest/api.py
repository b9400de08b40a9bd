"""The FSDP API under test: this project's ``fsdp``, ``torch.distributed.fsdp``, or any
module exposing the FSDP1 API.

Suites and models import every FSDP name from here. ``--fsdp-impl`` (default
``local``) is exported by the plugin as ``FSDP_HARNESS_IMPL`` before any test
module is imported, and the rank processes inherit it, so every process of a
session sees the same implementation (``fsdptest.implementations`` says how a
name resolves to a module). ``IMPL`` is ``"local"``, ``"torch"``, or the name a
foreign implementation was given.

[Note: Public names and private seams]
The public FSDP1 names (``PUBLIC_NAMES``) are taken from the implementation's
module, the wrap policies from its ``wrap`` submodule and ``ShardedGradScaler``
from its ``sharded_grad_scaler`` submodule when it has them (as torch's and ours
do), else from the module itself: the same lookup for every implementation. A
name the module lacks is absent here: importing it fails with
``MissingFromImplementation`` (an ``ImportError``) naming the implementation, the
name and where it was looked for, so a suite that needs it fails at collection
with that message. ``fsdptest`` itself needs ``REQUIRED``: without them importing
this module fails at once.

The private names (``SEAMS``, ``FlatParamHandle``, ``HandleTrainingState``,
``_get_training_state``, the chunked sharded-tensor/DTensor helpers of
``_shard_utils``, ``_get_param_to_fqns``, ...) are each implementation's
internals: ours, or torch's under ``--fsdp-impl torch``. Torch's exec-order
tracer (``_ExecOrderTracer``) has no counterpart in ours: a test using it skips
with ``EXEC_ORDER_TRACER_MISSING`` as the reason. For another implementation the plain ones
fall back (``clean_tensor_name`` strips torch's wrapper prefixes unless the module
has its own, ``NO_RESHARD_AFTER_FORWARD_STRATEGIES`` is read off its
``ShardingStrategy``, the environment switches keep torch's names), and the rest
are stand-ins that skip the test using them with the reason
(``unittest.SkipTest``; at collection, the whole module).

[Note: Running torch's FSDP on CPU]
Torch's ``FullyShardedDataParallel`` refuses to run without an accelerator
unless ``device_id=torch.device("cpu")`` is passed. The torch side of this
module therefore exports a subclass that supplies the rank's device when a test
gives none, so seed tests run unchanged on CPU; ``isinstance`` checks against it
accept every torch FSDP instance (auto-wrapped children are built from torch's
own class). Torch's FSDP cannot offload parameters to the CPU without an
accelerator (it pins memory and synchronises accelerator streams); such a
configuration is skipped with ``TORCH_CPU_OFFLOAD_SKIP`` as the reason, or,
where a suite asserts the limitation instead (``torch_refuses_cpu_offload``),
``assert_torch_refuses_cpu_offload`` checks that torch's own class raises
``TORCH_CPU_OFFLOAD_ERROR`` when built so.
"""

from __future__ import annotations

import importlib
import inspect
import os
import unittest
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from fsdptest._constants import IMPL_ENV, TORCH_CPU_OFFLOAD_ERROR, TORCH_CPU_OFFLOAD_SKIP
from fsdptest.implementations import Implementation, resolve
from harness import current_device

if TYPE_CHECKING:  # the public names as a type checker sees them: ours mirror torch's
    from fsdp import (
        BackwardPrefetch,
        CPUOffload,
        FullOptimStateDictConfig,
        FullStateDictConfig,
        FullyShardedDataParallel,
        LocalOptimStateDictConfig,
        LocalStateDictConfig,
        MixedPrecision,
        OptimStateKeyType,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
        ShardingStrategy,
        StateDictSettings,
        StateDictType,
    )
    from fsdp.sharded_grad_scaler import ShardedGradScaler
    from fsdp.wrap import (
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

PUBLIC_NAMES: dict[str, tuple[str, ...]] = {
    "": (
        "BackwardPrefetch",
        "CPUOffload",
        "FullOptimStateDictConfig",
        "FullStateDictConfig",
        "FullyShardedDataParallel",
        "LocalOptimStateDictConfig",
        "LocalStateDictConfig",
        "MixedPrecision",
        "OptimStateKeyType",
        "ShardedOptimStateDictConfig",
        "ShardedStateDictConfig",
        "ShardingStrategy",
        "StateDictSettings",
        "StateDictType",
    ),
    "wrap": (
        "CustomPolicy",
        "ModuleWrapPolicy",
        "_Policy",
        "_or_policy",
        "_wrap_module_cls_individually",
        "always_wrap_policy",
        "enable_wrap",
        "lambda_auto_wrap_policy",
        "size_based_auto_wrap_policy",
        "transformer_auto_wrap_policy",
        "wrap",
    ),
    "sharded_grad_scaler": ("ShardedGradScaler",),
}
"""The names taken from the implementation, by the submodule looked in first
(``""``: the module itself only)."""

REQUIRED = (
    "FullyShardedDataParallel",
    "ShardingStrategy",
    "MixedPrecision",
    "CPUOffload",
    "BackwardPrefetch",
)
"""What ``fsdptest`` itself imports (``FSDPTest``, the parity trainer)."""


class MissingFromImplementation(ImportError):
    """A public FSDP name the implementation under test does not have."""


class UnavailablePart(unittest.SkipTest, AttributeError):
    """A private part of ours and torch's FSDP that the implementation under test
    does not have: the test using it is skipped."""


class PublicAPI:
    """The public FSDP1 names one implementation's module exposes (see the module note)."""

    def __init__(self, impl: Implementation) -> None:
        self.impl = impl
        self.found: dict[str, Any] = {}
        self.looked_in: dict[str, list[str]] = {}
        module = importlib.import_module(impl.module)
        for submodule, names in PUBLIC_NAMES.items():
            places = [p for p in (self._submodule(module, submodule), module) if p is not None]
            for name in names:
                self.looked_in[name] = [place.__name__ for place in places]
                value = next((getattr(p, name) for p in places if _defines(p, name)), None)
                if value is not None:
                    self.found[name] = value

    @staticmethod
    def _submodule(module: ModuleType, name: str) -> ModuleType | None:
        if not name:
            return None
        try:
            return importlib.import_module(f"{module.__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{module.__name__}.{name}":
                raise  # the submodule exists but fails to import
            return None

    def require(self, names: tuple[str, ...]) -> None:
        for name in names:
            if name not in self.found:
                raise self.missing(name)

    def missing(self, name: str) -> MissingFromImplementation:
        return MissingFromImplementation(
            f"the FSDP under test ({self.impl.describe()}, {self.impl.origin}) has no "
            f"{name} (looked in {', '.join(self.looked_in[name])}): what needs it cannot "
            "run against this implementation",
            name=name,
        )


def _defines(place: ModuleType, name: str) -> bool:
    """Whether ``place`` has ``name`` as an object (not as a submodule, like ``wrap``)."""
    return hasattr(place, name) and not isinstance(getattr(place, name), ModuleType)


IMPLEMENTATION: Implementation = resolve(os.environ.get(IMPL_ENV, "local"))
IMPL: str = IMPLEMENTATION.kind
_PUBLIC = PublicAPI(IMPLEMENTATION)
_PUBLIC.require(REQUIRED)
globals().update(_PUBLIC.found)


def provides(name: str) -> bool:
    """Whether the implementation under test has the public name ``name``."""
    return name in _PUBLIC.found


def __getattr__(name: str) -> Any:
    if name in _PUBLIC.looked_in:
        raise _PUBLIC.missing(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class Seams:
    """Dotted paths of the runtime functions the seed tests patch with ``mock.patch``."""

    register_pre_backward_hooks: str
    register_post_backward_hook: str
    reshard: str
    post_backward_reshard: str  # once per unit and backward, from its post-backward hooks
    get_handle_to_prefetch: str
    """Called as ``(state, current_handle)`` in each unit's forward, pre- and
    post-backward; returns the handle to prefetch, or None."""


class _Unavailable(type):
    """A private name the implementation under test lacks: using it skips the test
    (an ``AttributeError`` too, so ``hasattr`` answers False)."""

    reason: str

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):  # Python's and tools' protocol probes
            raise AttributeError(name)
        raise UnavailablePart(cls.reason)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise UnavailablePart(cls.reason)

    def __instancecheck__(cls, obj: object) -> bool:
        raise UnavailablePart(cls.reason)

    def __iter__(cls) -> Any:
        raise UnavailablePart(cls.reason)


def _unavailable(name: str, reason: str | None = None) -> Any:
    """A stand-in for the private part ``name``: using it skips the test with
    ``reason`` (default: the implementation under test does not have it)."""
    if reason is None:
        reason = (
            f"needs {name}, a private part of this project's and torch's FSDP that the FSDP "
            f"under test ({IMPLEMENTATION.describe()}) does not have"
        )
    return _Unavailable(name, (), {"reason": reason})


EXEC_ORDER_TRACER_MISSING = (
    "needs _ExecOrderTracer (torch.distributed.fsdp._trace_utils), torch's recorder of the "
    "module and parameter order of a torch.fx symbolic trace; no FSDP code path of torch's "
    "uses it any more and this project's FSDP has no counterpart (it records the execution "
    "order at run time: fsdp._exec_order)"
)

if IMPL == "torch":
    import torch.distributed.fsdp as _torch_fsdp
    from torch.distributed.fsdp._common_utils import (
        FSDP_PREFIX,
        _get_handle_fqns_from_root,
        _get_param_to_fqns,
        clean_tensor_name,
    )
    from torch.distributed.fsdp._flat_param import (
        _FSDP_SKIP_WRITEBACK_CHECK,
        _FSDP_USE_FULL_PREC_IN_EVAL,
        _FSDP_USE_UNSAFE_SETATTR,
        FlatParameter,
        FlatParamHandle,
        FlatParamShardMetadata,
        HandleShardingStrategy,
        HandleTrainingState,
    )
    from torch.distributed.fsdp._init_utils import (
        HYBRID_SHARDING_STRATEGIES,
        NO_RESHARD_AFTER_FORWARD_STRATEGIES,
        _init_intra_and_inter_node_groups,
    )
    from torch.distributed.fsdp._runtime_utils import (
        HOMOGENEOUS_ATTR_NAMES,
        _get_training_state,
    )
    from torch.distributed.fsdp._shard_utils import (
        _all_gather_dtensor,
        _create_chunk_dtensor,
        _create_chunk_sharded_tensor,
    )
    from torch.distributed.fsdp._trace_utils import _ExecOrderTracer
    from torch.distributed.fsdp._wrap_utils import _validate_frozen_params
    from torch.distributed.fsdp.fully_sharded_data_parallel import FLAT_PARAM
    from torch.distributed.utils import _apply_to_tensors, _replace_by_prefix

    _TorchFSDP = _torch_fsdp.FullyShardedDataParallel

    def handle_fqns(handle: FlatParamHandle) -> tuple[str, ...]:
        """The names of the handle's original parameters, relative to its unit's module."""
        return tuple(handle.flat_param._fqns)

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
        post_backward_reshard="torch.distributed.fsdp._runtime_utils._post_backward_reshard",
        get_handle_to_prefetch="torch.distributed.fsdp._runtime_utils._get_handle_to_prefetch",
    )
elif IMPL == "local":
    from fsdp._common import (
        _FSDP_SKIP_WRITEBACK_CHECK,
        _FSDP_USE_FULL_PREC_IN_EVAL,
        _FSDP_USE_UNSAFE_SETATTR,
        FLAT_PARAM,
        FSDP_PREFIX,
        HYBRID_SHARDING_STRATEGIES,
        NO_RESHARD_AFTER_FORWARD_STRATEGIES,
        HandleTrainingState,
        clean_tensor_name,
    )
    from fsdp._composable import fully_shard
    from fsdp._flat_param import (
        FlatParameter,
        FlatParamHandle,
        FlatParamShardMetadata,
        HandleShardingStrategy,
    )
    from fsdp._init import _init_intra_and_inter_node_groups
    from fsdp._optim_state_dict import _get_param_to_fqns
    from fsdp._runtime import HOMOGENEOUS_ATTR_NAMES
    from fsdp._shard_utils import (
        _all_gather_dtensor,
        _create_chunk_dtensor,
        _create_chunk_sharded_tensor,
    )
    from fsdp._utils import _apply_to_tensors, _replace_by_prefix
    from fsdp.wrap import _validate_frozen_params

    FULLY_SHARD_MISSING = ""
    _ExecOrderTracer = _unavailable("_ExecOrderTracer", EXEC_ORDER_TRACER_MISSING)
    SEAMS = Seams(
        register_pre_backward_hooks="fsdp._runtime.FSDPState._register_pre_backward_hooks",
        register_post_backward_hook="fsdp._runtime.FSDPState._register_post_backward_hook",
        reshard="fsdp._flat_param.FlatParamHandle.reshard",
        post_backward_reshard="fsdp._runtime.FSDPState._post_backward_reshard",
        get_handle_to_prefetch="fsdp._runtime.FSDPState._get_handle_to_prefetch",
    )

    def handle_fqns(handle: FlatParamHandle) -> tuple[str, ...]:
        """The names of the handle's original parameters, relative to its unit's module."""
        return handle.fqns

    def _get_training_state(handle: FlatParamHandle) -> HandleTrainingState:
        """torch's ``_runtime_utils._get_training_state``."""
        return handle.training_state

    def _get_handle_fqns_from_root(state: Any, handle: FlatParamHandle | None) -> list[str] | None:
        """torch's ``_common_utils._get_handle_fqns_from_root``: the names of the
        handle's original parameters as seen from the root, None for no handle."""
        return None if handle is None else state.root.exec_order.fqns[handle]


else:

    def _without_wrapper_prefixes(tensor_name: str) -> str:
        """torch's ``clean_tensor_name``: the name without FSDP's and activation
        checkpointing's wrapper prefixes."""
        for prefix in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
            tensor_name = tensor_name.replace(prefix, "")
        return tensor_name

    clean_tensor_name = getattr(
        importlib.import_module(IMPLEMENTATION.module),
        "clean_tensor_name",
        _without_wrapper_prefixes,
    )
    NO_RESHARD_AFTER_FORWARD_STRATEGIES = tuple(
        getattr(ShardingStrategy, name)
        for name in ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2")
        if hasattr(ShardingStrategy, name)
    )
    _FSDP_USE_FULL_PREC_IN_EVAL = "FSDP_USE_FULL_PREC_IN_EVAL"
    _FSDP_SKIP_WRITEBACK_CHECK = "FSDP_SKIP_WRITEBACK_CHECK"
    _FSDP_USE_UNSAFE_SETATTR = "FSDP_USE_UNSAFE_SETATTR"
    FLAT_PARAM = "_flat_param"
    FSDP_PREFIX = "_fsdp_wrapped_module."
    HYBRID_SHARDING_STRATEGIES = tuple(
        getattr(ShardingStrategy, name)
        for name in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
        if hasattr(ShardingStrategy, name)
    )
    HOMOGENEOUS_ATTR_NAMES = _unavailable("HOMOGENEOUS_ATTR_NAMES")
    _init_intra_and_inter_node_groups = _unavailable("_init_intra_and_inter_node_groups")
    _apply_to_tensors = _unavailable("_apply_to_tensors")
    _replace_by_prefix = _unavailable("_replace_by_prefix")
    fully_shard = None
    FULLY_SHARD_MISSING = (
        f"the composable fully_shard(module, policy=...) of FSDP1 is this project's; the FSDP "
        f"under test ({IMPLEMENTATION.describe()}) is tested through its wrapper class"
    )
    SEAMS = _unavailable("SEAMS (the runtime functions tests patch)")
    FlatParameter = _unavailable("FlatParameter")
    FlatParamHandle = _unavailable("FlatParamHandle")
    FlatParamShardMetadata = _unavailable("FlatParamShardMetadata")
    HandleShardingStrategy = _unavailable("HandleShardingStrategy")
    HandleTrainingState = _unavailable("HandleTrainingState")
    _get_training_state = _unavailable("_get_training_state")
    _get_handle_fqns_from_root = _unavailable("_get_handle_fqns_from_root")
    _validate_frozen_params = _unavailable("_validate_frozen_params")
    _get_param_to_fqns = _unavailable("_get_param_to_fqns")
    _create_chunk_sharded_tensor = _unavailable("_create_chunk_sharded_tensor")
    _create_chunk_dtensor = _unavailable("_create_chunk_dtensor")
    _all_gather_dtensor = _unavailable("_all_gather_dtensor")
    _ExecOrderTracer = _unavailable("_ExecOrderTracer")


FSDP = FullyShardedDataParallel


def torch_refuses_cpu_offload(cpu_offload: Any) -> bool:
    """Torch's FSDP on a CPU run asked to offload parameters (see the module note)."""
    offloads = cpu_offload is not None and cpu_offload.offload_params
    return IMPL == "torch" and current_device().type == "cpu" and offloads


def assert_torch_refuses_cpu_offload(
    case: unittest.TestCase, module: torch.nn.Module, in_features: int
) -> None:
    """Torch's own class, wrapping ``module`` (a module of ``in_features`` inputs)
    with parameter offloading on a CPU run, raises ``TORCH_CPU_OFFLOAD_ERROR`` by
    its first forward, where it pins the shard's memory (the facade would skip
    instead)."""
    if IMPL != "torch":
        raise AssertionError("only torch's FSDP refuses to offload on a CPU run")
    with case.assertRaisesRegex(RuntimeError, TORCH_CPU_OFFLOAD_ERROR):
        model = _TorchFSDP(
            module, device_id=torch.device("cpu"), cpu_offload=CPUOffload(offload_params=True)
        )
        param = next(module.parameters())
        model(torch.zeros(1, in_features, dtype=param.dtype)).sum().backward()


__all__ = [
    "EXEC_ORDER_TRACER_MISSING",
    "FLAT_PARAM",
    "_ExecOrderTracer",
    "_all_gather_dtensor",
    "_create_chunk_dtensor",
    "_create_chunk_sharded_tensor",
    "_get_param_to_fqns",
    "FSDP_PREFIX",
    "HOMOGENEOUS_ATTR_NAMES",
    "HYBRID_SHARDING_STRATEGIES",
    "_FSDP_USE_UNSAFE_SETATTR",
    "_apply_to_tensors",
    "_init_intra_and_inter_node_groups",
    "_replace_by_prefix",
    "assert_torch_refuses_cpu_offload",
    "torch_refuses_cpu_offload",
    "FSDP",
    "FULLY_SHARD_MISSING",
    "IMPL",
    "IMPLEMENTATION",
    "PUBLIC_NAMES",
    "REQUIRED",
    "MissingFromImplementation",
    "UnavailablePart",
    "Seams",
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
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "HandleShardingStrategy",
    "LocalOptimStateDictConfig",
    "HandleTrainingState",
    "LocalStateDictConfig",
    "MixedPrecision",
    "ModuleWrapPolicy",
    "OptimStateKeyType",
    "ShardedGradScaler",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictSettings",
    "StateDictType",
    "_Policy",
    "_get_handle_fqns_from_root",
    "_get_training_state",
    "_or_policy",
    "_validate_frozen_params",
    "_wrap_module_cls_individually",
    "always_wrap_policy",
    "clean_tensor_name",
    "current_device",
    "provides",
    "enable_wrap",
    "fully_shard",
    "handle_fqns",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]
