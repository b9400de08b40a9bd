"""``torch.testing._internal.distributed._tensor.common_dtensor`` for this harness:
``DTensorTestBase``, ``with_comms``, ``skip_if_lt_x_gpu`` and the helpers and
models upstream's FSDP files import from it.

[Note: DTensor tests on pooled ranks]
Upstream's ``DTensorTestBase`` is a ``MultiProcessTestCase``: it spawns
``world_size`` processes for every test, and ``with_comms`` initialises the
default process group before the test and destroys it after. Here the class
is a ``DistributedTest`` on the harness's pooled ranks (reports, subtests, hang
stacks and isolation as for every test), whose default group is up before the
test starts: ``with_comms`` checks that the group is the one the test expects
and runs it, and the harness destroys the groups the test (or a subtest)
created, device meshes' included. ``init_pg`` and ``destroy_pg`` keep
upstream's names for tests that call them.

``world_size`` is ``NUM_DEVICES``, 4 as upstream's on a machine without two
GPUs, whatever the machine: CPU runs and GPU runs check the same
configuration (with fewer than four GPUs the ranks run on the CPU under
``--device auto``). A class may set its own. ``device_type`` is the ranks'
device type and ``build_device_mesh()`` a 1-D mesh over the world on it.

Not provided: the op-testing helpers (``DTensorConverter``, ``_test_op``),
the ``LocalTensor`` variants (``LocalDTensorTestBase``, ...),
``DTensorOpTestBase`` (threads) and the transformer models
(``Transformer``, ``ModelArgs``): upstream's DTensor op tests, not its FSDP
files, use them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast, overload

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from harness import current_device_type
from models import MLPModule, MLPStacked, RMSNormPython
from upstream.common_distributed import (
    TEST_SKIPS,
    MultiProcContinuousTest,
    MultiProcessTestCase,
    run_subtests,
    skip_if_lt_x_gpu,
)

NUM_DEVICES = 4
"""The ranks of a ``DTensorTestBase`` (see [Note: DTensor tests on pooled ranks])."""

TestFunc = Callable[..., object]
T = TypeVar("T")


def __getattr__(name: str) -> Any:
    """``DEVICE_TYPE`` and ``PG_BACKEND`` are the ranks' (in the pytest process:
    ``cuda``/``nccl`` when CUDA is available), computed when read."""
    if name == "DEVICE_TYPE":
        return current_device_type()
    if name == "PG_BACKEND":
        return "nccl" if current_device_type() == "cuda" else "gloo"
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def skip_unless_torch_gpu(method: T) -> T:
    """Upstream skips unless there are ``NUM_DEVICES`` GPUs; here: the test needs
    ``NUM_DEVICES`` ranks (see ``upstream.common_distributed.skip_if_lt_x_gpu``)."""
    return cast(T, skip_if_lt_x_gpu(NUM_DEVICES)(cast(TestFunc, method)))


class DTensorTestMixin:
    """What upstream's DTensor test classes share: the device type, a 1-D mesh
    over the world, a per-rank seed, and ``_test_op_on_dtensor``."""

    world_size: int
    rank: int

    @property
    def is_local_tensor_enabled(self) -> bool:
        return False

    @property
    def device_type(self) -> str:
        """The ranks' device type: ``cuda`` under NCCL, else ``cpu``."""
        return current_device_type()

    def build_device_mesh(self) -> DeviceMesh:
        return init_device_mesh(self.device_type, (self.world_size,))

    def init_manual_seed_for_rank(self) -> None:
        torch.manual_seed(self.rank)

    def _test_op_on_dtensor(self, op_call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """``op_call`` on DTensors equals ``op_call`` on their full tensors."""
        flat_args, spec = tree_flatten(args)
        full_args = tree_unflatten(
            [a.full_tensor().detach().clone() if isinstance(a, DTensor) else a for a in flat_args],
            spec,
        )
        full_kwargs = {
            k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in kwargs.items()
        }
        expected, _ = tree_flatten(op_call(*full_args, **full_kwargs))
        actual, _ = tree_flatten(op_call(*args, **kwargs))
        cast(Any, self).assertEqual(expected, [d.full_tensor() for d in actual])


class DTensorTestBase(DTensorTestMixin, MultiProcessTestCase):
    """Upstream's ``DTensorTestBase`` on pooled ranks (see [Note: DTensor tests on
    pooled ranks])."""

    @property
    def world_size(self) -> int:
        return NUM_DEVICES

    def init_pg(self, eager_init: bool = False, backend: str | None = None) -> None:
        """The default group is up already; ``backend``, if given, must name the
        ranks' backend (``"gloo"`` on CPU ranks, ``"nccl"`` on CUDA ranks)."""
        actual = dist.get_backend()
        if backend is not None and actual not in backend.replace(",", ":").split(":"):
            raise RuntimeError(
                f"the test asks for backend {backend!r}, but its ranks run {actual!r} "
                f"(on {self.device_type})"
            )
        if dist.get_world_size() != self.world_size:
            raise RuntimeError(
                f"the test expects {self.world_size} ranks, but runs on {dist.get_world_size()}"
            )

    def destroy_pg(self, device_id: int | None = None) -> None:
        """The harness keeps the default group for the pool and destroys the
        groups the test created when it ends."""


class DTensorContinuousTestBase(DTensorTestBase, MultiProcContinuousTest):
    """Upstream's variant that reuses its processes: every test here does."""


@overload
def with_comms(eager_init: TestFunc) -> TestFunc: ...


@overload
def with_comms(
    eager_init: bool = False, backend: str | None = None
) -> Callable[[TestFunc], TestFunc]: ...


def with_comms(
    eager_init: TestFunc | bool = False, backend: str | None = None
) -> TestFunc | Callable[[TestFunc], TestFunc]:
    """``@with_comms``, ``@with_comms()`` or ``@with_comms(eager_init=..., backend=...)``:
    ``self.init_pg(...)`` (when the class has it), then the test."""

    def decorator(func: TestFunc, eager: bool = False) -> TestFunc:
        @functools.wraps(func)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> object:
            init_pg = getattr(self, "init_pg", None)
            if init_pg is not None:
                init_pg(eager, backend)
            return func(self, *args, **kwargs)

        return wrapper

    if callable(eager_init):
        return decorator(eager_init)
    return functools.partial(decorator, eager=bool(eager_init))


__all__ = [
    "NUM_DEVICES",
    "TEST_SKIPS",
    "DTensorContinuousTestBase",
    "DTensorTestBase",
    "DTensorTestMixin",
    "MLPModule",
    "MLPStacked",
    "RMSNormPython",
    "run_subtests",
    "skip_if_lt_x_gpu",
    "skip_unless_torch_gpu",
    "with_comms",
]
