"""The parameter group: the unit of ``fully_shard`` that unshards, reshards and
reduces itself.

[Note: What a parameter group does]
One ``ParamGroup`` per ``fully_shard`` call owns that call's parameters
(``ShardedParam`` s) and their lifecycle (see [Note: A parameter group's
lifecycle] in fsdp._fully_shard._lifecycle), and does the unit's work with its
verbs: ``unshard`` (issue the all-gather), ``wait_for_unshard`` (copy out and
register the unsharded parameters), ``reshard``, ``pre_forward`` /
``post_forward``, ``pre_backward`` / ``post_backward`` (reduce the gradients)
and ``finalize_backward``. The per-module state (fsdp._fully_shard._state)
holds the hooks and the tree and says when.

- Pre-forward unshards and waits, then wraps the forward inputs that need a
  gradient in one autograd function (``RegisterPostBackwardFunction``) whose
  backward, run once the gradients of all the module's inputs are computed
  (so its parameters' too), is the group's post-backward. A group whose inputs
  need no gradient is finished by the root's end-of-backward callback.
- Post-forward reshards as ``reshard_after_forward`` says and records the group
  in the post-forward order, which backward walks the other way to prefetch:
  each pre-backward issues the all-gather of the group that ran before it.
- Post-backward reshards (unless ``set_reshard_after_backward(False)``) and
  reduces the gradients (fsdp._fully_shard._collectives); without gradient
  sync it keeps them, in the reduce dtype, for the next backward.
- Communication runs on the tree's streams (fsdp._streams, shared with our
  FSDP1): all-gathers on the unshard stream, reductions on the reduce stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from fsdp._common import profiler_label
from fsdp._fully_shard._api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from fsdp._fully_shard._collectives import (
    Comms,
    GatherResult,
    ReduceGroups,
    ReduceSpec,
    all_gather,
    copy_out,
    reduce_grads,
)
from fsdp._fully_shard._lifecycle import (
    PHASE_TRANSITIONS,
    RESIDENCE_TRANSITIONS,
    Phase,
    Residence,
)
from fsdp._fully_shard._mesh import MeshInfo, logger
from fsdp._fully_shard._param import ShardedParam
from fsdp._lifecycle import Lifecycle
from fsdp._streams import CommStreams
from fsdp._utils import _apply_to_tensors

__all__ = ["CommContext", "ParamGroup", "RegisterPostBackwardFunction"]


class CommContext:
    """What the groups of one tree share for communication: the streams, and the
    post-forward order that backward prefetching walks."""

    device: torch.device
    _streams: CommStreams | None
    post_forward_order: list[ParamGroup]

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._streams = None
        self.post_forward_order = []

    @property
    def streams(self) -> CommStreams:
        if self._streams is None:  # made when first used (no CUDA work at fully_shard)
            self._streams = CommStreams(self.device, limit_all_gathers=False)
        return self._streams


class ParamGroup:
    """The parameters of one ``fully_shard`` call (see [Note: What a parameter group does])."""

    params: list[ShardedParam]
    modules: tuple[nn.Module, ...]
    mesh_info: MeshInfo
    post_forward_info: MeshInfo | None  # None: keep unsharded after forward
    device: torch.device
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy
    comm: CommContext
    fqn: str
    # what the user set (FSDPModule's setters)
    reduce_grads: bool
    all_reduce_grads: bool
    reshard_after_backward: bool
    gradient_divide_factor: float | None
    reduce_scatter_unused_params: bool
    force_sum_reduction_for_comms: bool
    unshard_in_backward: bool
    unshard_async_op: bool
    all_reduce_hook: Callable[[Tensor], None] | None
    all_reduce_hook_stream: torch.cuda.Stream | None
    comms: Comms
    reduce_scatter_group: ProcessGroup | None  # set_separate_reduce_scatter_group
    reduce_scatter_max_input_buffers: int
    # the lifecycle and what the iteration keeps
    _residence: Lifecycle[Residence]
    _gathered_from: Residence
    _phase: Lifecycle[Phase]
    _pending: GatherResult | None
    _post_forward_written: torch.cuda.Event | None  # CUDA: after the post-forward shards
    _post_forward_indices: list[int]
    _partial_reduce: Tensor | None  # HSDP: reduce-scattered, not yet all-reduced
    _orig_dtype: torch.dtype | None
    _reduce_dtype: torch.dtype | None
    _reset_done: bool

    def __init__(
        self,
        params: list[ShardedParam],
        modules: tuple[nn.Module, ...],
        mesh_info: MeshInfo,
        post_forward_info: MeshInfo | None,
        device: torch.device,
        mp_policy: MixedPrecisionPolicy,
        offload_policy: OffloadPolicy,
    ) -> None:
        self.params = params
        self.modules = modules
        self.mesh_info = mesh_info
        self.post_forward_info = post_forward_info
        self.device = device
        self.mp_policy = mp_policy
        self.offload_policy = offload_policy
        self.comm = CommContext(device)
        self.fqn = ""
        self.reduce_grads = self.all_reduce_grads = self.reshard_after_backward = True
        self.gradient_divide_factor = None
        self.reduce_scatter_unused_params = self.force_sum_reduction_for_comms = False
        self.unshard_in_backward, self.unshard_async_op = True, False
        self.all_reduce_hook = self.all_reduce_hook_stream = None
        self.comms = Comms()
        self.reduce_scatter_group = None
        self.reduce_scatter_max_input_buffers = 1
        self._residence = Lifecycle(Residence.SHARDED, RESIDENCE_TRANSITIONS, "ParamGroup")
        self._gathered_from = Residence.SHARDED  # where the pending all-gather found them
        self._phase = Lifecycle(Phase.IDLE, PHASE_TRANSITIONS, "ParamGroup")
        self._pending = None
        self._post_forward_written = None
        self._post_forward_indices = []
        self._partial_reduce = None
        self._orig_dtype = self._reduce_dtype = None
        self._reset_done = False
        self._register_state_dict_hooks()

    # ------------------------------------------------------------ reading

    @property
    def residence(self) -> Residence:
        return self._residence.state

    @property
    def phase(self) -> Phase:
        return self._phase.state

    @property
    def is_sharded(self) -> bool:
        return self._residence.state is Residence.SHARDED

    @property
    def is_unsharded(self) -> bool:
        return self._residence.state is Residence.UNSHARDED

    @property
    def _module_fqn(self) -> str:
        """torch's name for ``fqn``: upstream's seam replacements read it."""
        return self.fqn

    @property
    def fsdp_params(self) -> list[ShardedParam]:
        """torch's name for ``params`` (upstream's tests read it)."""
        return self.params

    @property
    def offloads(self) -> bool:
        return isinstance(self.offload_policy, CPUOffloadPolicy)

    # ------------------------------------------------------------ setup

    def lazy_init(self) -> None:
        """Checks and dtypes read when the tree first runs (idempotent): the user
        may move, cast or load parameters between ``fully_shard`` and then."""
        if self.is_sharded and not self._reset_done:
            for param in self.params:
                param.reset_sharded_param()
            self._reset_done = True
        self._check_materialized()
        self._check_offloaded()
        self._init_dtypes()

    def _check_materialized(self) -> None:
        on_meta = [p.fqn for p in self.params if p.sharded_param.device.type == "meta"]
        if on_meta:
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, "
                f"but the following were still on meta device: {on_meta}\n"
                "For example, call module.to_empty(device) to materialize to device and "
                "call module.reset_parameters() on each module to initialize values."
            )

    def _check_offloaded(self) -> None:
        if not isinstance(self.offload_policy, CPUOffloadPolicy):
            return
        elsewhere = [
            (p.fqn, p.sharded_param.device)
            for p in self.params
            if p.sharded_param.device.type != "cpu"
        ]
        if elsewhere:
            raise RuntimeError(
                "FSDP parameters should be materialized on CPU when enabling CPU offloading. "
                'For example, load a CPU state dict or call module.to_empty(device="cpu"). '
                f"Found following parameters on non-CPU device: {elsewhere}\n"
            )

    def _init_dtypes(self) -> None:
        for param in self.params:
            param.init_dtypes(self.mp_policy)
        trainable = [p for p in self.params if p.sharded_param.requires_grad]
        orig = {p.orig_dtype for p in trainable}
        reduce = {p.reduce_dtype for p in trainable}
        if len(orig) > 1:
            raise AssertionError(f"FSDP expects uniform original parameter dtype but got {orig}")
        if len(reduce) > 1:
            raise AssertionError(f"FSDP expects uniform reduce dtype but got {reduce}")
        self._orig_dtype = orig.pop() if orig else None
        self._reduce_dtype = reduce.pop() if reduce else None

    def _register_state_dict_hooks(self) -> None:
        """State dicts hold the sharded DTensors: saving and loading reshard first,
        and a load re-reads each sharded parameter (see [Note: Re-reading the
        sharded parameter] in fsdp._fully_shard._param)."""

        def reshard(*args: Any, **kwargs: Any) -> None:
            self.reshard()

        def discard(*args: Any, **kwargs: Any) -> None:
            self.discard_pending()

        def reread(*args: Any, **kwargs: Any) -> None:
            for param in self.params:
                param.reset_sharded_param()

        for module in {p.location.module for p in self.params}:
            module.register_state_dict_pre_hook(reshard)
            module._register_load_state_dict_pre_hook(discard)
            module.register_load_state_dict_post_hook(reread)

    # ------------------------------------------------------------ residence

    def unshard(self, async_op: bool = False) -> None:
        """Issues the all-gather (a no-op while one is pending or the parameters
        are unsharded). ``async_op`` is accepted for torch's signature: the
        all-gather always runs on the unshard stream, waited for by
        ``wait_for_unshard``."""
        residence = self._residence.state
        if residence is Residence.GATHERING or residence is Residence.UNSHARDED:
            return
        if not self.unshard_in_backward and self._phase.state is Phase.PRE_BACKWARD:
            return
        info = self.mesh_info
        if residence is Residence.SHARDED_POST_FORWARD:
            if self.post_forward_info is None:
                # set_reshard_after_forward(False) while resharded to the post-forward
                # mesh: torch's check and message (its _get_unsharded_mesh_info)
                raise AssertionError(
                    f"Expected mesh_info to be FSDPMeshInfo, got {type(self.post_forward_info)}"
                )
            info = self.post_forward_info
            self.comm.streams.unshard_waits(self._post_forward_written)
            self._post_forward_written = None
        with profiler_label(self._label("FSDP::all_gather")):
            self._pending = all_gather(self.params, info.shard_group, self.comm.streams, self.comms)
        self._gathered_from = residence
        self._residence.move(Residence.GATHERING)

    def wait_for_unshard(self) -> None:
        """Copies the pending all-gather out and registers the unsharded
        parameters (a no-op without one)."""
        pending = self._pending
        if pending is None:
            return
        with profiler_label(self._label("FSDP::all_gather_copy_out")):
            copy_out(pending, self.params, self.comm.streams)
        self._pending = None
        for param in self.params:
            param.to_unsharded()
        self._residence.move(Residence.UNSHARDED)

    def discard_pending(self) -> None:
        """Drops a pending all-gather (its values are about to be overwritten:
        a state-dict load) and reshards."""
        self._drop_pending()
        self.reshard()

    def _drop_pending(self) -> None:
        """A pending all-gather is waited for and dropped; the parameters stay
        where it found them (sharded, or on the post-forward mesh)."""
        if self._pending is not None:
            self.comm.streams.compute_waits(self._pending.event)
            self._pending = None
            self._residence.move(self._gathered_from)

    def reshard(self) -> None:
        """Registers the sharded parameters and frees the unsharded ones. A
        pending all-gather is kept for the next unshard ([Note: A pending
        all-gather outlives a reshard])."""
        if self._residence.state is Residence.GATHERING:
            if self._gathered_from is Residence.SHARDED_POST_FORWARD:
                for param in self.params:
                    param.to_sharded()
            self._gathered_from = Residence.SHARDED
            return
        if self._residence.state is not Residence.SHARDED:
            for param in self.params:
                param.to_sharded()
        self._residence.move(Residence.SHARDED)

    def _reshard_after_forward(self) -> None:
        info = self.post_forward_info
        if info is None or self._residence.state is not Residence.UNSHARDED:
            return
        if info is self.mesh_info:
            self.reshard()
            return
        for param in self.params:
            param.to_sharded_post_forward()
        # the post-forward shards were written on the current stream; backward's
        # all-gather of them, on the unshard stream, waits for that
        self._post_forward_written = self.comm.streams.record_compute()
        self._residence.move(Residence.SHARDED_POST_FORWARD)

    def prefetch(self, backward: bool) -> None:
        """An explicit or implicit prefetch of this group's all-gather."""
        if backward and not self.unshard_in_backward:
            return
        with profiler_label(
            f"FSDP::{'backward' if backward else 'forward'}_prefetch for {self.fqn}"
        ):
            self.unshard(self.unshard_async_op)

    # ------------------------------------------------------------ forward

    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Pre: the group is idle (or finished a backward). Post: unsharded, and
        the inputs carry the post-backward registration."""
        logger.debug("%s", self._label("FSDP::pre_forward"))
        with profiler_label(self._label("FSDP::pre_forward")):
            entering = self._phase.state is not Phase.FORWARD  # not a group's later module
            self._phase.move(Phase.FORWARD)
            self.unshard(self.unshard_async_op)
            self.wait_for_unshard()
            return self._register_post_backward(args, kwargs) if entering else (args, kwargs)

    def post_forward(self, module: nn.Module | None, output: Any) -> Any:
        """Reshards as ``reshard_after_forward`` says (not when recomputing in
        backward) and records the group for backward prefetching."""
        logger.debug("%s", self._label("FSDP::post_forward"))
        with profiler_label(self._label("FSDP::post_forward")):
            if torch._C._current_graph_task_id() == -1:
                self._reshard_after_forward()
                self._post_forward_indices.append(len(self.comm.post_forward_order))
                self.comm.post_forward_order.append(self)
            self._phase.move(Phase.IDLE)
            return output

    def _register_post_backward(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not torch.is_grad_enabled():
            return args, kwargs
        if not kwargs and all(type(a) is Tensor for a in args):  # the common case, in one pass
            if not any(a.requires_grad for a in args):
                return args, kwargs
            wrapped_args = iter(
                RegisterPostBackwardFunction.apply(self, *(a for a in args if a.requires_grad))
            )
            return tuple(next(wrapped_args) if a.requires_grad else a for a in args), kwargs
        needing: list[Tensor] = []

        def collect(t: Tensor) -> Tensor:
            if t.requires_grad:
                needing.append(t)
            return t

        _apply_to_tensors(collect, (args, kwargs))
        if not needing:
            return args, kwargs
        wrapped = iter(RegisterPostBackwardFunction.apply(self, *needing))
        new_args, new_kwargs = _apply_to_tensors(
            lambda t: next(wrapped) if t.requires_grad else t, (args, kwargs)
        )
        return new_args, new_kwargs

    # ------------------------------------------------------------ backward

    def pre_backward(self, default_prefetch: bool) -> None:
        """Pre: the first gradient reached one of the module's outputs. Post:
        unsharded (unless ``unshard_in_backward`` is off), and the group that ran
        before it in forward prefetched (``default_prefetch``)."""
        if self._phase.state is Phase.PRE_BACKWARD:
            return
        logger.debug("%s", self._label("FSDP::pre_backward"))
        with profiler_label(self._label("FSDP::pre_backward")):
            self._phase.move(Phase.PRE_BACKWARD)
            self.unshard(self.unshard_async_op)
            self.wait_for_unshard()
            if default_prefetch:
                self._backward_prefetch()

    def _backward_prefetch(self) -> None:
        if not self._post_forward_indices:
            return  # cleared by an earlier backward of the same forward
        index = self._post_forward_indices.pop()
        if index > 0:
            self.comm.post_forward_order[index - 1].prefetch(backward=True)

    def post_backward(self, *unused: Any) -> None:
        """Pre: the module's gradients are computed (or the backward ended).
        Post: resharded (unless told otherwise) and the gradients reduced into
        the sharded parameters' ``.grad`` (or kept, without gradient sync)."""
        self._phase.move(Phase.POST_BACKWARD)
        logger.debug("%s", self._label("FSDP::post_backward"))
        with profiler_label(self._label("FSDP::post_backward")):
            for param in self.params:
                param.accumulate_unsharded_grad()
            if not self.reduce_grads:
                if self.reshard_after_backward:
                    self.reshard()
                for param in self.params:
                    param.keep_grad_in_reduce_dtype()
                return
            with_grad, grads = self._take_grads()
            if self.reshard_after_backward:
                self.reshard()
            if with_grad:
                self._reduce(with_grad, grads)

    def _take_grads(self) -> tuple[list[ShardedParam], list[Tensor]]:
        with_grad: list[ShardedParam] = []
        grads: list[Tensor] = []
        for param in self.params:
            grad = param.take_unsharded_grad()
            if grad is None and self.reduce_scatter_unused_params:
                if param.unsharded_param is not None and param.unsharded_param.requires_grad:
                    grad = param.zero_unsharded_grad()
            if grad is not None:
                with_grad.append(param)
                grads.append(grad)
        return with_grad, grads

    def _reduce(self, params: list[ShardedParam], grads: list[Tensor]) -> None:
        info = self.mesh_info
        groups = ReduceGroups(
            info.shard_group, info.shard_size, info.replicate_group, info.replicate_size
        )
        spec = ReduceSpec(
            groups,
            self._reduce_dtype,
            self._orig_dtype,
            self.gradient_divide_factor,
            self.all_reduce_grads,
            self.force_sum_reduction_for_comms,
            self.all_reduce_hook,
            self.all_reduce_hook_stream,
            self.comms,
        )
        with profiler_label(self._label("FSDP::post_backward_reduce")):
            streams = self.comm.streams
            self._partial_reduce = reduce_grads(params, grads, spec, streams, self._partial_reduce)

    def end_backward(self) -> None:
        """The root's end of backward: the group is idle again."""
        if self._phase.state is not Phase.POST_BACKWARD:
            self.post_backward()
        self._phase.move(Phase.IDLE)

    def finalize_backward(self) -> None:
        """After the last backward: a prefetch nobody used is dropped (the
        parameters stay where it found them, on the post-forward mesh too), the
        backward prefetch order forgotten."""
        self._drop_pending()
        self._post_forward_indices.clear()

    def reset_iter_state(self) -> None:
        """After an exception in forward or backward: back to idle and sharded,
        with nothing kept from the failed iteration."""
        self._partial_reduce = None
        self._post_forward_indices.clear()
        for param in self.params:
            param.accumulated_grad = None
        self._phase.move(Phase.IDLE)
        self.discard_pending()

    def _label(self, name: str) -> str:
        return f"{name} ({self.fqn})" if self.fqn else name

    def __repr__(self) -> str:
        return f"ParamGroup(fqn={self.fqn})"


class RegisterPostBackwardFunction(torch.autograd.Function):
    """Passes the forward inputs that need a gradient through unchanged; its
    backward, once all their gradients are computed, runs the group's
    post-backward (the ``register_post_backward_hook_backward`` seam)."""

    @staticmethod
    def forward(ctx: Any, group: ParamGroup, *inputs: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.group = group
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        ctx.group.post_backward()
        return (None, *grads)
