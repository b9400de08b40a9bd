"""The FSDP API under test: this project's ``fsdp``, ``torch.distributed.fsdp``, or any
module exposing the FSDP1 API, the FSDP2 API (``fully_shard``), or both.

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
this module fails at once, unless the implementation provides FSDP2 and no
``FullyShardedDataParallel`` (an FSDP2-only implementation): then every FSDP1 name
it lacks is a stand-in that skips the test using it, naming it.

The FSDP2 names (``fully_shard``, ``FSDPModule``, ``MixedPrecisionPolicy``,
``OffloadPolicy``, ``CPUOffloadPolicy``, ``register_fsdp_forward_method``,
``UnshardHandle``) are the implementation's when it provides FSDP2, else stand-ins
that skip (``FSDP2`` says which, and why: [Note: Which implementations provide
FSDP2] in ``fsdptest.fsdp2``). ``FSDP2_SEAMS`` patches its seams ([Note: FSDP2
seams]).

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
import os
import unittest
from types import ModuleType
from typing import Any

import torch

from fsdptest._constants import IMPL_ENV
from fsdptest.adapters import (
    PRIVATE_NAMES,
    Adapter,
    Seams,
    UnavailablePart,
    adapter_for,
    checked_private_names,
    unavailable,
)
from fsdptest.fsdp2 import FSDP2_NAMES, Fsdp2API, Fsdp2Seams
from fsdptest.implementations import Implementation, resolve
from harness import current_device

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

    def fsdp1_stand_ins(self) -> dict[str, Any]:
        """For an FSDP2-only implementation: a stand-in that skips for every FSDP1
        name it lacks (see the module note)."""
        return {
            name: unavailable(
                name,
                f"needs {name} of the FSDP1 API, which the FSDP under test "
                f"({self.impl.describe()}) does not have: it provides FSDP2 (fully_shard) only",
            )
            for name in self.looked_in
            if name not in self.found
        }

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
FSDP2: Fsdp2API = Fsdp2API(IMPLEMENTATION, importlib.import_module(IMPLEMENTATION.module))
FSDP2_SEAMS: Fsdp2Seams = Fsdp2Seams(IMPLEMENTATION)
_FSDP1_STAND_INS: dict[str, Any] = {}
if FSDP2.provided and "FullyShardedDataParallel" not in _PUBLIC.found:
    _FSDP1_STAND_INS = _PUBLIC.fsdp1_stand_ins()
else:
    _PUBLIC.require(REQUIRED)
globals().update(_PUBLIC.found | _FSDP1_STAND_INS)
globals().update(FSDP2.names())


def provides(name: str) -> bool:
    """Whether the implementation under test has the public name ``name``."""
    return name in _PUBLIC.found


def __getattr__(name: str) -> Any:
    if name in _PUBLIC.looked_in:
        raise _PUBLIC.missing(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


ADAPTER: Adapter = adapter_for(IMPLEMENTATION, _PUBLIC.found | _FSDP1_STAND_INS)
globals().update(ADAPTER.public_overrides())
globals().update(checked_private_names(ADAPTER))

FSDP = globals()["FullyShardedDataParallel"]


def torch_refuses_cpu_offload(cpu_offload: Any) -> bool:
    """The implementation on a CPU run asked to offload parameters where it cannot
    (torch's FSDP: see the module note)."""
    return ADAPTER.limitations.refuses_cpu_offload(cpu_offload)


def assert_torch_refuses_cpu_offload(
    case: unittest.TestCase, module: torch.nn.Module, in_features: int
) -> None:
    """Torch's own class, wrapping ``module`` (a module of ``in_features`` inputs)
    with parameter offloading on a CPU run, raises ``TORCH_CPU_OFFLOAD_ERROR`` by
    its first forward, where it pins the shard's memory (the facade would skip
    instead)."""
    ADAPTER.assert_refuses_cpu_offload(case, module, in_features)


__all__ = [
    *(name for names in PUBLIC_NAMES.values() for name in names),
    *PRIVATE_NAMES,
    *FSDP2_NAMES,
    "ADAPTER",
    "FSDP",
    "FSDP2",
    "FSDP2_SEAMS",
    "IMPL",
    "IMPLEMENTATION",
    "PUBLIC_NAMES",
    "REQUIRED",
    "MissingFromImplementation",
    "Seams",
    "UnavailablePart",
    "assert_torch_refuses_cpu_offload",
    "current_device",
    "provides",
    "torch_refuses_cpu_offload",
]
