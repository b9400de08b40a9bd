"""The flat parameter handle: one FSDP unit's parameters as one sharded tensor.

[Note: What the handle is made of]
A handle composes four objects, one per domain noun, and owns the lifecycle
that orders them:

- ``FlatParamLayout`` / ``ShardLayout`` (fsdp._layout): immutable; where each
  original parameter lies in the flat parameter and in this rank's shard.
- ``FlatParamStorage`` (fsdp._storage): the shard and the unsharded buffers
  that come and go, and which one ``flat_param.data`` is.
- ``OrigParamViews`` (fsdp._orig_params): what the module sees under its
  original parameter names, and the writeback of user changes.
- ``FlatParamGrads`` (fsdp._grads): the gradient within and across backwards.

The handle issues no collective: the runtime asks it for the all-gather input
and output, runs the collective through ``fsdp._comm``, then hands the result
back (``finish_unshard``); likewise for the gradient reduction.

[Note: The handle's lifecycle]
``training_state`` (torch's ``HandleTrainingState``) says what the handle does
right now; ``phase`` says how far this iteration got:

    IDLE --forward with grad--> AWAITING_BACKWARD --pre-backward--> IN_BACKWARD
         --post-backward--> BACKWARD_DONE --end of backward--> IDLE

Several forwards before one backward stay in ``AWAITING_BACKWARD``; a forward
without grad leaves the phase alone. Every transition is a method that checks
the state it starts from. An all-gather issued ahead of the unit's own use (a
prefetch) leaves the flat parameter sharded and the unshard's CUDA event with
the handle; the unit's own unshard then finds the data ready and waits on it.
``prefetched`` (torch's ``_prefetched``) says that such an unshard was issued
since the last reshard, so that the handle is not chosen for another one.

[Note: The post-backward hook's node]
Assigning ``flat_param.data`` a tensor of another device or dtype (unsharding
with CPU offload or parameter mixed precision) makes autograd start a new
``AccumulateGrad`` node for the flat parameter. With several forwards before
one backward, each forward's views then feed their own node, and each node
accumulates into the same ``.grad``. A hook on the tensor
(``register_post_accumulate_grad_hook``) would fire at the first node to finish,
resharding while an earlier forward's backward still needs the unsharded data.
The hook therefore goes on the node of the first forward of the iteration: its
backward runs last. If that forward's graph is never backpropagated, the
runtime's end-of-backward callback runs the post-backward step instead.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from fsdp._common import HandleTrainingState
from fsdp._dtensor_extensions import DTensorExtensions, ParamExtension
from fsdp._grads import FlatParamGrads, SummonedGrad
from fsdp._layout import (
    FlatParamLayout,
    FlatParamShardMetadata,
    ParamInfo,
    ShardLayout,
    ShardParamInfo,
    SharedParamInfo,
    aligned_numel,
    shard_metadata,
    shard_param_infos,
)
from fsdp._orig_params import OrigParamViews
from fsdp._storage import FlatParameter, FlatParamStorage

__all__ = [
    "FlatParamHandle",
    "FlatParamShardMetadata",
    "FlatParameter",
    "HandleShardingStrategy",
    "HandleTrainingState",
    "IterationPhase",
]


class HandleShardingStrategy(enum.Enum):
    FULL_SHARD = enum.auto()
    SHARD_GRAD_OP = enum.auto()
    NO_SHARD = enum.auto()
    HYBRID_SHARD = enum.auto()
    _HYBRID_SHARD_ZERO2 = enum.auto()

    def is_sharded(self) -> bool:
        return self is not HandleShardingStrategy.NO_SHARD


class IterationPhase(enum.Enum):
    """How far the current iteration got for this handle (see [Note: The
    handle's lifecycle])."""

    IDLE = enum.auto()
    AWAITING_BACKWARD = enum.auto()
    IN_BACKWARD = enum.auto()
    BACKWARD_DONE = enum.auto()


def _check_uniform(params: Sequence[nn.Parameter], use_orig_params: bool) -> None:
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise ValueError(
            f"Must flatten tensors with uniform dtype but got {sorted(map(str, dtypes))}"
        )
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ValueError(f"Must flatten tensors on the same device but got {devices}")
    if not use_orig_params and len({p.requires_grad for p in params}) != 1:
        raise ValueError(
            "Must flatten tensors with uniform `requires_grad` when `use_orig_params=False`"
        )


class FlatParamHandle:
    """One flat parameter: its layout, storage, views and gradient, and their
    lifecycle (see the module notes)."""

    flat_param: FlatParameter
    process_group: Any
    rank: int
    world_size: int
    device: torch.device
    layout: FlatParamLayout
    shard: ShardLayout
    storage: FlatParamStorage
    views: OrigParamViews
    grads: FlatParamGrads
    training_state: HandleTrainingState
    phase: IterationPhase
    prefetched: bool
    _sharding_strategy: HandleShardingStrategy
    _keep_low_precision_grads: bool
    _mp_reduce_dtype: torch.dtype | None
    has_optim_in_backward: bool
    _unshard_event: torch.cuda.Event | None
    # (the AccumulateGrad node or None, its hook's handle, the hook: see _weakly)
    _post_backward_hook: tuple[Any, RemovableHandle, Callable[[], None]] | None
    _fsdp_extension: DTensorExtensions | None
    _param_extensions: tuple[ParamExtension | None, ...]  # per original parameter

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        fully_sharded_module: nn.Module,
        device: torch.device,
        sharding_strategy: HandleShardingStrategy,
        offload_params: bool,
        mp_param_dtype: torch.dtype | None,
        mp_reduce_dtype: torch.dtype | None,
        keep_low_precision_grads: bool,
        process_group: Any,
        use_orig_params: bool,
        *,
        fsdp_extension: DTensorExtensions | None = None,
        use_unsafe_setattr: bool = False,
    ) -> None:
        params = list(params)
        if not params:
            raise ValueError(
                f"Cannot construct a {type(self).__name__} with an empty parameter list"
            )
        if fsdp_extension is not None:  # see [Note: Tensor-parallel parameters]
            params = fsdp_extension.localize(params, fully_sharded_module)
        _check_uniform(params, use_orig_params)
        self._fsdp_extension = fsdp_extension
        self.process_group = process_group
        self.rank = process_group.rank()
        self.world_size = process_group.size()
        self.device = device
        self._sharding_strategy = sharding_strategy
        self._keep_low_precision_grads = keep_low_precision_grads
        self._mp_reduce_dtype = mp_reduce_dtype
        align = aligned_numel(mp_param_dtype or params[0].dtype) if use_orig_params else None
        self.layout, ordered = FlatParamLayout.of(
            params, fully_sharded_module, align, self.world_size
        )
        self.shard = ShardLayout.of(
            self.layout, self.rank, self.world_size, sharding_strategy.is_sharded()
        )
        requires_grad = any(p.requires_grad for p in ordered)
        self.flat_param = FlatParameter(self.layout.flatten(ordered), requires_grad=requires_grad)
        self.storage = FlatParamStorage(
            self.flat_param, self.shard, device, offload_params, mp_param_dtype
        )
        self._param_extensions = tuple(
            None if fsdp_extension is None else fsdp_extension.extension_of(p) for p in ordered
        )
        self.views = OrigParamViews(
            self.layout,
            self.shard,
            ordered,
            use_orig_params,
            not use_unsafe_setattr,
            self._param_extensions,
        )
        self.grads = FlatParamGrads(self.flat_param, self.shard, offload_params)
        self.training_state = HandleTrainingState.IDLE
        self.phase = IterationPhase.IDLE
        self.has_optim_in_backward = False
        self.prefetched = False
        self._unshard_event = None
        self._post_backward_hook = None

    # -- what the handle is --------------------------------------------------------------

    @property
    def uses_sharded_strategy(self) -> bool:
        return self._sharding_strategy.is_sharded()

    @property
    def unpadded_numel(self) -> int:
        return self.layout.total_numel

    @property
    def padded_numel(self) -> int:
        return self.shard.padded_numel

    @property
    def shard_numel(self) -> int:
        return self.shard.shard_numel

    @property
    def fqns(self) -> tuple[str, ...]:
        return self.layout.fqns

    @property
    def _use_orig_params(self) -> bool:
        """torch's attribute name: whether the original parameters are kept."""
        return self.views.use_orig_params

    @property
    def _offload_params(self) -> bool:
        return self.storage.offload_params

    @property
    def _orig_param_dtype(self) -> torch.dtype:
        return self.storage.orig_dtype

    @property
    def _fwd_bwd_param_dtype(self) -> torch.dtype:
        """The dtype forward and backward compute in (torch's attribute name)."""
        return self.storage.param_dtype or self.storage.orig_dtype

    @property
    def _reduce_dtype(self) -> torch.dtype:
        """torch's attribute name: the dtype gradients are reduced in."""
        return self._mp_reduce_dtype or self._fwd_bwd_param_dtype

    @property
    def uses_param_mixed_precision(self) -> bool:
        return self.storage.uses_param_mixed_precision

    def param_infos(self) -> tuple[ParamInfo, ...]:
        return self.layout.param_infos

    def shared_param_infos(self) -> tuple[SharedParamInfo, ...]:
        return self.layout.shared_param_infos

    def orig_params(self) -> list[nn.Parameter]:
        return self.views.params

    def shard_metadata(self) -> FlatParamShardMetadata:
        """Read from ``flat_param._shard_param_infos``, as torch's (tests set it)."""
        return shard_metadata(self.layout, self.flat_param._shard_param_infos)

    def _get_shard_metadata(self, start: int, end: int) -> tuple[ShardParamInfo, ...]:
        """torch's name: where each parameter lies in the flat range ``[start, end]``."""
        return shard_param_infos(self.layout, start, end)

    @property
    def sharded_grad(self) -> Tensor | None:
        """The sharded gradient (torch's name), None when there is none."""
        return self.grads.sharded()

    def reduce_dtype(self) -> torch.dtype:
        """Gradients are reduced in ``reduce_dtype``, else ``param_dtype``, else
        the parameter's own dtype; in forced full precision always the latter."""
        if self.storage.force_full_precision:
            return self.storage.orig_dtype
        return self._reduce_dtype

    def grad_dtype(self) -> torch.dtype:
        """The dtype gradients have when the optimizer sees them: the parameter's
        own, except with ``keep_low_precision_grads``, where sharded strategies
        keep ``param_dtype`` and ``NO_SHARD`` the reduce dtype (torch's: its
        all-reduce runs in place on the gradient cast to the reduce dtype, which
        is then not cast back)."""
        if not self._keep_low_precision_grads:
            return self.storage.orig_dtype
        if not self.uses_sharded_strategy:
            return self.reduce_dtype()
        return self.storage.param_dtype or self.storage.orig_dtype

    # -- construction, moves and lazy initialisation ------------------------------------------

    def shard_in_place(self) -> None:
        """Keeps only this rank's shard; the original names show their resharded
        form (shard views, or placeholders)."""
        self.storage.shard_in_place()
        self.views.show_resharded(self.flat_param)

    def move_shard_to(self, device: torch.device) -> None:
        """Moves the local shard (parameter offloading keeps it on the CPU)."""
        self.storage.move_shard_to(device)
        self.views.show_resharded(self.flat_param)

    def deregister_orig_params(self) -> None:
        """Removes the original names from their modules (around ``module._apply``)."""
        self.views.release()

    def rebind_local_shard(self) -> None:
        """After ``module.to(...)`` moved or cast the flat parameter: the original
        names are shown again (``module._apply`` took them away meanwhile)."""
        if self.storage.is_unsharded():
            self._use_unsharded_views(as_params=True)  # inside summon_full_params
            return
        self.storage.rebind_local_shard()
        self.views.refresh_placeholders(self.flat_param.dtype, self.flat_param.device)
        self.views.show_resharded(self.flat_param)

    def lazy_init(self) -> None:
        """At the root's first forward (the user may have moved or cast the module
        since construction): binds the shard, allocates buffers, keeps changes
        the user made to original parameters before it."""
        self.flat_param._local_shard = self.flat_param.data
        self.writeback_orig_params(skip_check=False)
        self.storage.init_buffers()
        self.grads.init_buffers(self.grad_dtype(), self.device)
        if self._use_orig_params:
            self.views.show_resharded(self.flat_param)

    def sync_requires_grad(self) -> None:
        """``use_orig_params``: the flat parameter needs a gradient while any
        original parameter does (the user may freeze or unfreeze them at any time)."""
        if self._use_orig_params:
            self.flat_param.requires_grad_(any(p.requires_grad for p in self.views.params))

    # -- optimizers in backward ----------------------------------------------------------------

    def find_optimizers_in_backward(self) -> None:
        """``torch.distributed.optim._apply_optimizer_in_backward`` marks
        parameters with ``_in_backward_optimizers``; FSDP steps them right after
        their gradient is reduced (``use_orig_params=True`` only)."""
        if hasattr(self.flat_param, "_in_backward_optimizers"):
            raise RuntimeError(
                "FSDP optimizer in backward only supported with use_orig_params=True!"
            )
        self.has_optim_in_backward = any(
            hasattr(p, "_in_backward_optimizers") for p in self.views.params
        )

    def step_optimizers_in_backward(self) -> None:
        """The reduced gradient is exposed, each marked original parameter's
        optimizers step and free its gradient; the flat gradient goes once no
        original parameter has one."""
        self.grads.finish_backward(synced=True)
        self.views.fresh_grads()
        self._show_grads()
        for param in self.views.params:
            if param.grad is None:
                continue  # not on this rank's shard
            for optim in getattr(param, "_in_backward_optimizers", ()):
                optim.step()
                optim.zero_grad(set_to_none=True)
        if self.views.all_grads_cleared():
            self.grads.clear()

    # -- lifecycle ---------------------------------------------------------------------------

    def _expect(self, *states: HandleTrainingState) -> None:
        if self.training_state not in states:
            raise AssertionError(
                f"FlatParamHandle of {self.fqns[:2]}...: expected training state in "
                f"{[s.name for s in states]}, got {self.training_state.name}"
            )

    def recomputing_in_backward(self) -> bool:
        """A forward of this unit runs inside its own backward (activation
        checkpointing recomputes it): the unit is already unsharded for it."""
        return self.training_state is HandleTrainingState.BACKWARD_PRE

    def begin_forward(self, full_precision: bool) -> None:
        self._expect(HandleTrainingState.IDLE)
        self.training_state = HandleTrainingState.FORWARD
        self.storage.force_full_precision = full_precision

    def end_forward(self, awaits_backward: bool) -> None:
        self._expect(HandleTrainingState.FORWARD)
        self.training_state = HandleTrainingState.IDLE
        if awaits_backward:
            assert self.phase in (IterationPhase.IDLE, IterationPhase.AWAITING_BACKWARD), self.phase
            self.phase = IterationPhase.AWAITING_BACKWARD

    def awaits_backward(self) -> bool:
        """Forward ran with grad this iteration and its backward has not started."""
        return self.phase is IterationPhase.AWAITING_BACKWARD

    def begin_backward(self) -> bool:
        """The unit's pre-backward; returns False when it already ran (or the unit
        produced nothing that needs a gradient), so it runs once per iteration."""
        if self.phase is not IterationPhase.AWAITING_BACKWARD:
            return False
        self.phase = IterationPhase.IN_BACKWARD
        self.training_state = HandleTrainingState.BACKWARD_PRE
        return True

    def end_backward(self) -> None:
        """The unit's post-backward (its gradient is accumulated). Without a
        pre-backward first, the unit's outputs needed no gradient while its
        parameters got one through another path."""
        assert self.phase is not IterationPhase.BACKWARD_DONE, "post-backward ran twice"
        self.phase = IterationPhase.BACKWARD_DONE
        self.training_state = HandleTrainingState.BACKWARD_POST

    def backward_missed(self) -> bool:
        """Pre-backward ran but the hooked node never fired (its forward's graph
        was dropped): the end of backward must finish the unit."""
        return self.phase is IterationPhase.IN_BACKWARD

    def finish_iteration(self, synced: bool) -> None:
        """End of backward: the sharded gradient for the optimizer (see
        fsdp._grads), then back to idle."""
        fresh = self.grads.finish_backward(synced)
        if self._use_orig_params:
            if fresh:
                self.views.fresh_grads()
            self._show_grads()
        self.remove_post_backward_hook()
        self.training_state = HandleTrainingState.IDLE
        self.phase = IterationPhase.IDLE
        self.prefetched = False
        self.views.end_iteration()

    def begin_summon(self) -> None:
        self._expect(HandleTrainingState.IDLE)
        self.training_state = HandleTrainingState.SUMMON_FULL_PARAMS
        self.storage.force_full_precision = True

    def end_summon(self) -> None:
        self._expect(HandleTrainingState.SUMMON_FULL_PARAMS)
        self.training_state = HandleTrainingState.IDLE
        self.storage.force_full_precision = False

    def set_force_full_precision(self, enabled: bool) -> None:
        """Unshard in full precision (eval with full precision, prefetch of such a unit)."""
        self.storage.force_full_precision = enabled

    # -- unshard -----------------------------------------------------------------------------

    def is_unsharded(self) -> bool:
        return self.storage.is_unsharded()

    def ready_unsharded(self) -> Tensor | None:
        return self.storage.ready_unsharded()

    def unshard_input(self) -> Tensor:
        return self.storage.unshard_input()

    def unsharded_buffer(self) -> Tensor:
        return self.storage.unsharded_buffer()

    def finish_unshard(self, unsharded: Tensor) -> None:
        self.storage.finish_unshard(unsharded)

    def record_unshard(self, event: torch.cuda.Event | None) -> None:
        """The event after an all-gather issued for this handle (CUDA)."""
        self._unshard_event = event

    def take_unshard_event(self) -> torch.cuda.Event | None:
        event, self._unshard_event = self._unshard_event, None
        return event

    def pending_unshard_event(self) -> torch.cuda.Event | None:
        """The event of an unshard issued ahead of use, left for its own wait."""
        return self._unshard_event

    def unsharded_to_cpu(self) -> Tensor:
        return self.storage.unsharded_to_cpu()

    def holds_unsharded_buffers(self) -> bool:
        return bool(self.storage.unsharded_buffers())

    def low_precision_unsharded(self) -> Tensor | None:
        return self.storage.low_precision_unsharded()

    def free_unsharded(self) -> None:
        self.storage.free_unsharded()

    def buffers_freed_by_reshard(self, free_unsharded: bool) -> list[Tensor]:
        return self.storage.buffers_freed_by_reshard(free_unsharded)

    def _use_unsharded_views(self, as_params: bool) -> None:
        """Sets the original parameter names to views into the unsharded flat
        parameter: ``nn.Parameter`` s when ``as_params`` (summon_full_params,
        state dicts), plain ``Tensor`` views otherwise (forward and backward, so
        that autograd reaches the flat parameter). Tests patch this seam."""
        self.views.show_unsharded(self.flat_param, as_params, self.training_state)

    def reshard(self, free_unsharded: bool, use_sharded_views: bool = True) -> None:
        """Points the flat parameter back at the local shard. ``free_unsharded``
        frees the unsharded storage (the runtime made sure no pending kernel
        reads it); otherwise it is kept for the next unshard. Without
        ``use_sharded_views`` (use_orig_params, no-reshard strategies after
        forward) the original parameters keep forward's views."""
        forward_data = self.storage.reshard(free_unsharded)
        self.prefetched = False
        if self._use_orig_params and not use_sharded_views:
            self.views.keep_forward_views(forward_data)
        elif self._use_orig_params or free_unsharded or not self.uses_sharded_strategy:
            self.views.show_resharded(self.flat_param)

    def writeback_unsharded(self) -> None:
        self.storage.writeback_unsharded()

    def load_local_shard(self, tensor: Tensor) -> None:
        """A saved local shard (LOCAL_STATE_DICT) becomes this rank's shard; an
        unsharded copy kept since forward is stale afterwards and is freed."""
        self.storage.load_local_shard(tensor)
        if not self.is_unsharded():
            self.storage.free_unsharded()
        self.views.show_resharded(self.flat_param)

    def show_resharded_params(self) -> None:
        self.views.show_resharded(self.flat_param)

    # -- writeback of user changes (use_orig_params) ----------------------------------------------

    def writeback_orig_params(self, skip_check: bool) -> None:
        """Copies user changes of original parameters and their gradients into the
        flat parameter (see [Note: Original parameters (use_orig_params=True)]).
        An unsharded copy kept since forward is stale afterwards and is freed."""
        if not self._use_orig_params:
            return
        if self.flat_param.grad is not None and not self.is_unsharded():
            if self.views.all_grads_cleared():
                self.grads.clear()  # zero_grad(set_to_none=True) on the originals
                self.views.forget_grads()
        if skip_check:
            return
        written = self.views.writeback(self.flat_param, self.grads)
        if self.is_unsharded() or not (written.params or written.grads):
            return
        if written.params:
            # The kept unsharded copy is stale. Only parameters: a gradient
            # edit, which may happen on some ranks only, must not decide
            # whether the next unshard all-gathers (the ranks would diverge).
            self.storage.free_unsharded()
            self.views.show_resharded(self.flat_param)
        self._show_grads()

    # -- gradients ---------------------------------------------------------------------------------

    def prepare_gradient_for_backward(self) -> None:
        self.grads.prepare_for_backward()

    def take_unsharded_grad(self) -> Tensor | None:
        return self.grads.take_unsharded()

    def grad_set_aside(self) -> Tensor | None:
        return self.grads.set_aside

    def set_reduced_grad(self, reduced: Tensor) -> None:
        self.grads.set_reduced(reduced, self.grad_dtype())

    def sharded_flat_grad(self) -> Tensor | None:
        return self.grads.sharded()

    def keep_unsharded_grad(self) -> None:
        """Post-backward under no_sync: the original parameters see the unsharded
        gradient accumulated so far."""
        if self._use_orig_params:
            self.views.show_unsharded_grads(self.grads.unsharded_pending())

    def _show_grads(self) -> None:
        pending = self.grads.unsharded_pending()
        if pending is not None and self.uses_sharded_strategy:
            self.views.show_unsharded_grads(pending)
        else:
            self.views.show_sharded_grads(self.flat_param.grad)

    def use_unsharded_grad(self, unsharded: Tensor | None) -> None:
        """Exposes ``unsharded`` (an unsharded flat gradient, or None when no rank
        has one) on the original parameters, which are unsharded views now."""
        self.grads.summon(unsharded)
        self.views.show_unsharded_grads(unsharded)

    def drop_unsharded_grad(self, writeback: bool) -> None:
        """Back to the sharded gradient views after with_grads."""
        if self.grads.summoned is None:
            return
        self.grads.unsummon(writeback)
        self._show_grads()

    @property
    def summoned_grad(self) -> SummonedGrad | None:
        return self.grads.summoned

    # -- the post-backward hook ------------------------------------------------------------------

    def register_post_backward_hook(self, hook: Callable[[], None]) -> bool:
        """Hooks the ``AccumulateGrad`` node that views made from the flat
        parameter now feed, once per iteration; returns whether this call
        registered it. See [Note: The post-backward hook's node]."""
        if self._post_backward_hook is not None or not self.flat_param.requires_grad:
            return False
        grad_fn = self.flat_param.expand_as(self.flat_param).grad_fn
        assert grad_fn is not None, "the post-backward hook needs autograd enabled"
        node = grad_fn.next_functions[0][0]
        self._post_backward_hook = (node, node.register_hook(_weakly(hook)), hook)
        return True

    def register_reshard_only_hook(self, inputs: list[Tensor], hook: Callable[[], None]) -> bool:
        """For a flat parameter that needs no gradient: ``hook`` runs once the
        gradients of ``inputs`` are computed, once per iteration; returns
        whether this call registered it."""
        if self._post_backward_hook is not None:
            return False
        handle = torch.autograd.graph.register_multi_grad_hook(inputs, _weakly(hook))
        self._post_backward_hook = (None, handle, hook)
        return True

    def remove_post_backward_hook(self) -> None:
        if self._post_backward_hook is not None:
            self._post_backward_hook[1].remove()
            self._post_backward_hook = None


def _weakly(hook: Callable[[], None]) -> Callable[..., None]:
    """``hook`` called through a weak reference.

    [Note: Post-backward hooks hold their unit weakly]
    An autograd node keeps its hooks in C++, where the garbage collector cannot
    see them, and the AccumulateGrad node keeps the flat parameter. A hook that
    held the unit's state strongly would make state -> handle -> node -> hook ->
    state a cycle the collector cannot break: after a forward that raised (no
    backward removes the hook) the unit, its process groups and its memory would
    live as long as the process. The handle holds the hook (a cycle the
    collector sees); the node only a weak reference to it.
    """
    ref = weakref.ref(hook)

    def call(*_: object) -> None:
        alive = ref()
        if alive is not None:
            alive()

    return call
