"""A flat parameter's gradient, within one backward and across several.

[Note: Gradients across synced and no_sync backwards]
Between iterations a flat parameter's gradient is one of two things. After a
synced backward it is the reduced shard (on the CPU when offloading), which the
optimizer steps on. After a ``no_sync()`` backward it is the unsharded,
unreduced local sum, which the next backward keeps accumulating into; a
reduced shard from before the window is then set aside and added to the result
of the next synced reduction. So any order of synced and ``no_sync``
microbatches sums like DDP. Clearing the gradient inside a window (``.grad =
None``, ``zero_grad(set_to_none=True)``) clears the shard set aside too. A unit
that no gradient reached in a backward gets back what was set aside.

[Note: The reduce lifecycle]
Within one backward: ``prepare_for_backward`` sets aside a gradient autograd
cannot accumulate into; autograd accumulates the unsharded gradient;
``take_unsharded`` hands it to the runtime, which reduces it (on the reduce
stream) and calls ``set_reduced`` with the result; at the end of backward
``finish_backward`` exposes the reduced shard (plus what was set aside) as
``flat_param.grad``. Each step is checked against ``ReduceState``.

[Note: Accumulating in full precision]
A reduced gradient is added to the one set aside in the flat parameter's own
(full-precision) dtype, and the sum is cast to the gradient dtype once. With
``keep_low_precision_grads`` both addends are low precision (the one set
aside in ``param_dtype``, the reduced one in ``reduce_dtype``); summing them in
one of those dtypes rounds twice (the reduced gradient to the set-aside
gradient's dtype, then the sum), an ulp off torch's in some elements, and a
batch norm over nearly constant inputs turns such an ulp into a different
output a few steps later. Torch casts the gradient set aside to the local
shard's dtype before the backward (``FlatParamHandle.prepare_gradient_for_backward``:
"FSDP should cast back to the full precision dtype so that FSDP can accumulate
in that dtype") and the reduced one in ``_accumulate_sharded_grad``.

[Note: A shard the size of the whole]
A sharded gradient is usually told from an unsharded one by its shape. Not
when the shard has the unsharded numel: a one-element flat parameter sharded
over several ranks (each shard holds one element, padding on all ranks but
one), or any flat parameter of a one-rank shard group. There the shard
``finish_backward`` exposed is recognised by identity (``zero_grad`` without
``set_to_none`` zeroes it in place); shape alone would take it for an
unsharded gradient, let autograd accumulate the next backward's local
gradient into it and reduce the sum again, which adds each rank's shard (the
reduced gradient on one rank, zeros of padding on the others) into the new
average: the property search found exactly that in torch's FSDP, which decides
by shape alone (``FlatParamHandle.prepare_gradient_for_backward``).
"""

from __future__ import annotations

import enum
import weakref
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fsdp import _comm
from fsdp._layout import ShardLayout
from fsdp._storage import FlatParameter, same_storage


class ReduceState(enum.Enum):
    """Where this backward's gradient is (see [Note: The reduce lifecycle])."""

    IDLE = enum.auto()  # no reduction in this backward (yet)
    TAKEN = enum.auto()  # the unsharded gradient was handed out for reduction
    REDUCED = enum.auto()  # the reduced shard waits for the end of backward


class SummonedGrad(NamedTuple):
    """The gathered gradient inside ``summon_full_params(with_grads=True)``:
    None when no rank has a gradient."""

    unsharded: Tensor | None


def assign_grad(tensor: Tensor, grad: Tensor | None) -> None:
    """Sets ``tensor.grad``, also when the gradient's dtype, shape or device
    differs (low-precision gradients; an unsharded gradient on the device for a
    parameter offloaded to the CPU under ``no_sync``): ``.grad`` only accepts a
    matching tensor, ``.grad.data`` anything."""
    try:
        tensor.grad = grad  # checks the metadata itself, faster than three reads here
        return
    except RuntimeError:
        if grad is None:
            raise
    tensor.grad = None
    tensor.grad = torch.empty_like(tensor)
    tensor.grad.data = grad


class FlatParamGrads:
    """The gradient bookkeeping of one flat parameter (see the module notes)."""

    flat_param: FlatParameter
    shard: ShardLayout
    offload_params: bool
    state: ReduceState
    _saved_shard: Tensor | None  # a reduced gradient from an earlier backward
    _reduced: Tensor | None  # this backward's reduced shard
    # The shard finish_backward last made flat_param.grad, held weakly: a cleared
    # gradient's memory must go with the user's last reference.
    _exposed: weakref.ref[Tensor] | None
    _summoned: SummonedGrad | None

    def __init__(self, flat_param: FlatParameter, shard: ShardLayout, offload_params: bool) -> None:
        self.flat_param = flat_param
        self.shard = shard
        self.offload_params = offload_params
        self.state = ReduceState.IDLE
        self._saved_shard = None
        self._reduced = None
        self._exposed = None
        self._summoned = None

    def init_buffers(self, grad_dtype: torch.dtype, device: torch.device) -> None:
        """With parameter offloading, the CPU buffer the optimizer's gradient lives in."""
        if not self.offload_params:
            return
        cpu_grad = torch.zeros_like(self.flat_param._local_shard, dtype=grad_dtype)
        self.flat_param._cpu_grad = cpu_grad.pin_memory() if device.type != "cpu" else cpu_grad

    def sharded(self) -> Tensor | None:
        """The sharded gradient, or None (none yet, or an unsharded one under no_sync)."""
        grad = self.flat_param.grad
        if grad is None or grad.shape != self.flat_param._local_shard.shape:
            return None
        if self.shard.sharded and self.shard.shard_numel == self.shard.layout.total_numel:
            return grad if self._is_exposed(grad) else None  # [Note: A shard the size of the whole]
        return grad

    def _is_exposed(self, grad: Tensor) -> bool:
        exposed = self._exposed
        return exposed is not None and exposed() is grad

    def unsharded_pending(self) -> Tensor | None:
        """The unsharded gradient accumulated under no_sync, if any."""
        grad = self.flat_param.grad
        return grad if grad is not None and self.sharded() is None else None

    def clear(self) -> None:
        """The user cleared every gradient (``zero_grad(set_to_none=True)``)."""
        self.flat_param.grad = None
        self._saved_shard = None
        self._exposed = None

    # -- one backward -------------------------------------------------------------------

    def prepare_for_backward(self) -> None:
        """A gradient that autograd cannot accumulate into (sharded, on the CPU,
        another dtype) is set aside; an unsharded one (``no_sync``) stays."""
        flat_param = self.flat_param
        grad = flat_param.grad
        if grad is None:
            self._saved_shard = None  # cleared inside a no_sync window: all of it
            return
        data = flat_param.data
        same = grad.shape == data.shape and grad.dtype == data.dtype and grad.device == data.device
        if same and not (self.shard.sharded and self._is_exposed(grad)):
            return
        assert self._saved_shard is None, "two gradients set aside"
        self._saved_shard = grad.detach()
        flat_param.grad = None
        self._exposed = None

    @property
    def set_aside(self) -> Tensor | None:
        """The gradient from an earlier backward that ``set_reduced`` adds, if any."""
        return self._saved_shard

    def take_unsharded(self) -> Tensor | None:
        """Removes the gradient autograd accumulated, for reduction."""
        assert self.state is ReduceState.IDLE, self.state
        grad = self.flat_param.grad
        self.flat_param.grad = None
        if grad is not None:
            self.state = ReduceState.TAKEN
        return grad

    def set_reduced(self, reduced: Tensor, grad_dtype: torch.dtype, full: torch.dtype) -> None:
        """Takes the reduced shard (on the device, in the reduce dtype), adds what
        was set aside (in ``full``, see [Note: Accumulating in full precision])
        and casts for the optimizer."""
        assert self.state is ReduceState.TAKEN, self.state
        saved, self._saved_shard = self._saved_shard, None
        if saved is not None:
            saved = saved.to(reduced.device, full, non_blocking=True)
            reduced = reduced.to(full) + saved
        self._reduced = reduced.to(grad_dtype)
        self.state = ReduceState.REDUCED

    def finish_backward(self, synced: bool) -> bool:
        """Exposes the sharded gradient as ``flat_param.grad`` (the CPU copy when
        offloading). Without gradient sync the unsharded gradient stays exposed
        and a shard set aside before stays aside. Returns whether a freshly
        reduced gradient was exposed."""
        flat_param = self.flat_param
        grad, self._reduced = self._reduced, None
        fresh = grad is not None
        if fresh:
            self._saved_shard = None
        elif synced or flat_param.grad is None:
            grad, self._saved_shard = self._saved_shard, None
        if grad is not None:
            if self.offload_params and grad.device.type != "cpu":
                flat_param._cpu_grad.copy_(grad)
                grad = flat_param._cpu_grad
            assign_grad(flat_param, grad)
            self._exposed = weakref.ref(flat_param.grad)
        self.state = ReduceState.IDLE
        return fresh

    # -- summon_full_params(with_grads=True) -----------------------------------------------

    def gather(self, dtype: torch.dtype, device: torch.device, group: Any) -> Tensor | None:
        """Every rank's shard gathered into the unsharded gradient (sharded
        strategies): None when no rank has one; a rank without one sends zeros."""
        sharded = self.sharded()
        # An int32 count, as torch's (the collective traces agree).
        missing = torch.tensor([int(sharded is None)], dtype=torch.int32, device=device)
        _comm.all_reduce(missing, group)
        if int(missing.item()) == group.size():
            return None
        # Every rank gathers in the gradients' dtype (low precision with
        # keep_low_precision_grads), also one that has none and sends zeros.
        if sharded is None:
            sharded = torch.zeros_like(self.flat_param._local_shard, dtype=dtype)
        local = sharded.to(device, dtype).contiguous()
        unsharded = torch.empty(self.shard.padded_numel, dtype=local.dtype, device=local.device)
        _comm.all_gather(unsharded, local, group)
        return unsharded[: self.shard.layout.total_numel]

    @property
    def summoned(self) -> SummonedGrad | None:
        return self._summoned

    def summon(self, unsharded: Tensor | None) -> None:
        self._summoned = SummonedGrad(unsharded)

    def unsummon(self, writeback: bool) -> None:
        """Ends a with_grads summon; ``writeback`` copies this rank's part of the
        (possibly edited) gathered gradient into the sharded gradient."""
        summoned, self._summoned = self._summoned, None
        sharded = self.sharded()
        if (
            writeback
            and summoned is not None
            and summoned.unsharded is not None
            and sharded is not None
        ):
            part = self.shard.own_part(summoned.unsharded)
            if not same_storage(part, sharded):
                with torch.no_grad():
                    sharded[: part.numel()].copy_(part)
