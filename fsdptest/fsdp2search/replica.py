"""The replicated reference of an FSDP2 program (rank side): what DDP computes
for the same calls, as the numbers a sharded run must show.

[Note: The FSDP2 programs' reference]
Every rank holds the whole model (built from the program's seed) and a copy in
the mixed-precision policy's ``param_dtype`` that runs forward and backward
(buffers keep their dtype, as ``fully_shard`` leaves them). After each backward
the copy's gradients are added, in the reduce dtype (the policy's
``reduce_dtype``, else its ``param_dtype``, else fp32), to a pending sum; a
backward with gradient sync on all-reduces the pending sum over every rank
(the replicas of an HSDP mesh too), divides it by the world size and adds it,
in fp32, to the gradients the optimizer steps: what DDP's ``no_sync`` does, and
what FSDP2 does with ``set_requires_gradient_sync``. The optimizer, clipping,
the state dicts' side effect on an optimizer with no state yet (torch's
``get_optimizer_state_dict`` steps it once with zero gradients and a zero
learning rate), and ``load_state_dict`` of shifted values are mirrored; the
calls that only move or show parameters change nothing here. The observations
are the rank's part of each tensor: rows chunked over the shard group as
``torch.chunk`` splits them (``Shard(0)``), so they compare with a sharded
run's local shards without a collective.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdptest.fsdp2search.nets import batch, build
from fsdptest.fsdp2search.program import MIXED_PRECISION, Program
from fsdptest.fsdp2search.run import Observation, dtype_of, freeze, make_optimizer


def shard_part(tensor: torch.Tensor, shard_size: int, shard_rank: int) -> torch.Tensor:
    """The rows of ``tensor`` that ``Shard(0)`` gives shard rank ``shard_rank``."""
    value = tensor.detach()
    if value.dim() == 0:
        return value.to("cpu", copy=True)
    chunks = torch.chunk(value, shard_size, dim=0)
    if shard_rank < len(chunks):
        return chunks[shard_rank].to("cpu", copy=True)
    return value.new_empty((0, *value.shape[1:])).cpu()


class Replica:
    """Runs ``program`` 's calls on a replicated model (see the module note)."""

    def __init__(self, program: Program, device: torch.device) -> None:
        self.program = program
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.shard_rank = self.rank % program.shard_size
        param, reduce, output, cast = MIXED_PRECISION[program.mixed_precision]
        self.param_dtype = dtype_of(param)
        self.reduce_dtype = dtype_of(reduce) or self.param_dtype or torch.float32
        self.output_dtype = dtype_of(output)
        self.cast_inputs = cast
        self.full = build(program.net, program.seed, device)
        freeze(program, self.full)
        self.low = self._low_copy()
        self.optim = make_optimizer(program, self.full.parameters())
        self.pending: dict[str, torch.Tensor] = {}
        self.seen: list[Observation] = []
        self.op = -1
        self.batches = 0

    def _low_copy(self) -> nn.Module:
        low = copy.deepcopy(self.full)
        if self.param_dtype is not None:
            for param in low.parameters():
                param.data = param.data.to(self.param_dtype)
        return low

    def _refresh(self) -> None:
        with torch.no_grad():
            for full, low in zip(self.full.parameters(), self.low.parameters(), strict=True):
                low.copy_(full)

    def run(self) -> list[Observation]:
        self._parameters(grads=False)
        for index, op in enumerate(self.program.ops):
            self.op = index
            handler = getattr(self, f"_op_{op.name}", None)
            if handler is not None:
                handler(*op.args)
        return self.seen

    def note(self, key: str, value: Any) -> None:
        self.seen.append(Observation(self.op, key, value))

    def _parameters(self, grads: bool = True) -> None:
        for name, param in self.full.named_parameters():
            self.note(f"param:{name}", shard_part(param, self.program.shard_size, self.shard_rank))
            if grads:
                grad = param.grad
                part = None if grad is None else shard_part(grad, *self._where())
                self.note(f"grad:{name}", part)

    def _where(self) -> tuple[int, int]:
        return self.program.shard_size, self.shard_rank

    def _forward(self) -> torch.Tensor:
        self.batches += 1
        x = batch(self.rank, self.batches, self.device)
        if self.cast_inputs and self.param_dtype is not None:
            x = x.to(self.param_dtype)
        out = self.low(x)
        return out if self.output_dtype is None else out.to(self.output_dtype)

    def _op_train(
        self, sync: bool, last: bool | None, reshard_after_backward: bool | None, forwards: int
    ) -> None:
        loss = sum(self._forward().float().sum() for _ in range(forwards))
        assert isinstance(loss, torch.Tensor)
        loss.backward()
        self.note("loss", loss.detach().cpu())
        for (name, _), low in zip(self.full.named_parameters(), self.low.parameters(), strict=True):
            if low.grad is not None:
                grad = low.grad.to(self.reduce_dtype)
                self.pending[name] = self.pending[name] + grad if name in self.pending else grad
                low.grad = None
        if sync:
            self._sync()
        self._parameters()

    def _sync(self) -> None:
        for name, full in self.full.named_parameters():
            if name not in self.pending:
                continue
            total = self.pending.pop(name).clone()
            dist.all_reduce(total)
            mean = (total / self.world_size).to(full.dtype)
            full.grad = mean if full.grad is None else full.grad + mean

    def _op_step(self, set_to_none: bool) -> None:
        self.optim.step()
        self.optim.zero_grad(set_to_none=set_to_none)
        self._refresh()
        self._parameters()

    def _op_zero_grad(self, set_to_none: bool) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)
        self._parameters()

    def _op_eval(self) -> None:
        with torch.no_grad():
            self.note("eval", self._forward().float().sum().cpu())

    def _op_load_state_dict(self) -> None:
        with torch.no_grad():
            for param in self.full.parameters():
                param.add_(0.25)
        self._refresh()
        self._parameters(grads=False)

    def _initialise_optimizer_state(self) -> None:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        get_optimizer_state_dict(self.full, self.optim)

    def _op_get_state_dicts(self, full: bool, cpu_offload: bool) -> None:
        self._initialise_optimizer_state()
        self._parameters()

    def _op_dcp_round_trip(self) -> None:
        self._initialise_optimizer_state()
        self._parameters()

    def _op_clip_grad_norm(self, max_norm: float, norm_type: float) -> None:
        norm = torch.nn.utils.clip_grad_norm_(self.full.parameters(), max_norm, norm_type)
        self.note("norm", norm.detach().cpu())
        self._parameters()
