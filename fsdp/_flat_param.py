"""The FSDP unit: one flat parameter, its memory, views and gradient, and the
unshard, reshard and reduction of all of them.

[Note: What the unit is made of]
A ``FlatParamHandle`` (torch's name) is the unit object, as FSDP2's
``FSDPParamGroup``: it owns four parts, one per domain noun, and does the
unit's own work with them:

- ``FlatParamLayout`` / ``ShardLayout`` (fsdp._layout): immutable; where each
  original parameter lies in the flat parameter and in this rank's shard.
- ``FlatParamStorage`` (fsdp._storage): the shard and the unsharded buffers
  that come and go, and which one ``flat_param.data`` is.
- ``OrigParamViews`` (fsdp._orig_params): what the module sees under its
  original parameter names, and the writeback of user changes.
- ``FlatParamGrads`` (fsdp._grads): the gradient within and across backwards.

The unit unshards (all-gather through fsdp._comm on the tree's streams),
reshards and reduces its gradient (fsdp._reduce) itself, and owns the bodies of
its hooks (``pre_forward``, ``post_forward``, ``pre_backward``,
``post_backward``, ``finalize_backward``), as FSDP2's group does; ``FSDPState``
(fsdp._runtime) registers the hooks, holds the tree, and decides what depends
on other units (the forward order, prefetching, the end of backward). Callers that
need a part use it directly (``handle.storage``, ``handle.views``,
``handle.grads``, ``handle.layout``): the unit does not forward to them.
Its lifecycle is a ``UnitLifecycle`` (fsdp._unit_state), its post-backward hook a
``PostBackwardHook`` (fsdp._backward_hook); prefetching: [Note: Prefetched
units] and [Note: Forward prefetch shows the views at once] in fsdp._exec_order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fsdp import _comm
from fsdp._backward_hook import PostBackwardHook
from fsdp._common import HandleShardingStrategy, HandleTrainingState, profiler_label
from fsdp._dtensor_extensions import DTensorExtensions, ParamExtension
from fsdp._grads import FlatParamGrads
from fsdp._layout import (
    FlatParamLayout,
    FlatParamShardMetadata,
    ParamInfo,
    ShardLayout,
    ShardParamInfo,
    SharedParamInfo,
    aligned_numel,
    check_flattenable,
    shard_metadata,
    shard_param_infos,
)
from fsdp._lifecycle import Lifecycle
from fsdp._optim_in_backward import marked_for_backward, step_in_backward
from fsdp._orig_params import OrigParamViews
from fsdp._reduce import CommHookSpec, ReducePlan, reduce_gradient
from fsdp._storage import FlatParameter, FlatParamStorage, free_storage
from fsdp._streams import CommStreams
from fsdp._unit_state import PREFETCH_TRANSITIONS, Prefetch, UnitLifecycle, UnitState

__all__ = [
    "FlatParamHandle",
    "FlatParamShardMetadata",
    "FlatParameter",
    "HandleShardingStrategy",
    "HandleTrainingState",
]


class FlatParamHandle:
    """One FSDP unit: its flat parameter's layout, storage, views and gradient,
    their lifecycle, and the unit's unshard, reshard and reduction (see the
    module notes)."""

    flat_param: FlatParameter
    process_group: Any
    replicate_group: Any | None  # hybrid sharding's replicas
    rank: int
    world_size: int
    device: torch.device
    layout: FlatParamLayout
    shard: ShardLayout
    storage: FlatParamStorage
    views: OrigParamViews
    grads: FlatParamGrads
    lifecycle: UnitLifecycle
    prefetch: Lifecycle[Prefetch]
    has_optim_in_backward: bool
    _sharding_strategy: HandleShardingStrategy
    _keep_low_precision_grads: bool
    _mp_reduce_dtype: torch.dtype | None
    _skip_writeback_check: bool  # FSDP_SKIP_WRITEBACK_CHECK
    _reduce_plan: ReducePlan
    _streams: CommStreams | None  # the tree's, from lazy initialisation on
    _unshard_event: torch.cuda.Event | None
    post_backward_hook: PostBackwardHook
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
        replicate_group: Any | None = None,
        skip_writeback_check: bool = False,
    ) -> None:
        params = list(params)
        if not params:
            raise ValueError(
                f"Cannot construct a {type(self).__name__} with an empty parameter list"
            )
        if fsdp_extension is not None:  # see [Note: Tensor-parallel parameters]
            params = fsdp_extension.localize(params, fully_sharded_module)
        check_flattenable(params, use_orig_params)
        self._fsdp_extension = fsdp_extension
        self.process_group = process_group
        self.replicate_group = replicate_group
        self.rank = process_group.rank()
        self.world_size = process_group.size()
        self.device = device
        self._sharding_strategy = sharding_strategy
        self._keep_low_precision_grads = keep_low_precision_grads
        self._mp_reduce_dtype = mp_reduce_dtype
        self._skip_writeback_check = skip_writeback_check
        align = aligned_numel(mp_param_dtype or params[0].dtype) if use_orig_params else None
        self.layout, ordered = FlatParamLayout.of(
            params, fully_sharded_module, align, self.world_size
        )
        self.shard = ShardLayout.of(
            self.layout, self.rank, self.world_size, sharding_strategy.is_sharded()
        )
        self._build_parts(ordered, offload_params, mp_param_dtype, use_orig_params)
        self.views = OrigParamViews(
            self.layout,
            self.shard,
            ordered,
            use_orig_params,
            not use_unsafe_setattr,
            self._param_extensions,
        )
        self.flat_param.describe_params(
            self.layout, ordered, self.views.params if use_orig_params else None
        )
        self.lifecycle = UnitLifecycle()
        self.has_optim_in_backward = False
        self.prefetch = Lifecycle(Prefetch.NONE, PREFETCH_TRANSITIONS, "FlatParamHandle prefetch")
        self._streams = None
        self._unshard_event = None
        self.post_backward_hook = PostBackwardHook(self.flat_param)

    def _build_parts(
        self,
        ordered: list[nn.Parameter],
        offload_params: bool,
        mp_param_dtype: torch.dtype | None,
        use_orig_params: bool,
    ) -> None:
        """The flat parameter, its storage and gradient, and the reduction plan."""
        requires_grad = any(p.requires_grad for p in ordered)
        self.flat_param = FlatParameter(self.layout.flatten(ordered), requires_grad=requires_grad)
        self.storage = FlatParamStorage(
            self.flat_param, self.shard, self.device, offload_params, mp_param_dtype
        )
        extension = self._fsdp_extension
        self._param_extensions = tuple(
            None if extension is None else extension.extension_of(p) for p in ordered
        )
        self.grads = FlatParamGrads(self.flat_param, self.shard, offload_params)
        self._reduce_plan = ReducePlan.of(
            self.uses_sharded_strategy,
            self.shard.padded_numel,
            self.shard.shard_numel,
            self.process_group,
            self.replicate_group,
        )

    # -- what the unit is (torch's names where torch has one) ----------------------------

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
    def training_state(self) -> HandleTrainingState:
        """The lifecycle in torch's terms (``HandleTrainingState``)."""
        return self.lifecycle.torch_state

    def param_infos(self) -> tuple[ParamInfo, ...]:
        return self.layout.param_infos

    def shared_param_infos(self) -> tuple[SharedParamInfo, ...]:
        return self.layout.shared_param_infos

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
        the parameter's own dtype; in forced full precision always the latter
        (the reduce itself keeps the dtype autograd gave: [Note: Full precision
        decided at the reduce])."""
        if self.storage.force_full_precision:
            return self.storage.orig_dtype
        return self._reduce_dtype

    def _reduced_grad_dtype(self, reduced: Tensor, hook: CommHookSpec | None) -> torch.dtype:
        """``grad_dtype``, except after torch's low-precision hooks, which cast the
        reduced gradient back themselves (to their state's ``parameter_type``):
        torch then casts it no further, but for sharded strategies with
        ``keep_low_precision_grads`` (``param_dtype`` for the optimizer)."""
        casts_itself = hook is not None and hook.casts_itself
        if casts_itself and not (self._keep_low_precision_grads and self.uses_sharded_strategy):
            return reduced.dtype
        if self.storage.force_full_precision and self._keep_low_precision_grads:
            # forced at the reduce: NO_SHARD keeps the all-reduce's dtype, uncast; a
            # shard is cast to the parameter's dtype and not back to param_dtype
            sharded = self.uses_sharded_strategy
            return self.storage.orig_dtype if sharded else reduced.dtype
        return self.grad_dtype()

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

    def rebind_local_shard(self) -> None:
        """After ``module.to(...)`` moved or cast the flat parameter: the original
        names are shown again (``module._apply`` took them away meanwhile)."""
        if self.storage.is_unsharded():
            self._use_unsharded_views(as_params=True)  # inside summon_full_params
            return
        self.storage.rebind_local_shard()
        self.views.refresh_placeholders(self.flat_param.dtype, self.flat_param.device)
        self.views.show_resharded(self.flat_param)

    def lazy_init(self, streams: CommStreams) -> None:
        """At the root's first forward (the user may have moved or cast the module
        since construction): binds the shard and the tree's streams, allocates
        buffers, finds optimizers in backward. Changes the user made to original
        parameters are written back at the first unshard, as torch's FSDP does: a
        call that initialises lazily without one (``check_is_root``, an optimizer
        state dict) leaves a replaced ``Parameter`` in its module."""
        self.storage.check_device()
        self._streams = streams
        self.flat_param._local_shard = self.flat_param.data
        self.storage.init_buffers()
        self.grads.init_buffers(self.grad_dtype(), self.device)
        self.has_optim_in_backward = marked_for_backward(self.flat_param, self.views.params)

    def begin_root_forward(self, forward_prefetch: bool) -> None:
        """At the root's pre-forward. ``use_orig_params``: the flat parameter needs
        a gradient while any original parameter does (the user may freeze or
        unfreeze them at any time). Forward prefetch starts afresh."""
        if self._use_orig_params:
            self.flat_param.requires_grad_(any(p.requires_grad for p in self.views.params))
        if forward_prefetch:
            self.prefetch.move(Prefetch.NONE)

    # -- optimizers in backward ----------------------------------------------------------------

    def _step_optimizers_in_backward(self) -> None:
        """The reduced gradient is exposed, the marked original parameters step
        (fsdp._optim_in_backward); the flat gradient goes once none has one."""
        self.grads.finish_backward(synced=True)
        self.views.fresh_grads()
        self._show_grads()
        step_in_backward(self.views.params)
        if self.views.all_grads_cleared():
            self.grads.clear()

    # -- the hooks' bodies (FSDPState registers the hooks and decides for the tree) ----------

    def pre_forward(self, full_precision: bool) -> None:
        """Unshards for forward and shows ``Tensor`` views; after a forward prefetch
        only waits, keeping the prefetch's views (see [Note: Forward prefetch shows
        the views at once] in fsdp._exec_order)."""
        self.lifecycle.begin_forward()
        self.storage.force_full_precision = full_precision
        if self.prefetch.state is Prefetch.SHOWN:
            self.wait_for_unshard()
        else:
            self._unshard_for_compute()

    def post_forward(self, free: bool, keep_views: bool, awaits_backward: bool) -> None:
        """Reshards (``free``: the unsharded parameter goes; ``NO_SHARD`` has none
        to free), keeping forward's views for backward where ``keep_views``
        (use_orig_params); the unit then awaits its backward if an output needs
        a gradient (or an earlier forward's does)."""
        self.reshard(free and self.uses_sharded_strategy, use_sharded_views=not keep_views)
        self.lifecycle.end_forward(awaits_backward)

    def pre_backward(self, full_precision: bool = False) -> bool:
        """Unshards for backward and sets a stale gradient aside, once per
        iteration; False when there was nothing to do. ``full_precision``: the
        module's mode now decides the unsharded dtype, not the last forward's
        (torch's ``_force_full_precision`` is read live: a forward in training
        mode and one in eval mode before one backward in training mode unshard
        in ``param_dtype``)."""
        if not self.lifecycle.begin_backward():
            return False
        with profiler_label("FSDP::pre_backward"):
            self.storage.force_full_precision = full_precision
            self._unshard_for_compute()
            self.grads.prepare_for_backward()
        return True

    def post_backward(self, at_end: bool = False) -> bool:
        """The gradient is accumulated; True when there is one to reduce (the
        runtime reshards and prefetches, then calls ``reduce_grad``). ``at_end``:
        only for a unit whose hooked node never ran (see ``PostBackwardHook``)."""
        if at_end and not self.lifecycle.backward_missed():
            return False
        self.lifecycle.end_backward()
        return self.flat_param.grad is not None

    def finalize_backward(self, free: bool, synced: bool) -> None:
        """End of backward: reshards what is still unsharded (also a copy kept
        for a backward that never ran: torch keeps it, a known defect of its,
        KnownDefects.keeps_frozen_units_unsharded), hands the sharded gradient to
        the optimizer (see fsdp._grads), and the iteration is over."""
        storage = self.storage
        if storage.is_unsharded() or (free and storage.unsharded_buffers()):
            self.reshard(free)
        fresh = self.grads.finish_backward(synced)
        if self._use_orig_params and self.flat_param.requires_grad:
            # A frozen unit's gradients are the user's: no backward of FSDP's
            # touches them (torch's FSDP finalizes only units that need them).
            if fresh:
                self.views.fresh_grads()
            self._show_grads()
        self.post_backward_hook.remove()
        self.lifecycle.move(UnitState.IDLE)
        self.prefetch.move(Prefetch.NONE)
        self.views.end_iteration()

    # -- unshard -----------------------------------------------------------------------------

    def unshard(self, prefetch: bool = False) -> None:
        """Makes the unsharded parameter available (communication is asynchronous
        on CUDA: call ``wait_for_unshard`` before computing with it). A prefetch
        fills the buffer but leaves the flat parameter sharded; the unit's own
        unshard then finds the data ready."""
        self.writeback_orig_params(self._skip_writeback_check)
        storage = self.storage
        if storage.is_unsharded():
            return
        if self.uses_sharded_strategy and not storage.low_precision_now():
            self._drop_low_precision_copy()  # [Note: A full-precision unshard drops the low-precision copy]
        ready = storage.ready_unsharded()
        if ready is not None:
            if not prefetch:
                storage.finish_unshard(ready)
            return
        streams = self._streams
        assert streams is not None, "FSDP unit used before lazy initialisation"
        on_stream = streams.on_unshard() if streams.is_cuda else contextlib.nullcontext()
        with on_stream, profiler_label("FSDP::unshard"):
            self._all_gather(streams, prefetch)

    def _all_gather(self, streams: CommStreams, prefetch: bool) -> None:
        storage = self.storage
        unsharded = storage.unshard_input()
        if self.uses_sharded_strategy:
            buffer = storage.unsharded_buffer()
            _comm.all_gather(buffer, unsharded, self.process_group)
            unsharded = buffer
        self._unshard_event = streams.record_unshard()
        if not prefetch:
            storage.finish_unshard(unsharded)

    @property
    def prefetched(self) -> bool:
        """An unshard was started ahead of the unit's use (torch's ``_prefetched``)."""
        return self.prefetch.state is not Prefetch.NONE

    def wait_for_unshard(self) -> None:
        event, self._unshard_event = self._unshard_event, None
        if event is not None:
            assert self._streams is not None
            self._streams.compute_waits(event)

    def _unshard_for_compute(self) -> None:
        """Forward and backward: unshard, wait, and show ``Tensor`` views."""
        self.unshard()
        self.wait_for_unshard()
        self._use_unsharded_views(as_params=False)

    def unshard_ahead(
        self, full_precision: bool, for_forward: bool = False
    ) -> torch.cuda.Event | None:
        """Starts the all-gather ahead of its use (a prefetch, or ``_unshard``);
        the unit's own unshard later finds the data ready. Returns the event the
        all-gather's users wait for (CUDA). Nothing is gathered when the unit
        holds its data already (``NO_SHARD``, kept since forward). ``for_forward``
        (forward prefetch) unshards in full and shows forward's views at once."""
        if for_forward:
            self._prefetch_for_forward(full_precision)
            return self._unshard_event
        if self.prefetch.state is Prefetch.NONE:
            self.prefetch.move(Prefetch.GATHERED)
        if self.uses_sharded_strategy and not self.storage.is_unsharded():
            self.storage.force_full_precision = full_precision
            with profiler_label("FSDP::prefetch"):
                self.unshard(prefetch=True)
        return self._unshard_event

    def _prefetch_for_forward(self, full_precision: bool) -> None:
        """Unshards now and shows forward's ``Tensor`` views, never inference
        tensors ([Note: Forward prefetch shows the views at once], [Note: Views are
        made with autograd on]), also where the data is at hand (``NO_SHARD``)."""
        self.prefetch.move(Prefetch.GATHERED)
        self.storage.force_full_precision = full_precision
        with profiler_label("FSDP::prefetch"), torch.inference_mode(False):
            self.unshard()
            self.views.show_unsharded(self.flat_param, False, HandleTrainingState.FORWARD)
        self.prefetch.move(Prefetch.SHOWN)

    def _drop_low_precision_copy(self) -> None:
        """Frees the low-precision unsharded copy, if one is allocated ([Note: A
        full-precision unshard drops the low-precision copy] in fsdp._storage)."""
        low = self.storage.low_precision_unsharded()
        if low is not None:
            self._release([low])
            free_storage(low)

    def _use_unsharded_views(self, as_params: bool) -> None:
        """Sets the original parameter names to views into the unsharded flat
        parameter: ``nn.Parameter`` s when ``as_params`` (summon_full_params,
        state dicts), plain ``Tensor`` views otherwise (forward and backward, so
        that autograd reaches the flat parameter). Tests patch this seam."""
        self.views.show_unsharded(self.flat_param, as_params, self.training_state)

    def _release(self, tensors: list[Tensor]) -> None:
        if self._streams is not None:
            self._streams.release(tensors)

    # -- summon_full_params ---------------------------------------------------------------------

    def enter_summon(self, with_grads: bool, offload_to_cpu: bool, hidden: bool) -> bool:
        """Gathers the full-precision parameters (and, ``with_grads``, the
        gradient) and exposes them as ``nn.Parameter`` s; ``hidden`` (ranks other
        than 0 under ``rank0_only``) reshards at once. Returns whether the exit
        frees the unsharded data (not when forward kept it)."""
        self.lifecycle.begin_summon()
        self.storage.force_full_precision = True
        self._drop_low_precision_copy()  # [Note: Summoning keeps what forward kept]
        free_on_exit = self.storage.ready_unsharded() is None
        # Outside forward nothing else orders the all-gather after the optimizer
        # step or a writeback on the current stream (see fsdp._streams).
        assert self._streams is not None
        self._streams.unshard_waits_for_compute()
        self.unshard()
        self.wait_for_unshard()
        if with_grads:
            self._unshard_grad()
        if hidden:
            self.reshard(free_on_exit)
            self._drop_unsharded_grad(writeback=False)
            return free_on_exit
        if offload_to_cpu:
            device_data = self.storage.unsharded_to_cpu()
            if free_on_exit:
                self._release([device_data])
                self.storage.free_unsharded()
        self._use_unsharded_views(as_params=True)
        return free_on_exit

    def exit_summon(self, writeback: bool, free: bool, hidden: bool) -> None:
        """Ends ``enter_summon``: writes the exposed data back into the shard
        (``writeback``) and reshards (freeing only what ``enter_summon`` gathered)."""
        if not hidden:
            if writeback:
                self.storage.writeback_unsharded()
            if not self._use_orig_params:
                self._use_unsharded_views(as_params=False)
            self.reshard(free)
            self._drop_unsharded_grad(writeback=writeback)
        self.lifecycle.end_summon()
        self.storage.force_full_precision = False

    def _unshard_grad(self) -> None:
        """Exposes the unsharded gradient on the original parameters, unsharded
        views now (summon_full_params(with_grads=True)): gathered from every rank
        (fsdp._grads), or ``NO_SHARD``'s own; None where no rank has one."""
        if self.uses_sharded_strategy:
            unsharded = self.grads.gather(self.grad_dtype(), self.device, self.process_group)
        else:
            sharded = self.grads.sharded()
            unsharded = None if sharded is None else sharded.to(self.device)
        self.grads.summon(unsharded)
        self.views.show_unsharded_grads(unsharded)

    def _drop_unsharded_grad(self, writeback: bool) -> None:
        """Back to the sharded gradient views after with_grads."""
        if self.grads.summoned is None:
            return
        self.grads.unsummon(writeback)
        self._show_grads()

    # -- reshard -------------------------------------------------------------------------------

    def reshard(self, free_unsharded: bool, use_sharded_views: bool = True) -> None:
        """Points the flat parameter back at the local shard; ``free_unsharded`` frees
        the unsharded storage (recorded on the current stream first), else it is kept.
        Without ``use_sharded_views`` (use_orig_params, no-reshard strategies after
        forward) the original parameters keep forward's views (a seam tests patch)."""
        storage = self.storage
        if self._streams is not None and self._streams.is_cuda:
            gathered = free_unsharded and self.uses_sharded_strategy  # see fsdp._streams
            self._streams.release(storage.buffers_freed_by_reshard(free_unsharded), gathered)
        forward_data = storage.reshard(free_unsharded)
        self.prefetch.move(Prefetch.NONE)
        if self._use_orig_params and not use_sharded_views:
            self.views.keep_forward_views(forward_data)
        elif self._use_orig_params or free_unsharded or not self.uses_sharded_strategy:
            self.views.show_resharded(self.flat_param)
            if self._use_orig_params and self.training_state is HandleTrainingState.FORWARD:
                self._show_grads()  # as torch's post-forward reshard: a user's .grad is shown again

    def load_local_shard(self, tensor: Tensor) -> None:
        """A saved local shard (LOCAL_STATE_DICT) becomes this rank's shard; an
        unsharded copy kept since forward is stale afterwards and is freed."""
        self.storage.load_local_shard(tensor)
        if not self.storage.is_unsharded():
            self.storage.free_unsharded()
        self.views.show_resharded(self.flat_param)

    # -- writeback of user changes (use_orig_params) ----------------------------------------------

    def writeback_before_save(self) -> None:
        """A local state dict saves the shard: the user's parameter changes first."""
        self.writeback_orig_params(self._skip_writeback_check, grads=False)

    def writeback_orig_params(self, skip_check: bool, grads: bool = True) -> None:
        """Copies user changes of original parameters and their gradients into the flat
        parameter (see [Note: Original parameters (use_orig_params=True)])."""
        if not self._use_orig_params:
            return
        storage = self.storage
        if self.flat_param.grad is not None and not storage.is_unsharded():
            if self.views.all_grads_cleared():
                self.grads.clear()  # zero_grad(set_to_none=True) on the originals
                self.views.forget_grads()
        if skip_check:
            return
        written = self.views.writeback(self.flat_param, self.grads, grads)
        if storage.is_unsharded() or not (written.params or written.grads):
            return
        if written.params:
            # The kept unsharded copy is stale (only parameters: a gradient edit may
            # be on some ranks only, and must not decide whether the next unshard
            # all-gathers). The all-gather waits for the copy (fsdp._streams).
            storage.free_unsharded()
            self.views.show_resharded(self.flat_param)
            self._streams.unshard_waits_for_compute()  # type: ignore[union-attr]

    # -- gradients ---------------------------------------------------------------------------------

    def _show_grads(self) -> None:
        pending = self.grads.unsharded_pending()
        if pending is not None and self.uses_sharded_strategy:
            self.views.show_unsharded_grads(pending)
        else:
            self.views.show_sharded_grads(self.flat_param.grad)

    def reduce_grad(
        self, sync: bool, hook: CommHookSpec | None, full_precision: bool = False
    ) -> None:
        """Takes the gradient autograd accumulated, reduces it on the reduce
        stream (fsdp._reduce) and keeps the shard for the end of backward; then
        steps optimizers in backward, if any. Without ``sync`` (no_sync) the
        original parameters see the unsharded gradient accumulated so far.

        [Note: Full precision decided at the reduce]
        Torch decides whether a unit is in forced full precision
        (``FSDP_USE_FULL_PREC_IN_EVAL=1`` and the module in eval mode) each time
        it asks, so its post-backward asks with the module's mode at the
        backward, not at the forward: a forward in training mode and a backward
        in eval mode reduce in full precision. Forced, the gradient keeps the
        dtype autograd gave it (no cast to ``reduce_dtype``), the sharded one is
        cast to the parameter's dtype and not back to ``param_dtype`` under
        ``keep_low_precision_grads``, and ``NO_SHARD`` keeps the all-reduce's
        dtype. ``full_precision`` is that decision, made by the caller with the
        module's mode now."""
        if self.storage.uses_param_mixed_precision or self._mp_reduce_dtype is not None:
            self.storage.force_full_precision = full_precision
        grads = self.grads
        if not sync:
            if self._use_orig_params:
                self.views.show_unsharded_grads(grads.unsharded_pending())
            return
        grad = grads.take_unsharded()
        assert grad is not None and self._streams is not None
        streams = self._streams
        on_stream = (
            streams.on_reduce(grad, grads.set_aside)
            if streams.is_cuda
            else contextlib.nullcontext()
        )
        with on_stream:
            self._reduce(grad, hook)

    def _reduce(self, grad: Tensor, hook: CommHookSpec | None) -> None:
        forced = self.storage.force_full_precision
        dtype = grad.dtype if forced else self.reduce_dtype()
        reduced = reduce_gradient(grad, dtype, self._reduce_plan, hook)
        self.grads.set_reduced(
            reduced, self._reduced_grad_dtype(reduced, hook), self.storage.orig_dtype
        )
        if self.has_optim_in_backward:
            self._step_optimizers_in_backward()
