"""One adapter object per FSDP implementation under test: this project's, torch's,
or a user's module exposing the FSDP1 API.

Suites never ask which implementation runs; they ask the adapter what it needs
to know: its private parts (``private_names``: seams, handles, the flat
parameter's types), how to walk a module tree (``fsdp_states``,
``fsdp_handles``), what it cannot do (``limitations``) and what it is known to
get wrong (``known_defects``). ``fsdptest.api`` builds the adapter of the
implementation resolved from ``--fsdp-impl`` (``ADAPTER``) and exports its
private names. An adapter imports its implementation's modules by name, and
only when asked, so that a session imports the implementation under test only.

[Note: Limitations and known defects]
A *limitation* is something an implementation cannot do, or does differently
and by design; where it is documented the suites assert it (so that a change
shows up) or skip. A *known defect* is a wrong result of torch's FSDP found by
this project's suites; each is asserted where it shows, with the suite's note
saying how it shows. Ours and a foreign implementation have none of torch's: the
suites hold them to the specification. The CPU-run limitations depend on the
rank's device, so they are properties read when asked.
"""

from __future__ import annotations

import importlib
import inspect
import unittest
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from fsdptest._constants import TORCH_CPU_OFFLOAD_ERROR, TORCH_CPU_OFFLOAD_SKIP
from fsdptest.implementations import Implementation
from harness import current_device

PRIVATE_NAMES: tuple[str, ...] = (
    "COMPOSABLE_FULLY_SHARD_MISSING",
    "EXEC_ORDER_TRACER_MISSING",
    "FLAT_PARAM",
    "FSDP_PREFIX",
    "FlatParamHandle",
    "FlatParamShardMetadata",
    "FlatParameter",
    "HOMOGENEOUS_ATTR_NAMES",
    "HYBRID_SHARDING_STRATEGIES",
    "HandleShardingStrategy",
    "HandleTrainingState",
    "NO_RESHARD_AFTER_FORWARD_STRATEGIES",
    "SEAMS",
    "_ExecOrderTracer",
    "_FSDP_SKIP_WRITEBACK_CHECK",
    "_FSDP_USE_FULL_PREC_IN_EVAL",
    "_FSDP_USE_UNSAFE_SETATTR",
    "_all_gather_dtensor",
    "_apply_to_tensors",
    "_create_chunk_dtensor",
    "_create_chunk_sharded_tensor",
    "_get_handle_fqns_from_root",
    "_get_param_to_fqns",
    "_get_training_state",
    "_init_intra_and_inter_node_groups",
    "_replace_by_prefix",
    "_validate_frozen_params",
    "clean_tensor_name",
    "composable_fully_shard",
    "handle_fqns",
)
"""The private names every adapter supplies (the real part, or a stand-in that skips)."""

EXEC_ORDER_TRACER_MISSING = (
    "needs _ExecOrderTracer (torch.distributed.fsdp._trace_utils), torch's recorder of the "
    "module and parameter order of a torch.fx symbolic trace; no FSDP code path of torch's "
    "uses it any more and this project's FSDP has no counterpart (it records the execution "
    "order at run time: fsdp._exec_order)"
)


class UnavailablePart(unittest.SkipTest, AttributeError):
    """A private part of ours and torch's FSDP that the implementation under test
    does not have: the test using it is skipped."""


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


def unavailable(name: str, reason: str) -> Any:
    """A stand-in for the private part ``name``: using it skips the test with ``reason``."""
    return _Unavailable(name, (), {"reason": reason})


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


@dataclass(frozen=True)
class KnownDefects:
    """Wrong results of torch's FSDP that the suites assert (see [Note: Limitations
    and known defects]); each field names where it is asserted."""

    freed_views_outside_forward: bool = False
    """use_orig_params=False: module attributes stay views of freed storage
    (suites/test_apply_and_access.py)."""
    local_shards_require_grad: bool = False
    """A sharded state dict's local shards require grad (suites/test_fsdp_state_dict.py)."""
    one_element_shard_loses_accumulation: bool = False
    """suites/test_property_findings.py::test_one_element_flat_parameter_..."""
    cannot_summon_low_precision_grads: bool = False
    """summon_full_params(with_grads=True) under keep_low_precision_grads raises
    (suites/test_property_findings.py, fsdptest/properties/lockstep.py)."""
    tied_parameter_low_precision_gradients: bool = False
    """suites/test_property_findings.py::test_tied_parameter_with_low_precision_gradients."""
    local_state_dict_keeps_flat_param_key: bool = False
    """LOCAL_STATE_DICT with use_orig_params=True is saved under ``_flat_param``
    and that key is rejected on load (suites/test_property_findings.py,
    suites/test_state_dict_options.py, tests/fsdp/test_fsdp_features.py)."""
    keeps_frozen_units_unsharded: bool = False
    """A frozen unit under SHARD_GRAD_OP keeps its parameters unsharded after
    backward (suites/test_property_findings.py, fsdptest/properties/lockstep.py)."""
    frozen_outer_unit_loses_parameters: bool = False
    """suites/test_property_findings.py::test_frozen_first_unit_keeps_..._no_shard."""
    two_norm_after_inf_norm_clip: bool = False
    """suites/test_property_findings.py::test_two_norm_after_an_inf_norm_clip_..."""
    hybrid_local_state_dict_on_shard_groups: bool = False
    """suites/test_property_findings.py::test_local_state_dict_of_hybrid_shard_groups."""
    drops_second_forward_grad_under_mixed_precision: bool = False
    """Only the first forward's AccumulateGrad node is hooked (suites/test_regressions.py)."""
    one_rank_shard_group_never_syncs_replicas: bool = False
    """A one-rank shard group becomes NO_SHARD over that group only
    (suites/test_hybrid_replicas.py, suites/test_grad_accumulation.py)."""
    aliases_orig_param_optim_states_on_cpu: bool = False
    """suites/test_fsdp_optim_state.py, [Note: Torch aliases the gathered states ...]."""
    refuses_sharded_load_across_meshes: bool = False
    """suites/test_fsdp_dtensor_state_dict.py."""
    hybrid_sharded_state_dicts_across_wrappings: bool = False
    """Refusals and wrong loads of suites/test_hsdp_dtensor_state_dict.py."""
    drops_inference_mode_prefetched_grads: bool = False
    """A unit forward-prefetched inside ``torch.inference_mode()`` gets no gradient
    in the backward that follows (suites/test_fsdp_freezing_weights.py)."""
    zero_grad_between_forward_and_backward_without_reshard: bool = False
    """``SHARD_GRAD_OP``/``_HYBRID_SHARD_ZERO2`` with ``use_orig_params``:
    ``optim.zero_grad()`` between forward and backward, and the third step's
    loss differs from DDP's (suites/test_fsdp_freezing_weights.py)."""
    prefetched_unit_without_backward_hides_params: bool = False
    """``NO_SHARD`` with ``use_orig_params`` and a backward prefetch: a unit whose
    output was detached (its backward never runs) is unsharded by the prefetch and
    keeps ``Tensor`` views, so its parameters vanish from ``parameters()``
    (suites/test_fsdp_freezing_weights.py)."""
    state_dict_type_context_kept_after_exception: bool = False
    """A ``state_dict_type`` context left by an exception leaves its settings in
    place (no ``finally``; suites/test_state_dict_type_context.py)."""
    tp_optim_state_shapes: bool = False
    """Optimizer state dicts of tensor-parallel parameters
    (suites/test_fsdp_tp_integration.py, its module note)."""
    unnamed_dtensor_parameter_error: bool = False
    """A DTensor parameter is refused deep inside flattening, unnamed
    (suites/test_fsdp_tp_integration.py)."""
    no_shard_offload_race_on_accelerator: bool = False
    """NO_SHARD with parameter offload and use_orig_params=True on accelerators:
    the device copy of a flat parameter is dropped with no record of the
    computation stream, so the allocator may hand it to the next copy while kernels
    still read it (pytorch/pytorch#118245, #178142; the cause in #194519): losses
    and gradients depend on the GPU's pace. Not assertable (a race); numeric checks
    of such units skip there (fsdptest.races, [Note: Skipping what torch races on])."""
    scaler_races_on_cpu_gradients: bool = False
    """ShardedGradScaler on an accelerator with CPU gradients: the scale and the
    found-inf flag reach the CPU by a non-blocking copy that the CPU kernel does not
    wait for, so a found inf can be overwritten by the late copy (ours: [Note:
    Unscaling gradients on another device] in fsdp/sharded_grad_scaler.py).
    suites/test_grad_scaler.py skips the affected check there."""
    local_state_dict_offload_on_accelerator: bool = False
    """LOCAL_STATE_DICT with offload_to_cpu=True raises on accelerator ranks
    (ShardedTensor.cpu() under no_grad; fsdptest.limitations,
    suites/test_state_dict_options.py)."""
    flatten_keeps_unwrapped_sharded_tensors: bool = False
    """flatten_sharded_optim_state_dict leaves states of parameters outside every
    unit as ShardedTensors (tests/fsdp/test_fsdp_features.py)."""
    local_state_dict_skips_writeback: bool = False
    """A LOCAL_STATE_DICT saved after ``p.data = ...`` holds the old data
    (suites/test_regressions.py::TestWriteback)."""
    drops_user_gradient_of_frozen_unit: bool = False
    """A user's gradient of a frozen unit's flat parameter is dropped by a
    backward (suites/test_regressions.py::TestWriteback)."""
    inf_norm_of_empty_user_gradient: bool = False
    """clip_grad_norm_(norm_type=inf) raises on a rank whose empty original
    parameter has a user's gradient (suites/test_clip_grad_norm.py)."""
    keeps_replaced_shape_of_no_shard_parameter: bool = False
    """NO_SHARD, use_orig_params: ``p.data`` of another shape stays shown, and a full
    state dict saves it in that shape (suites/test_regressions.py::TestWriteback)."""
    keeps_full_precision_eval_copy: bool = False
    """FSDP_USE_FULL_PREC_IN_EVAL with a param_dtype: a unit not resharded after
    forward keeps an eval forward's full-precision copy, and the next eval forward
    computes with it after an optimizer step
    (suites/test_mixed_precision.py::TestFSDPTrainEval)."""
    zero_grad_keeps_gradient_set_aside_by_no_sync: bool = False
    """zero_grad(set_to_none=True) after a backward under no_sync leaves the sharded
    gradient from before the window to the next synced backward
    (suites/test_regressions.py::TestGradientAccumulation)."""

    @classmethod
    def all_present(cls) -> KnownDefects:
        return cls(**{f.name: True for f in fields(cls)})


@dataclass(frozen=True)
class Limitations:
    """What an implementation cannot do, or does differently by design (see
    [Note: Limitations and known defects]); ``needs_accelerator`` marks those of a
    CPU-only run (fsdptest.limitations has torch's)."""

    needs_accelerator: bool = False
    """The CPU-run properties below hold only for such an implementation."""
    accumulation_outside_no_sync_with_offload: bool = False
    """Gradient accumulation outside no_sync() keeps only the newest gradient
    with CPU offload (torch's documented limitation)."""
    rebuilds_container_inputs: bool = False
    """Forward inputs in containers are rebuilt, so the caller's container is not
    mutated (suites/test_fsdp_input.py)."""
    optim_keys_need_numpy: bool = False
    """Optimizer state-dict keys go through object collectives, which unpickle
    through numpy."""
    syncs_cpu_module_states: bool = False
    """sync_module_states=True accepts a module on the CPU when the CPU is the
    compute device."""

    @property
    def on_cpu(self) -> bool:
        """Whether this run is CPU-only and the implementation needs an accelerator."""
        return self.needs_accelerator and current_device().type == "cpu"

    @property
    def cpu_offload_on_cpu(self) -> bool:
        """CPUOffload(offload_params=True) fails on this run (the shard is pinned)."""
        return self.on_cpu

    @property
    def offload_to_cpu_on_cpu(self) -> bool:
        """offload_to_cpu=True frees the storage it returns on this run."""
        return self.on_cpu

    @property
    def sync_module_states_on_cpu(self) -> bool:
        """sync_module_states=True refuses CPU modules on this run."""
        return self.on_cpu

    @property
    def hybrid_falls_back_on_cpu(self) -> bool:
        """Hybrid strategies become NO_SHARD over the world on this run."""
        return self.on_cpu

    def refuses_cpu_offload(self, cpu_offload: Any) -> bool:
        """Whether ``cpu_offload`` asks to offload parameters where it fails."""
        offloads = cpu_offload is not None and cpu_offload.offload_params
        return self.cpu_offload_on_cpu and offloads


class Adapter:
    """What the suites ask of one implementation (see the module note)."""

    limitations: Limitations = Limitations()
    known_defects: KnownDefects = KnownDefects()
    is_project_fsdp: bool = False
    """Whether it is this project's ``fsdp`` (tests that patch its internals)."""
    has_golden_traces: bool = False
    """Whether the golden collective traces apply (ours and torch's issue the same)."""

    def __init__(self, implementation: Implementation, public: dict[str, Any]) -> None:
        self.implementation = implementation
        self.public = public

    def describe(self) -> str:
        return self.implementation.describe()

    def private_names(self) -> dict[str, Any]:
        """The names of ``PRIVATE_NAMES`` for this implementation."""
        raise NotImplementedError

    def public_overrides(self) -> dict[str, Any]:
        """Public names the facade replaces (torch's wrapper on CPU runs)."""
        return {}

    def fsdp_states(self, module: nn.Module) -> list[Any]:
        """The FSDP states in the tree rooted at ``module``, in ``modules()`` order."""
        fsdp_class = self.public["FullyShardedDataParallel"]
        return [m for m in module.modules() if isinstance(m, fsdp_class)]

    def fsdp_handles(self, module: nn.Module) -> list[Any]:
        """The flat-parameter handles of the units in the tree rooted at ``module``."""
        raise unittest.SkipTest(
            "needs the flat-parameter handles of each unit, private to this project's and "
            f"torch's FSDP, which the FSDP under test ({self.describe()}) does not have"
        )

    def assert_refuses_cpu_offload(
        self, case: unittest.TestCase, module: nn.Module, in_features: int
    ) -> None:
        raise AssertionError(f"{self.describe()} is not known to refuse offloading on a CPU run")

    def _unavailable(self, name: str) -> Any:
        return unavailable(
            name,
            f"needs {name}, a private part of this project's and torch's FSDP that the FSDP "
            f"under test ({self.describe()}) does not have",
        )


class LocalAdapter(Adapter):
    """This project's ``fsdp``."""

    limitations = Limitations(syncs_cpu_module_states=True)
    is_project_fsdp = True
    has_golden_traces = True

    def private_names(self) -> dict[str, Any]:
        names = _looked_up(_LOCAL_PRIVATE)
        return names | {
            "composable_fully_shard": importlib.import_module("fsdp._composable").fully_shard,
            "COMPOSABLE_FULLY_SHARD_MISSING": "",
            "EXEC_ORDER_TRACER_MISSING": EXEC_ORDER_TRACER_MISSING,
            "_ExecOrderTracer": unavailable("_ExecOrderTracer", EXEC_ORDER_TRACER_MISSING),
            "SEAMS": _LOCAL_SEAMS,
            "handle_fqns": lambda handle: handle.fqns,
            "_get_training_state": lambda handle: handle.training_state,
            "_get_handle_fqns_from_root": _local_handle_fqns_from_root,
        }

    def fsdp_states(self, module: nn.Module) -> list[Any]:
        fsdp_class = self.public["FullyShardedDataParallel"]
        return [
            owner if isinstance(owner, fsdp_class) else state
            for owner, state in _local_units(module)
        ]

    def fsdp_handles(self, module: nn.Module) -> list[Any]:
        return [state.handle for _, state in _local_units(module) if state.handle is not None]


_LOCAL_PRIVATE = {
    "fsdp._common": (
        "_FSDP_SKIP_WRITEBACK_CHECK _FSDP_USE_FULL_PREC_IN_EVAL _FSDP_USE_UNSAFE_SETATTR "
        "FLAT_PARAM FSDP_PREFIX HYBRID_SHARDING_STRATEGIES NO_RESHARD_AFTER_FORWARD_STRATEGIES "
        "HandleTrainingState clean_tensor_name"
    ),
    "fsdp._flat_param": (
        "FlatParameter FlatParamHandle FlatParamShardMetadata HandleShardingStrategy"
    ),
    "fsdp._init": "_init_intra_and_inter_node_groups",
    "fsdp._state_dict.optim_keys": "_get_param_to_fqns",
    "fsdp._runtime": "HOMOGENEOUS_ATTR_NAMES",
    "fsdp._shard_utils": "_all_gather_dtensor _create_chunk_dtensor _create_chunk_sharded_tensor",
    "fsdp._utils": "_apply_to_tensors _replace_by_prefix",
    "fsdp.wrap": "_validate_frozen_params",
}
"""Where ours keeps each private name, by module."""

_LOCAL_SEAMS = Seams(
    register_pre_backward_hooks="fsdp._runtime.FSDPState._register_pre_backward_hooks",
    register_post_backward_hook="fsdp._runtime.FSDPState._register_post_backward_hook",
    reshard="fsdp._flat_param.FlatParamHandle.reshard",
    post_backward_reshard="fsdp._runtime.FSDPState._post_backward_reshard",
    get_handle_to_prefetch="fsdp._runtime.FSDPState._get_handle_to_prefetch",
)


def _local_handle_fqns_from_root(state: Any, handle: Any) -> list[str] | None:
    """torch's ``_common_utils._get_handle_fqns_from_root``: the names of the
    handle's original parameters as seen from the root, None for no handle."""
    return None if handle is None else state.root.exec_order.fqns[handle]


def _local_units(module: nn.Module) -> list[tuple[nn.Module, Any]]:
    """(owner, state) of every unit of ours under ``module`` (itself included), once each."""
    registry = importlib.import_module("fsdp._registry")
    units: list[tuple[nn.Module, Any]] = []
    seen: set[int] = set()
    for submodule in module.modules():
        state = registry.state_of(submodule)
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            units.append((submodule, state))
    return units


_TORCH_PRIVATE = {
    "torch.distributed.fsdp._common_utils": (
        "FSDP_PREFIX _get_handle_fqns_from_root _get_param_to_fqns clean_tensor_name"
    ),
    "torch.distributed.fsdp._flat_param": (
        "_FSDP_SKIP_WRITEBACK_CHECK _FSDP_USE_FULL_PREC_IN_EVAL _FSDP_USE_UNSAFE_SETATTR "
        "FlatParameter FlatParamHandle FlatParamShardMetadata HandleShardingStrategy "
        "HandleTrainingState"
    ),
    "torch.distributed.fsdp._init_utils": (
        "HYBRID_SHARDING_STRATEGIES NO_RESHARD_AFTER_FORWARD_STRATEGIES "
        "_init_intra_and_inter_node_groups"
    ),
    "torch.distributed.fsdp._runtime_utils": "HOMOGENEOUS_ATTR_NAMES _get_training_state",
    "torch.distributed.fsdp._shard_utils": (
        "_all_gather_dtensor _create_chunk_dtensor _create_chunk_sharded_tensor"
    ),
    "torch.distributed.fsdp._trace_utils": "_ExecOrderTracer",
    "torch.distributed.fsdp._wrap_utils": "_validate_frozen_params",
    "torch.distributed.fsdp.fully_sharded_data_parallel": "FLAT_PARAM",
    "torch.distributed.utils": "_apply_to_tensors _replace_by_prefix",
}
"""Where torch keeps each private name, by module."""

_TORCH_RUNTIME = "torch.distributed.fsdp._runtime_utils"
TORCH_SEAMS = Seams(
    register_pre_backward_hooks=f"{_TORCH_RUNTIME}._register_pre_backward_hooks",
    register_post_backward_hook=f"{_TORCH_RUNTIME}._register_post_backward_hook",
    reshard=f"{_TORCH_RUNTIME}._reshard",
    post_backward_reshard=f"{_TORCH_RUNTIME}._post_backward_reshard",
    get_handle_to_prefetch=f"{_TORCH_RUNTIME}._get_handle_to_prefetch",
)
"""Torch's runtime functions of each role: the names upstream's tests patch
(``upstream._runtime_bridge`` points them at another implementation's)."""


class TorchAdapter(Adapter):
    """``torch.distributed.fsdp``, the oracle (see [Note: Running torch's FSDP on
    CPU] in fsdptest.api)."""

    limitations = Limitations(
        needs_accelerator=True,
        accumulation_outside_no_sync_with_offload=True,
        rebuilds_container_inputs=True,
        optim_keys_need_numpy=True,
    )
    known_defects = KnownDefects.all_present()
    has_golden_traces = True

    def private_names(self) -> dict[str, Any]:
        names = _looked_up(_TORCH_PRIVATE)
        return names | {
            "composable_fully_shard": None,
            "COMPOSABLE_FULLY_SHARD_MISSING": (
                "torch.distributed.fsdp no longer has the composable fully_shard(module, "
                "policy=...) of FSDP1 (torch.distributed._composable.fully_shard is FSDP2, "
                "another API)"
            ),
            "EXEC_ORDER_TRACER_MISSING": EXEC_ORDER_TRACER_MISSING,
            "SEAMS": TORCH_SEAMS,
            "handle_fqns": lambda handle: tuple(handle.flat_param._fqns),
        }

    def public_overrides(self) -> dict[str, Any]:
        return {"FullyShardedDataParallel": _torch_fsdp_on_the_rank_device(self.oracle_class())}

    @staticmethod
    def oracle_class() -> type:
        """Torch's own ``FullyShardedDataParallel``."""
        return importlib.import_module("torch.distributed.fsdp").FullyShardedDataParallel

    def fsdp_states(self, module: nn.Module) -> list[Any]:
        traversal = importlib.import_module("torch.distributed.fsdp._traversal_utils")
        return list(traversal._get_fsdp_states(module))

    def fsdp_handles(self, module: nn.Module) -> list[Any]:
        traversal = importlib.import_module("torch.distributed.fsdp._traversal_utils")
        return list(traversal._get_fsdp_handles(module))

    def assert_refuses_cpu_offload(
        self, case: unittest.TestCase, module: nn.Module, in_features: int
    ) -> None:
        cpu_offload = self.public["CPUOffload"](offload_params=True)
        with case.assertRaisesRegex(RuntimeError, TORCH_CPU_OFFLOAD_ERROR):
            model = self.oracle_class()(
                module, device_id=torch.device("cpu"), cpu_offload=cpu_offload
            )
            param = next(module.parameters())
            model(torch.zeros(1, in_features, dtype=param.dtype)).sum().backward()


def _torch_fsdp_on_the_rank_device(torch_fsdp: type) -> type:
    """Torch's FSDP, given the rank's device on CPU runs; ``isinstance`` accepts
    every torch FSDP instance (see [Note: Running torch's FSDP on CPU])."""
    signature = inspect.signature(torch_fsdp.__init__)

    class _AcceptsEveryTorchFSDP(type):
        def __instancecheck__(cls, obj: object) -> bool:
            return isinstance(obj, torch_fsdp)

        def __subclasscheck__(cls, sub: type) -> bool:
            return issubclass(sub, torch_fsdp)

    class FullyShardedDataParallel(torch_fsdp, metaclass=_AcceptsEveryTorchFSDP):  # type: ignore[misc,valid-type]
        """Torch's FSDP, given the rank's device on CPU runs."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if current_device().type == "cpu":
                bound = signature.bind_partial(self, *args, **kwargs).arguments
                offload = bound.get("cpu_offload")
                if offload is not None and offload.offload_params:
                    raise unittest.SkipTest(TORCH_CPU_OFFLOAD_SKIP)
                if bound.get("device_id") is None:
                    kwargs["device_id"] = torch.device("cpu")
            super().__init__(*args, **kwargs)

    return FullyShardedDataParallel


class ForeignAdapter(Adapter):
    """A user's module exposing the FSDP1 API: the plain private names fall back
    to torch's names and conventions, the rest are stand-ins that skip."""

    def private_names(self) -> dict[str, Any]:
        strategy = self.public["ShardingStrategy"]
        module = importlib.import_module(self.implementation.module)
        names = {
            "clean_tensor_name": getattr(module, "clean_tensor_name", _without_wrapper_prefixes),
            "NO_RESHARD_AFTER_FORWARD_STRATEGIES": _members(
                strategy, "SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2"
            ),
            "HYBRID_SHARDING_STRATEGIES": _members(strategy, "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"),
            "_FSDP_USE_FULL_PREC_IN_EVAL": "FSDP_USE_FULL_PREC_IN_EVAL",
            "_FSDP_SKIP_WRITEBACK_CHECK": "FSDP_SKIP_WRITEBACK_CHECK",
            "_FSDP_USE_UNSAFE_SETATTR": "FSDP_USE_UNSAFE_SETATTR",
            "FLAT_PARAM": "_flat_param",
            "FSDP_PREFIX": "_fsdp_wrapped_module.",
            "composable_fully_shard": None,
            "COMPOSABLE_FULLY_SHARD_MISSING": (
                "the composable fully_shard(module, policy=...) of FSDP1 is this project's; "
                f"the FSDP under test ({self.describe()}) is tested through its wrapper class"
            ),
            "EXEC_ORDER_TRACER_MISSING": EXEC_ORDER_TRACER_MISSING,
            "SEAMS": self._unavailable("SEAMS (the runtime functions tests patch)"),
        }
        missing = [name for name in PRIVATE_NAMES if name not in names]
        return names | {name: self._unavailable(name) for name in missing}


def _without_wrapper_prefixes(tensor_name: str) -> str:
    """torch's ``clean_tensor_name``: the name without FSDP's and activation
    checkpointing's wrapper prefixes."""
    for prefix in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        tensor_name = tensor_name.replace(prefix, "")
    return tensor_name


def _members(enum: Any, *names: str) -> tuple[Any, ...]:
    return tuple(getattr(enum, name) for name in names if hasattr(enum, name))


def _looked_up(places: dict[str, str]) -> dict[str, Any]:
    """The names listed by module in ``places``, read off those modules."""
    found: dict[str, Any] = {}
    for module_name, names in places.items():
        module = importlib.import_module(module_name)
        found |= {name: getattr(module, name) for name in names.split()}
    return found


_ADAPTERS: dict[str, type[Adapter]] = {"local": LocalAdapter, "torch": TorchAdapter}


def adapter_for(implementation: Implementation, public: dict[str, Any]) -> Adapter:
    """The adapter of ``implementation``, whose public names are ``public``."""
    adapter = _ADAPTERS.get(implementation.kind, ForeignAdapter)(implementation, public)
    return adapter


def checked_private_names(adapter: Adapter) -> dict[str, Any]:
    """``adapter.private_names()``, checked to be exactly ``PRIVATE_NAMES``."""
    names = adapter.private_names()
    if set(names) != set(PRIVATE_NAMES):
        raise AssertionError(
            f"{type(adapter).__name__} supplies {sorted(set(names) ^ set(PRIVATE_NAMES))} "
            "unlike PRIVATE_NAMES"
        )
    return names
