"""What the FSDP2 suites share: the base class, tiny models, meshes, seeded
batches and the lockstep parity check against a replicated reference.

[Note: FSDP2 parity recipe]
The reference is a deep copy of the model taken before ``fully_shard`` (so built
from the same seed), replicated on every rank. Each rank feeds its own batch
(seeded by rank and step) to both models; after the backward the reference's
gradients are summed over the data-parallel ranks and divided by their number,
which is what DDP does (gloo has no ``AVG``). The losses must match on every
rank and step, and ``check_sharded_parity`` compares every parameter's and
gradient's local shard with the reference's tensor distributed with the same
mesh and placements, after the backward and after the optimizer step. The
comparison uses ``assertEqual``'s fp32 tolerances (rtol 1.3e-6, atol 1e-5):
the sharded gradient is summed in the reduce-scatter's order and divided before
or after the sum (FSDP2's pre- and post-divide factors), the reference's in the
all-reduce's order, so the last bits may differ. Optimizers alternate
``zero_grad(set_to_none=True/False)`` between steps. A bug that drops, doubles or
misroutes a gradient, skips an unshard or trains the wrong shard moves a loss or
a shard far outside these tolerances.

[Note: A low-precision reference]
The reference keeps fp32 parameters (its optimizer steps them) and a copy in the
compute dtype that runs forward and backward; its gradients are cast to the
reduce dtype, summed over ranks there, divided by the world size, and stored in
fp32 for the step, after which the low-precision copy is refreshed. The sharded
model's unsharded parameters are the same casts of the same fp32 values, so the
losses agree to the compute dtype's rounding; the gradients differ only in where
the division by W happens (before or after the sum, or in the reduction itself),
which rounds differently in bf16/fp16 at W = 3: gradients and parameters are
compared with the compute dtype's tolerance (``LOW_PRECISION_TOL``).

Models are tiny (widths of 4 to 16) and runs are short (2 or 3 steps): the
suites run in CI on two CPU cores, and a configuration is a subtest of one test.

[Note: CPU tensors on CUDA ranks]
A CUDA rank's default group is NCCL alone, as under upstream's ``FSDPTest``
(``DISTRIBUTED_BACKEND = "nccl"``), so a collective on CPU tensors there fails
("No backend type associated with device type cpu"), while on CPU ranks every
tensor is on the CPU and gloo takes them all. Offloading (``CPUOffloadPolicy``)
puts sharded parameters, gradients and state-dict values on the CPU of a CUDA
rank. So a comparison gathers such a DTensor on the rank's device
(``full_tensor``), and a test whose subject is a collective on offloaded values
(``clip_grad_norm_`` of offloaded gradients) shards over ``cpu_capable_mesh``,
whose group has a gloo backend for CPU tensors beside NCCL: what upstream's
tests that need one ask for (its checkpoint tests' ``backend`` property,
``"cpu:gloo,cuda:nccl"``) and what a user of offloading on GPUs must do. The
harness keeps its default group as upstream's: a device-qualified backend there
would make ``dist.get_backend()`` answer ``"cpu:gloo,cuda:nccl"`` instead of
``"nccl"`` for every test (code under test compares it with ``"nccl"``:
fsdp/_init.py, fsdp/sharded_grad_scaler.py) and give every group a test creates
a gloo backend too (docs/runs/gpu-runs.md, runs 82 and 84).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from fsdptest import FSDPTest
from fsdptest.api import FSDP2, FSDP2_SEAMS, FSDPModule, fully_shard
from harness import current_device
from models import MLP
from upstream.common_fsdp import check_sharded_parity

LR = 1e-2
STEPS = 2


@pytest.mark.fsdp2
class FSDP2Test(FSDPTest):
    """A distributed test of the FSDP2 API of the implementation under test (marked
    ``fsdp2``: skipped, naming what is missing, where the implementation lacks it)."""

    @property
    def device_type(self) -> str:
        return self.device.type

    def mesh(self) -> DeviceMesh:
        """A 1-D mesh over every rank."""
        return init_device_mesh(self.device_type, (self.world_size,))

    def cpu_capable_mesh(self) -> DeviceMesh:
        """A 1-D mesh over every rank whose group also runs collectives on CPU
        tensors (see [Note: CPU tensors on CUDA ranks])."""
        if self.device_type == "cpu":
            return self.mesh()
        backend = dist.get_default_backend_for_device(self.device_type)
        group = dist.new_group(backend=f"cpu:gloo,{self.device_type}:{backend}")
        return DeviceMesh.from_group(group, self.device_type)

    def hsdp_mesh(self, replicas: int) -> DeviceMesh:
        """A 2-D mesh of ``replicas`` replicas, each sharded over the rest of the ranks."""
        shape = (replicas, self.world_size // replicas)
        return init_device_mesh(self.device_type, shape, mesh_dim_names=("replicate", "shard"))


def hsdp_replica_counts(world_size: int) -> list[int]:
    """The replica counts whose 2-D mesh has this world size: every divisor, so a
    world size of 4 gives 1x4, 2x2 and 4x1, a prime one 1xW and Wx1."""
    return [r for r in range(1, world_size + 1) if world_size % r == 0]


def batch(rank: int, step: int, *shape: int, device: torch.device | None = None) -> torch.Tensor:
    """A batch seeded by rank and step (each rank trains on its own data)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(*shape, generator=generator).to(device or current_device())


def mlp_stack(dim: int = 8, depth: int = 3, seed: int = 0, **mlp_kwargs: Any) -> nn.Sequential:
    """``depth`` upstream ``MLP(dim)`` s in a ``Sequential``, on the rank's device."""
    torch.manual_seed(seed)
    return nn.Sequential(*(MLP(dim, **mlp_kwargs) for _ in range(depth))).to(current_device())


def shard_each(model: nn.Module, children: Iterable[nn.Module] | None = None, **kwargs: Any) -> Any:
    """``fully_shard`` on each child (or those given), then on the root."""
    for child in model.children() if children is None else children:
        fully_shard(child, **kwargs)
    return fully_shard(model, **kwargs)


def average_gradients(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """The mean of every rank's gradients, as DDP computes it (see [Note: FSDP2
    parity recipe]), in one all-reduce of the gradients laid end to end."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(dist.get_world_size(group))
    for grad, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        grad.copy_(part.view_as(grad))


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective, on the rank's device: see [Note:
    CPU tensors on CUDA ranks]), or the tensor itself."""
    if not isinstance(value, DTensor):
        return value
    return value.to(current_device()).full_tensor()


class Lockstep:
    """A sharded model and its replicated reference trained in lockstep (see
    [Note: FSDP2 parity recipe])."""

    case: FSDPTest
    model: nn.Module
    reference: nn.Module
    optims: tuple[torch.optim.Optimizer, torch.optim.Optimizer]
    group: dist.ProcessGroup | None
    loss_fn: Callable[[torch.Tensor], torch.Tensor]

    def __init__(
        self,
        case: FSDPTest,
        model: nn.Module,
        reference: nn.Module,
        *,
        optim: Callable[..., torch.optim.Optimizer] = torch.optim.SGD,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.case = case
        self.model = model
        self.reference = reference
        self.optims = (optim(model.parameters(), lr=LR), optim(reference.parameters(), lr=LR))
        self.group = group
        self.loss_fn = lambda out: out.sum()

    def backward(self, x: torch.Tensor, check: bool = True) -> None:
        """One forward and backward of both; the reference's gradients averaged."""
        losses = [self.loss_fn(m(x)) for m in (self.model, self.reference)]
        for loss in losses:
            loss.backward()
        average_gradients(self.reference, self.group)
        if check:
            self.case.assertEqual(losses[0], losses[1], msg="loss")
            check_sharded_parity(self.case, self.reference, self.model)

    def step(self, step: int) -> None:
        for optim in self.optims:
            optim.step()
            optim.zero_grad(set_to_none=step % 2 == 0)

    def train(self, steps: int, shape: Sequence[int]) -> None:
        """``steps`` steps, each rank on its own batch of ``shape``; checked every step."""
        for step in range(steps):
            self.backward(batch(self.case.rank, step, *shape))
            self.step(step)
            check_sharded_parity(self.case, self.reference, self.model)


def lockstep(
    case: FSDPTest,
    build: Callable[[], nn.Module],
    shard: Callable[[nn.Module], object],
    **kwargs: Any,
) -> Lockstep:
    """``build()``'s model sharded by ``shard`` beside a deep copy of it."""
    model = build()
    reference = copy.deepcopy(model)
    shard(model)
    return Lockstep(case, model, reference, **kwargs)


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules ``fully_shard`` was applied to, in ``modules()`` order."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def sharded_local_numel(model: nn.Module) -> int:
    return sum(p.to_local().numel() for p in model.parameters() if isinstance(p, DTensor))


def assert_all_dtensors(case: FSDPTest, tensors: Iterable[torch.Tensor], what: str) -> None:
    for i, t in enumerate(tensors):
        case.assertIsInstance(t, DTensor, f"{what}[{i}]")


COLLECTIVE_SEAMS: dict[str, tuple[str, int]] = {
    "all_gather": ("input", 1),
    "reduce_scatter": ("input", 1),
    "all_reduce": ("tensor", 0),
}
"""Each collective seam's input: its keyword, and its position when passed positionally."""


class SeamCall(NamedTuple):
    seam: str
    dtype: torch.dtype
    numel: int
    group_size: int


class CollectiveLog:
    """The all-gathers, reduce-scatters and all-reduces of the FSDP under test, in
    order, seen through its FSDP2 seams (the patches upstream's tests use)."""

    calls: list[SeamCall | str]

    def __init__(self, seams: Iterable[str] = tuple(COLLECTIVE_SEAMS)) -> None:
        self.calls = []
        self._seams = tuple(seams)
        self._stack = contextlib.ExitStack()

    def count(self, seam: str) -> int:
        return len(self.of(seam))

    def of(self, seam: str) -> list[SeamCall]:
        return [c for c in self.calls if isinstance(c, SeamCall) and c.seam == seam]

    def mark(self, event: str) -> None:
        """Notes a point of the program between the collectives."""
        self.calls.append(event)

    def _recording(self, seam: str) -> Callable[..., Any]:
        original = FSDP2_SEAMS.original(seam)
        keyword, position = COLLECTIVE_SEAMS[seam]

        def record(*args: Any, **kwargs: Any) -> Any:
            tensor = kwargs[keyword] if keyword in kwargs else args[position]
            group = kwargs.get("group")
            size = dist.get_world_size(group) if group is not None else dist.get_world_size()
            self.calls.append(SeamCall(seam, tensor.dtype, tensor.numel(), size))
            return original(*args, **kwargs)

        return record

    def __enter__(self) -> CollectiveLog:
        for seam in self._seams:
            self._stack.enter_context(FSDP2_SEAMS.patch(seam, self._recording(seam)))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()


LOW_PRECISION_TOL: dict[torch.dtype, dict[str, float]] = {
    # assert_close's own tolerances for these dtypes, applied to the fp32 tensors
    # derived from them (see [Note: A low-precision reference]).
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-5},
    torch.float16: {"rtol": 1e-3, "atol": 1e-5},
    torch.float32: {"rtol": 1.3e-6, "atol": 1e-5},
}


class LowPrecisionReference:
    """See [Note: A low-precision reference]."""

    def __init__(
        self, model: nn.Module, param_dtype: torch.dtype, reduce_dtype: torch.dtype
    ) -> None:
        self.full = model
        self.low = copy.deepcopy(model).to(param_dtype)
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.optim = torch.optim.SGD(self.full.parameters(), lr=LR)

    def backward(self, x: torch.Tensor) -> torch.Tensor:
        loss = self.low(x.to(self.param_dtype)).sum()
        loss.backward()
        for full, low in zip(self.full.parameters(), self.low.parameters(), strict=True):
            grad = low.grad.to(self.reduce_dtype)
            dist.all_reduce(grad)
            full.grad = (grad / dist.get_world_size()).to(full.dtype)
            low.grad = None
        return loss

    def step(self) -> None:
        self.optim.step()
        self.optim.zero_grad()
        with torch.no_grad():
            for full, low in zip(self.full.parameters(), self.low.parameters(), strict=True):
                low.copy_(full)


def assert_sharded_close(
    case: FSDP2Test, reference: nn.Module, model: nn.Module, dtype: torch.dtype
) -> None:
    """Each local shard (and gradient) of ``model`` equals the reference's part,
    within ``dtype``'s tolerance."""
    tol = LOW_PRECISION_TOL[dtype]
    for (name, ref), (_, ours) in zip(
        reference.named_parameters(), model.named_parameters(), strict=True
    ):
        case.assertIsInstance(ours, DTensor, name)
        case.assertEqual(ours.dtype, ref.dtype, msg=f"{name}: sharded parameters keep their dtype")
        case.assertEqual(full_tensor(ours), ref.detach(), msg=name, **tol)
        if ref.grad is not None:
            case.assertEqual(ours.grad.dtype, ref.dtype, msg=f"{name}.grad dtype")
            case.assertEqual(full_tensor(ours.grad), ref.grad, msg=f"{name}.grad", **tol)


def groups_with_parameters(model: nn.Module) -> int:
    """How many ``fully_shard`` calls in ``model`` manage at least one parameter (a
    parameter belongs to the innermost sharded module holding it)."""
    count = 0
    for module in fsdp_modules(model):
        inner = {
            id(p)
            for sub in module.modules()
            if sub is not module and isinstance(sub, FSDPModule)
            for p in sub.parameters()
        }
        count += any(id(p) not in inner for p in module.parameters())
    return count


def has_an_empty_shard(model: nn.Module, world_size: int) -> bool:
    """Whether some rank's shard of some parameter is empty (dim 0 chunked like
    ``torch.chunk``: 4 rows over 3 ranks are 2, 2, 0)."""
    return any(
        len(torch.empty(p.shape[0]).chunk(world_size)) < world_size for p in model.parameters()
    )


def skip_inf_norm_of_an_empty_shard(norm_type: float, model: nn.Module, world_size: int) -> None:
    """Skips, on every rank alike, an inf-norm clip that torch's FSDP2 cannot do
    (``FSDP2.known_defects.inf_norm_with_an_empty_shard``)."""
    if (
        norm_type == float("inf")
        and FSDP2.known_defects.inf_norm_with_an_empty_shard
        and has_an_empty_shard(model, world_size)
    ):
        pytest.skip(
            "clip_grad_norm_(norm_type=inf) of torch's FSDP2 raises on a rank whose shard is "
            "empty (linalg.vector_norm has no inf norm of an empty tensor) while the others "
            "wait in the reduction: a known defect, not asked"
        )


def skip_dataclass_outputs(reshard_after_forward: bool | int) -> None:
    """Skips, on every rank alike, a group resharded after forward whose outputs are in
    a dataclass, under a torch whose FSDP2 does not hook them for backward
    (``FSDP2.known_defects.dataclass_outputs_not_unsharded_in_backward``)."""
    if reshard_after_forward and FSDP2.known_defects.dataclass_outputs_not_unsharded_in_backward:
        pytest.skip(
            "torch's FSDP2 before 2.13 registers no pre-backward hook on outputs inside a "
            "dataclass: a group resharded after forward is not gathered again for its "
            "backward, which fails (storage of size 0): a known defect, not asked"
        )
