"""One FSDP2 program run by one implementation on the ranks, observed (rank side).

[Note: What an FSDP2 run observes]
A run is a list of ``Observation`` s, each tagged with the index of the call it
follows (-1: ``fully_shard`` itself): every parameter's placements, global
shape and dtype after ``fully_shard``; the loss of each ``train``; each
parameter's local shard and local gradient after every call that may change
them; the all-gathers, reduce-scatters and all-reduces each call made (seen at
the implementation's FSDP2 seams: dtype, element count, group size, in order);
whether ``unshard`` returned a handle and what the module's parameters are after
``unshard``/``reshard`` (a parameter registered unsharded, after ``unshard``
or a forward or backward that did not reshard, is observed whole, as
``unsharded:<name>``, without its gradient: the optimizer steps the sharded
one; a parameter left on the smaller post-forward mesh of an ``int``
``reshard_after_forward``, which torch leaves there when its backward never
ran, is observed as ``post_forward:<name>``); every entry of each state dict (its type, placements,
dtype, shape and local values); the total norm of ``clip_grad_norm_``; and the
exception that stopped the run (its type and first line). Two implementations'
runs must be equal (``fsdptest.fsdp2search.check``); a run's numbers must also
equal the replicated reference's (``fsdptest.fsdp2search.replica``).
"""

from __future__ import annotations

import contextlib
import importlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from fsdptest.fsdp2 import Fsdp2API, Fsdp2Seams
from fsdptest.fsdp2search.nets import batch, build
from fsdptest.fsdp2search.program import MIXED_PRECISION, NETS, Op, Program
from fsdptest.implementations import resolve

LR = 1e-2
COLLECTIVE_SEAMS = ("all_gather", "reduce_scatter", "all_reduce")


class Observation(NamedTuple):
    op: int
    key: str
    value: Any


class Fsdp2Runtime:
    """An implementation's FSDP2 names and seams, by its ``--fsdp-impl`` name."""

    def __init__(self, name: str) -> None:
        implementation = resolve(name)
        module = importlib.import_module(implementation.module)
        self.name = name
        self.api = Fsdp2API(implementation, module)
        self.names = self.api.names()
        self.seams = Fsdp2Seams(implementation)

    def __getattr__(self, name: str) -> Any:
        names = self.__dict__.get("names", {})
        if name in names:
            return names[name]
        raise AttributeError(name)


def mesh_of(program: Program, device_type: str) -> DeviceMesh:
    if program.replicas == 1:
        return init_device_mesh(device_type, (program.world_size,))
    return init_device_mesh(
        device_type, (program.replicas, program.shard_size), mesh_dim_names=("replicate", "shard")
    )


def dtype_of(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def local(tensor: torch.Tensor) -> torch.Tensor:
    value = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return value.detach().to("cpu", copy=True)


def make_optimizer(program: Program, params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    if program.optimizer == "adam":
        return torch.optim.Adam(params, lr=LR)
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def frozen_candidate(program: Program) -> str | None:
    """The submodule whose parameters the program freezes (its first candidate)."""
    return NETS[program.net][0] if program.frozen else None


def freeze(program: Program, model: nn.Module) -> None:
    name = frozen_candidate(program)
    if name is not None:
        model.get_submodule(name).requires_grad_(False)


class ProgramRun:
    """Runs ``program`` with ``runtime`` 's FSDP2 and returns what it observed."""

    def __init__(
        self, program: Program, runtime: Fsdp2Runtime, mesh: DeviceMesh, device: torch.device
    ) -> None:
        self.program = program
        self.runtime = runtime
        self.mesh = mesh
        self.device = device
        self.rank = dist.get_rank()
        self.seen: list[Observation] = []
        self.op = -1
        self.batches = 0
        self.model = build(program.net, program.seed, device)
        freeze(program, self.model)
        self.optim: torch.optim.Optimizer | None = None

    def run(self) -> list[Observation]:
        try:
            with self._recorded():
                self._shard()
            self.optim = make_optimizer(self.program, self.model.parameters())
            self._parameters(structure=True)
            for index, op in enumerate(self.program.ops):
                self.op = index
                with self._recorded():
                    getattr(self, f"_op_{op.name}")(*op.args)
        except Exception as error:  # the observed end of the run (see the module note)
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            self.note("error", f"{type(error).__name__}: {first}")
        return self.seen

    def note(self, key: str, value: Any) -> None:
        self.seen.append(Observation(self.op, key, value))

    # -- construction ------------------------------------------------------

    def _policy_kwargs(self, root: bool) -> dict[str, Any]:
        """The policies of one ``fully_shard`` call; ``output_dtype`` only at the root
        (an inner module's output in it would meet the next layer's ``param_dtype``)."""
        param, reduce, output, cast = MIXED_PRECISION[self.program.mixed_precision]
        mp = self.runtime.MixedPrecisionPolicy(
            param_dtype=dtype_of(param),
            reduce_dtype=dtype_of(reduce),
            output_dtype=dtype_of(output) if root else None,
            cast_forward_inputs=cast,
        )
        offload = (
            self.runtime.CPUOffloadPolicy(pin_memory=False)
            if self.program.offload
            else self.runtime.OffloadPolicy()
        )
        return {"mesh": self.mesh, "mp_policy": mp, "offload_policy": offload}

    def _shard(self) -> None:
        names = (*self.program.sharded, "")
        for name, reshard in zip(names, self.program.reshard_after_forward, strict=True):
            module = self.model.get_submodule(name) if name else self.model
            kwargs = self._policy_kwargs(root=not name)
            self.runtime.fully_shard(module, reshard_after_forward=reshard, **kwargs)

    def fsdp_modules(self) -> list[Any]:
        """The sharded submodules in ``modules()`` order, the root left out."""
        kind = self.runtime.FSDPModule
        return [m for m in self.model.modules() if isinstance(m, kind) and m is not self.model]

    # -- observing ---------------------------------------------------------

    @contextlib.contextmanager
    def _recorded(self) -> Iterator[None]:
        """The call's collectives at the implementation's seams, noted after it."""
        calls: list[tuple[str, str, int, int]] = []
        with contextlib.ExitStack() as stack:
            for seam in COLLECTIVE_SEAMS:
                stack.enter_context(self.runtime.seams.patch(seam, self._recorder(seam, calls)))
            try:
                yield
            finally:
                self.note("collectives", tuple(calls))

    def _recorder(self, seam: str, calls: list[tuple[str, str, int, int]]) -> Callable[..., Any]:
        original = self.runtime.seams.original(seam)
        keyword, position = ("tensor", 0) if seam == "all_reduce" else ("input", 1)

        def record(*args: Any, **kwargs: Any) -> Any:
            tensor = kwargs[keyword] if keyword in kwargs else args[position]
            group = kwargs.get("group")
            size = dist.get_world_size(group)
            calls.append((seam, str(tensor.dtype), tensor.numel(), size))
            return original(*args, **kwargs)

        return record

    def _parameters(self, structure: bool = False, grads: bool = True) -> None:
        for name, param in self.model.named_parameters():
            if structure:
                placements = str(getattr(param, "placements", None))
                self.note(f"layout:{name}", (placements, tuple(param.shape), str(param.dtype)))
            if not isinstance(param, DTensor):  # unsharded (see the module note)
                self.note(f"unsharded:{name}", local(param))
                continue
            if param.device_mesh.mesh.shape != self.mesh.mesh.shape:  # the post-forward mesh
                self.note(f"post_forward:{name}", local(param))
                continue
            self.note(f"param:{name}", local(param))
            if grads:
                grad = param.grad
                self.note(f"grad:{name}", None if grad is None else local(grad))

    def _entries(self, what: str, state: dict[str, Any]) -> None:
        for key, value in state.items():
            if isinstance(value, dict):
                self._entries(f"{what}.{key}", value)
            elif isinstance(value, torch.Tensor):
                placements = str(getattr(value, "placements", None))
                kind = (type(value).__name__, placements, str(value.dtype), tuple(value.shape))
                self.note(f"{what}.{key}:type", kind)
                self.note(f"{what}.{key}", local(value))
            elif isinstance(value, list):
                self.note(f"{what}.{key}", repr(value))
            else:
                self.note(f"{what}.{key}", value)

    # -- the calls ---------------------------------------------------------

    def _batch(self) -> torch.Tensor:
        self.batches += 1
        return batch(self.rank, self.batches, self.device)

    def _op_train(
        self, sync: bool, last: bool | None, reshard_after_backward: bool | None, forwards: int
    ) -> None:
        root: Any = self.model
        root.set_requires_gradient_sync(sync)
        if last is not None:
            root.set_is_last_backward(last)
        if reshard_after_backward is not None:
            root.set_reshard_after_backward(reshard_after_backward)
        loss = sum(self.model(self._batch()).float().sum() for _ in range(forwards))
        assert isinstance(loss, torch.Tensor)
        loss.backward()
        self.note("loss", loss.detach().cpu())
        self._parameters()

    def _op_step(self, set_to_none: bool) -> None:
        assert self.optim is not None
        self.optim.step()
        self.optim.zero_grad(set_to_none=set_to_none)
        self._parameters()

    def _op_zero_grad(self, set_to_none: bool) -> None:
        assert self.optim is not None
        self.optim.zero_grad(set_to_none=set_to_none)
        self._parameters(grads=True)

    def _op_eval(self) -> None:
        with torch.no_grad():
            out = self.model(self._batch())
        self.note("eval", out.float().sum().cpu())

    def _registered(self) -> None:
        self.note(
            "registered",
            tuple((n, type(p).__name__, tuple(p.shape)) for n, p in self.model.named_parameters()),
        )

    def _op_unshard(self, async_op: bool) -> None:
        handle = self.model.unshard(async_op=async_op)  # type: ignore[operator]
        self.note("handle", handle is not None)
        if handle is not None:
            handle.wait()
        self._registered()

    def _op_reshard(self) -> None:
        for module in (*self.fsdp_modules(), self.model):
            module.reshard()
        self._registered()

    def _op_prefetch(self, forward: bool, backward: bool) -> None:
        modules = self.fsdp_modules()
        for i, module in enumerate(modules):
            if forward and i + 1 < len(modules):
                module.set_modules_to_forward_prefetch([modules[i + 1]])
            if backward and i > 0:
                module.set_modules_to_backward_prefetch([modules[i - 1]])

    def _op_set_reshard_after_forward(self, value: bool) -> None:
        self.model.set_reshard_after_forward(value)  # type: ignore[operator]

    def _op_state_dict(self) -> None:
        self._entries("state_dict", self.model.state_dict())

    def _op_load_state_dict(self) -> None:
        shifted = {
            k: v.detach() + 0.25 if isinstance(v, DTensor) else v
            for k, v in self.model.state_dict().items()
        }
        self.note("load", str(self.model.load_state_dict(shifted)))
        self._parameters(grads=False)

    def _op_get_state_dicts(self, full: bool, cpu_offload: bool) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=full, cpu_offload=cpu_offload)
        self._entries("model", get_model_state_dict(self.model, options=options))
        self._entries("optim", get_optimizer_state_dict(self.model, self.optim, options=options))
        self._parameters()

    def _op_dcp_round_trip(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_state_dict,
            set_state_dict,
        )

        with shared_directory() as path:
            model_sd, optim_sd = get_state_dict(self.model, self.optim)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
            with torch.no_grad():
                for param in self.model.parameters():
                    param.add_(1.0)
            model_sd, optim_sd = get_state_dict(self.model, self.optim)
            loaded = {"model": model_sd, "optim": optim_sd}
            dcp.load(loaded, checkpoint_id=path)
            set_state_dict(
                self.model,
                self.optim,
                model_state_dict=loaded["model"],
                optim_state_dict=loaded["optim"],
            )
        self._parameters()

    def _op_clip_grad_norm(self, max_norm: float, norm_type: float) -> None:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, norm_type)
        full = norm.full_tensor() if isinstance(norm, DTensor) else norm
        self.note("norm", full.detach().cpu())
        self._parameters()


@contextlib.contextmanager
def shared_directory() -> Iterator[str]:
    """A fresh directory every rank names alike (rank 0 makes it), removed after."""
    made = [tempfile.mkdtemp(prefix="fsdp2-dcp-") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(made, src=0)
    try:
        yield made[0]
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(made[0], ignore_errors=True)


def describe_op(program: Program, index: int) -> str:
    if index < 0:
        return "fully_shard"
    op: Op = program.ops[index]
    return f"op {index} ({op.describe()})"
