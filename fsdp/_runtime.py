"""The runtime of one FSDP unit: forward and backward hooks, unshard and reshard.

[Note: One iteration]
- Root pre-forward (first forward of the outermost unit): lazy initialisation of
  the whole tree; the unshard stream waits for the optimizer; inputs move to
  the compute device and are cast to the root's parameter dtype; buffers take
  their dtype for the mode (train, or eval in full precision).
- Pre-forward of each unit: write back user changes, unshard (all-gather), wait,
  expose unsharded ``Tensor`` views, make sure the post-backward hook is
  registered, prefetch the next unit's all-gather (``forward_prefetch``).
- Post-forward: ``FULL_SHARD``/``HYBRID_SHARD`` units other than the root free
  the unsharded parameter; the root and the no-reshard strategies keep it for
  backward. A pre-backward hook goes on every output tensor that needs a gradient.
- Pre-backward (first gradient reaching a unit's output): queue the root's end
  of backward callback once, unshard again if needed, set a stale gradient
  aside, prefetch the previous unit (``BACKWARD_PRE``).
- Post-backward (the flat parameter's gradient is accumulated): reshard, prefetch
  (``BACKWARD_POST``), reduce the gradient on the reduce stream (cast to the
  reduce dtype, divide by ``pre``, reduce-scatter or all-reduce, all-reduce
  across replicas for hybrid sharding, divide by ``post``), keep the result.
- End of backward (root callback): wait for the reductions, reshard what is
  still unsharded, hand the sharded gradients to the optimizer, reset.
Under ``no_sync()`` the post-backward hook keeps the unsharded gradient and
returns; the next synchronised backward reduces the accumulated sum.

[Note: FSDP under torch.compile]
Compiling a model that FSDP wraps compiles the modules' own computation; the
FSDP hooks (unshard, reshard, reduce) run eagerly: dynamo breaks the graph at
them instead of tracing storage resizes and collectives it cannot capture.

[Note: Execution order and prefetch]
The first iteration records the order in which units run forward. Forward
prefetch unshards the next unit in that order; backward prefetch the previous
one (backward runs in reverse). A unit is prefetched only if it still needs an
unshard, so prefetching never adds an all-gather.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd import Variable
from torch.autograd.profiler import record_function
from torch.utils._pytree import tree_leaves, tree_map_only

from fsdp import _comm, _registry
from fsdp._common import (
    FLAT_PARAM,
    NO_RESHARD_AFTER_FORWARD_STRATEGIES,
    EnvSwitches,
    ProcessGroups,
    TrainingState,
)
from fsdp._flat_param import FlatParamHandle
from fsdp._ignored import Ignored
from fsdp._storage import free_storage
from fsdp._streams import CommStreams
from fsdp.api import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    MixedPrecision,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)


def _eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Runs ``fn`` eagerly under ``torch.compile`` (see [Note: FSDP under torch.compile])."""
    return torch._disable_dynamo(fn, recursive=True)


@dataclass(frozen=True)
class UnitConfig:
    """The configuration of one FSDP unit, fixed at construction."""

    sharding_strategy: ShardingStrategy
    mixed_precision: MixedPrecision
    cpu_offload: CPUOffload
    backward_prefetch: BackwardPrefetch | None
    forward_prefetch: bool
    limit_all_gathers: bool
    use_orig_params: bool
    env: EnvSwitches

    @property
    def keeps_unsharded_after_forward(self) -> bool:
        """The strategy keeps the unsharded parameter from forward to backward."""
        return self.sharding_strategy in NO_RESHARD_AFTER_FORWARD_STRATEGIES


class ExecutionOrder:
    """The order in which handles run forward, recorded in the first iteration."""

    forward: list[FlatParamHandle]
    recording: bool

    def __init__(self) -> None:
        self.forward = []
        self.recording = True

    def record(self, handle: FlatParamHandle) -> None:
        if self.recording and handle not in self.forward:
            self.forward.append(handle)

    def next_iteration(self) -> None:
        self.recording = False

    def _neighbour(self, handle: FlatParamHandle, step: int) -> FlatParamHandle | None:
        if handle not in self.forward:
            return None
        index = self.forward.index(handle) + step
        return self.forward[index] if 0 <= index < len(self.forward) else None

    def forward_next(self, handle: FlatParamHandle) -> FlatParamHandle | None:
        return None if self.recording else self._neighbour(handle, 1)

    def backward_next(self, handle: FlatParamHandle) -> FlatParamHandle | None:
        return self._neighbour(handle, -1)


@dataclass
class RootContext:
    """What the units of one root's tree share."""

    root: FSDPState
    states: list[FSDPState]
    streams: CommStreams
    exec_order: ExecutionOrder = field(default_factory=ExecutionOrder)
    backward_started: bool = False

    def state_of(self, handle: FlatParamHandle) -> FSDPState:
        return next(s for s in self.states if s.handle is handle)


def _cast_floats(dtype: torch.dtype, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """Casts floating-point tensors (never integer ones, e.g. token ids)."""

    def cast(t: Tensor) -> Tensor:
        return t.to(dtype) if torch.is_floating_point(t) and t.dtype != dtype else t

    return tree_map_only(Tensor, cast, args), tree_map_only(Tensor, cast, kwargs)


def _to_device(device: torch.device, args: Any, kwargs: Any) -> tuple[Any, Any]:
    def move(t: Tensor) -> Tensor:
        return t if t.device == device else t.to(device)

    return tree_map_only(Tensor, move, args), tree_map_only(Tensor, move, kwargs)


class FSDPState:
    """The runtime state of one FSDP unit (a wrapper or a ``fully_shard`` module)."""

    module: nn.Module
    config: UnitConfig
    process_group: Any
    replicate_group: Any | None
    ignored: Ignored
    rank: int
    world_size: int
    compute_device: torch.device
    handle: FlatParamHandle | None
    buffers: list[tuple[nn.Module, str]]
    orig_buffer_dtypes: dict[tuple[int, str], torch.dtype]
    training_state: TrainingState
    is_root: bool | None
    root_context: RootContext | None
    sync_gradients: bool
    state_dict_settings: StateDictSettings
    registers_flat_param: bool
    device_mesh: Any | None  # the constructor's, if given (SHARDED_STATE_DICT saves DTensors)

    def __init__(
        self,
        module: nn.Module,
        config: UnitConfig,
        groups: ProcessGroups,
        compute_device: torch.device,
        handle: FlatParamHandle | None,
        buffers: list[tuple[nn.Module, str]],
        ignored: Ignored,
    ) -> None:
        self.module = module
        self.config = config
        self.process_group = groups.shard
        self.replicate_group = groups.replicate
        self.ignored = ignored
        self.rank = self.process_group.rank()
        self.world_size = self.process_group.size()
        self.compute_device = compute_device
        self.handle = handle
        self.buffers = buffers
        self.orig_buffer_dtypes = {}
        self.training_state = TrainingState.IDLE
        self.is_root = None
        self.root_context = None
        self.sync_gradients = True
        self.state_dict_settings = StateDictSettings(
            StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig()
        )
        self.registers_flat_param = True
        self.device_mesh = None
        _registry.register(module, self)

    @property
    def state_dict_type(self) -> StateDictType:
        return self.state_dict_settings.state_dict_type

    @property
    def state_dict_config(self) -> StateDictConfig:
        return self.state_dict_settings.state_dict_config

    # -- tree --------------------------------------------------------------------------

    @property
    def root(self) -> RootContext:
        assert self.root_context is not None, "FSDP state used before lazy initialisation"
        return self.root_context

    def subtree_states(self) -> list[FSDPState]:
        """This unit and every unit below it, in module order."""
        states = []
        for submodule in self.module.modules():
            state = _registry.state_of(submodule)
            if state is not None and state not in states:
                states.append(state)
        return states

    def lazy_init(self) -> None:
        """Runs once, for the first unit whose forward runs (the root)."""
        if self.is_root is not None:
            return
        states = self.subtree_states()
        streams = CommStreams(self.compute_device, self.config.limit_all_gathers)
        context = RootContext(self, states, streams)
        for state in states:
            state.is_root = state is self
            state.root_context = context
            state._init_unit()

    def reset_lazy_init(self) -> None:
        """Forgets the tree found by ``lazy_init`` (for a unit that initialised
        as a root before its real root ran, e.g. through ``apply``)."""
        for state in self.subtree_states():
            state.is_root = None
            state.root_context = None

    def _init_unit(self) -> None:
        handle = self.handle
        if handle is not None:
            self._check_flat_param_device(handle)
            handle.lazy_init()
        for module, name in self.buffers:
            buffer = module._buffers[name]
            if buffer is not None:
                self.orig_buffer_dtypes[(id(module), name)] = buffer.dtype
        self._cast_buffers(full_precision=False)

    def _check_flat_param_device(self, handle: FlatParamHandle) -> None:
        device = handle.flat_param.device
        if self.config.cpu_offload.offload_params and device.type != "cpu":
            raise RuntimeError(
                "An FSDP-managed module with parameter CPU offloading enabled has parameters on "
                f"{device}. Make sure to not move the module from CPU when offloading parameters."
            )
        if not self.config.cpu_offload.offload_params and device != self.compute_device:
            raise RuntimeError(
                f"An FSDP-managed module unexpectedly has parameters on {device}. Make sure to "
                f"move the module to {self.compute_device} before training."
            )

    # -- precision ----------------------------------------------------------------------

    def full_precision_now(self) -> bool:
        """Eval mode with ``FSDP_USE_FULL_PREC_IN_EVAL=1`` computes in full precision."""
        return self.config.env.use_full_prec_in_eval and not self.module.training

    def _cast_buffers(self, full_precision: bool) -> None:
        """Buffers live in ``buffer_dtype`` from lazy initialisation on, as in torch
        (in their original dtype where ``full_precision``)."""
        target = self.config.mixed_precision.buffer_dtype
        for module, name in self.buffers:
            buffer = module._buffers[name]
            if buffer is None:
                continue
            dtype = buffer.dtype
            if torch.is_floating_point(buffer):
                orig = self.orig_buffer_dtypes.get((id(module), name), buffer.dtype)
                dtype = orig if target is None or full_precision else target
            if buffer.dtype != dtype or buffer.device != self.compute_device:
                buffer.data = buffer.to(device=self.compute_device, dtype=dtype)

    # -- forward -------------------------------------------------------------------------

    @_eager
    def root_pre_forward(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        self.lazy_init()
        if not self.is_root:
            return args, kwargs
        with record_function("FSDP::root_pre_forward"):
            context = self.root
            context.streams.unshard_waits_for_compute()
            for state in context.states:
                state._cast_buffers(state.full_precision_now())
            args, kwargs = _to_device(self.compute_device, args, kwargs)
            dtype = self.config.mixed_precision.param_dtype
            if dtype is not None and self.config.mixed_precision.cast_root_forward_inputs:
                if not self.full_precision_now():
                    args, kwargs = _cast_floats(dtype, args, kwargs)
        return args, kwargs

    @_eager
    def pre_forward(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        mp = self.config.mixed_precision
        if mp.cast_forward_inputs and mp.param_dtype is not None and not self.full_precision_now():
            args, kwargs = _cast_floats(mp.param_dtype, args, kwargs)
        handle = self.handle
        if handle is None or handle.recomputing_in_backward():
            return args, kwargs
        with record_function("FSDP::pre_forward"):
            self.training_state = TrainingState.FORWARD_BACKWARD
            handle.begin_forward(self.full_precision_now())
            self.root.exec_order.record(handle)
            self.unshard(handle)
            self.wait_for_unshard(handle)
            handle._use_unsharded_views(as_params=False)
            if torch.is_grad_enabled():
                self._register_post_backward_hook(handle)
            if self.config.forward_prefetch:
                self._prefetch(self.root.exec_order.forward_next(handle), in_backward=False)
        return args, kwargs

    @_eager
    def post_forward(self, output: Any) -> Any:
        """Reshards (see [Note: One iteration]) and hooks the outputs; a forward
        recomputed inside this unit's backward (activation checkpointing) keeps
        the unsharded parameter for the backward that follows."""
        handle = self.handle
        if handle is not None and handle.recomputing_in_backward():
            return output
        with record_function("FSDP::post_forward"):
            if handle is not None:
                keeps = self.config.keeps_unsharded_after_forward
                # NO_SHARD has nothing to free; the root's backward starts right away.
                free = not (keeps or self.is_root or not handle.uses_sharded_strategy)
                keep_views = keeps and torch.is_grad_enabled()
                self.reshard(handle, free=free, use_sharded_views=not keep_views)
                handle.end_forward(awaits_backward=_needs_grad(output))
            output = self._register_pre_backward_hooks(output, handle)
            self.training_state = TrainingState.IDLE
        return output

    def _register_pre_backward_hooks(self, output: Any, handle: FlatParamHandle | None) -> Any:
        """Registers the pre-backward hook on every output tensor that needs a gradient."""
        if not torch.is_grad_enabled():
            return output

        def register(tensor: Tensor) -> Tensor:
            if tensor.requires_grad:
                tensor.register_hook(self._make_pre_backward_hook(handle))
            return tensor

        return tree_map_only(Tensor, register, output)

    def _register_post_backward_hook(self, handle: FlatParamHandle) -> None:
        """Hooks the first forward's ``AccumulateGrad`` node of this iteration
        (see [Note: The post-backward hook's node] in fsdp._flat_param)."""
        handle.register_post_backward_hook(self._make_post_backward_hook(handle))

    # -- backward ------------------------------------------------------------------------

    def _make_pre_backward_hook(self, handle: FlatParamHandle | None) -> Callable[[Tensor], Tensor]:
        def hook(grad: Tensor) -> Tensor:
            self._pre_backward(handle)
            return grad

        return hook

    @_eager
    def _pre_backward(self, handle: FlatParamHandle | None) -> None:
        context = self.root
        if not context.backward_started:
            context.backward_started = True
            Variable._execution_engine.queue_callback(context.root.finalize_backward)
        if handle is None or not handle.begin_backward():
            return
        with record_function("FSDP::pre_backward"):
            self.training_state = TrainingState.FORWARD_BACKWARD
            self.unshard(handle)
            self.wait_for_unshard(handle)
            handle._use_unsharded_views(as_params=False)
            handle.prepare_gradient_for_backward()
            if self.config.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
                self._prefetch(context.exec_order.backward_next(handle), in_backward=True)

    def _make_post_backward_hook(self, handle: FlatParamHandle) -> Callable[[], None]:
        def hook() -> None:
            self._post_backward(handle)

        return hook

    @_eager
    def _post_backward(self, handle: FlatParamHandle) -> None:
        with record_function("FSDP::post_backward"):
            handle.end_backward()
            if handle.flat_param.grad is None:
                return
            if not self.sync_gradients:
                handle.keep_unsharded_grad()
                return
            self.reshard(handle, free=True)
            if self.config.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
                self._prefetch(self.root.exec_order.backward_next(handle), in_backward=True)
            self._reduce_grad(handle)

    def _reduce_grad(self, handle: FlatParamHandle) -> None:
        grad = handle.take_unsharded_grad()
        assert grad is not None
        pre, post = _comm.gradient_divide_factors(self._data_parallel_size())
        with self.root.streams.on_reduce(grad):
            reduce_dtype = handle.reduce_dtype()
            grad = grad if grad.dtype == reduce_dtype else grad.to(reduce_dtype)
            if pre > 1:
                grad.div_(pre)
            reduced = self._reduce(handle, grad)
            if post > 1:
                reduced.div_(post)
            handle.set_reduced_grad(reduced)

    def _reduce(self, handle: FlatParamHandle, grad: Tensor) -> Tensor:
        """Sums the gradient over the shard group (reduce-scatter, or all-reduce
        for ``NO_SHARD``), then over the replicate group of hybrid sharding. A
        hybrid unit whose shard group is one rank holds the whole gradient and
        only the replicas sum it."""
        if handle.uses_sharded_strategy:
            reduced = self._reduce_scatter(handle, grad)
        else:
            reduced = grad
            if self.world_size > 1 or self.replicate_group is None:
                _comm.all_reduce(reduced, self.process_group)
        if self.replicate_group is not None:
            _comm.all_reduce(reduced, self.replicate_group)
        return reduced

    def _reduce_scatter(self, handle: FlatParamHandle, grad: Tensor) -> Tensor:
        padded = grad
        if grad.numel() != handle.padded_numel:
            padded = torch.zeros(handle.padded_numel, dtype=grad.dtype, device=grad.device)
            padded[: grad.numel()].copy_(grad)
        reduced = torch.empty(handle.shard_numel, dtype=grad.dtype, device=grad.device)
        _comm.reduce_scatter(reduced, padded, self.process_group)
        return reduced

    def _data_parallel_size(self) -> int:
        replicas = self.replicate_group.size() if self.replicate_group is not None else 1
        return self.world_size * replicas

    @_eager
    def finalize_backward(self) -> None:
        """The root's end-of-backward callback."""
        with record_function("FSDP::post_backward_final_callback"):
            context = self.root
            for state in context.states:
                state._post_backward_if_missed()
            context.streams.compute_waits_for_reduce()
            offloads = False
            for state in context.states:
                state._finalize_unit()
                offloads |= state.config.cpu_offload.offload_params
            if offloads:
                context.streams.synchronize()
            context.backward_started = False
            context.exec_order.next_iteration()

    def _post_backward_if_missed(self) -> None:
        """A unit that took part in this backward but whose hooked node never
        ran (the first forward's graph was dropped) is finished here."""
        handle = self.handle
        if handle is not None and handle.backward_missed():
            self._post_backward(handle)

    def _finalize_unit(self) -> None:
        handle = self.handle
        self.training_state = TrainingState.IDLE
        if handle is None:
            return
        if handle.is_unsharded() or handle.holds_unsharded_buffers():
            self.reshard(handle, free=True)  # also a copy kept for a backward that never ran
        handle.finish_iteration(synced=self.sync_gradients)

    # -- unshard / reshard ------------------------------------------------------------------

    def unshard(self, handle: FlatParamHandle, prefetch: bool = False) -> None:
        """Makes the unsharded parameter available (communication is asynchronous
        on CUDA: call ``wait_for_unshard`` before computing with it). A prefetch
        fills the buffer but leaves the flat parameter sharded; the unit's own
        unshard then finds the data ready."""
        handle.writeback_orig_params(self.config.env.skip_writeback_check)
        if handle.is_unsharded():
            return
        ready = handle.ready_unsharded()
        if ready is not None:
            if not prefetch:
                handle.finish_unshard(ready)
            return
        streams = self.root.streams
        with streams.on_unshard(), record_function("FSDP::unshard"):
            unsharded = handle.unshard_input()
            if handle.uses_sharded_strategy:
                buffer = handle.unsharded_buffer()
                _comm.all_gather(buffer, unsharded, self.process_group)
                unsharded = buffer
            handle.record_unshard(streams.record_unshard())
            if not prefetch:
                handle.finish_unshard(unsharded)

    def wait_for_unshard(self, handle: FlatParamHandle) -> None:
        self.root.streams.compute_waits(handle.take_unshard_event())

    def unshard_grad(self, handle: FlatParamHandle) -> None:
        """Gathers the sharded gradient and exposes it on the original parameters
        (summon_full_params(with_grads=True)): None everywhere when no rank has
        one, zeros for a rank without one when others have one. ``NO_SHARD``
        exposes its gradient itself."""
        sharded = handle.sharded_flat_grad()
        if not handle.uses_sharded_strategy:
            handle.use_unsharded_grad(None if sharded is None else sharded.to(handle.device))
            return
        missing = torch.tensor([float(sharded is None)], device=self.compute_device)
        _comm.all_reduce(missing, self.process_group)
        if int(missing.item()) == self.world_size:
            handle.use_unsharded_grad(None)
            return
        if sharded is None:
            sharded = torch.zeros_like(handle.flat_param._local_shard, device=handle.device)
        local = sharded.to(handle.device).contiguous()
        unsharded = torch.empty(handle.padded_numel, dtype=local.dtype, device=local.device)
        _comm.all_gather(unsharded, local, self.process_group)
        handle.use_unsharded_grad(unsharded[: handle.unpadded_numel])

    def drop_low_precision_unsharded(self, handle: FlatParamHandle) -> None:
        """Frees a low-precision unsharded copy that forward kept (see [Note:
        Summoning keeps what forward kept] in fsdp._unshard_params)."""
        buffer = handle.low_precision_unsharded()
        if buffer is not None:
            self.root.streams.release([buffer])
            free_storage(buffer)

    def reshard(self, handle: FlatParamHandle, free: bool, use_sharded_views: bool = True) -> None:
        self.root.streams.release(handle.buffers_freed_by_reshard(free))
        handle.reshard(free, use_sharded_views)

    def _prefetch(self, target: FlatParamHandle | None, in_backward: bool) -> None:
        """Starts ``target``'s all-gather early; its own pre-hook later finds the
        data ready. Only a sharded unit that still needs its data (in backward:
        one whose backward has not started) is prefetched, so prefetching never
        adds an all-gather."""
        if target is None or not target.uses_sharded_strategy or target.is_unsharded():
            return
        if in_backward and not target.awaits_backward():
            return
        state = self.root.state_of(target)
        target.set_force_full_precision(state.full_precision_now())
        with record_function("FSDP::prefetch"):
            state.unshard(target, prefetch=True)

    # -- the flat parameter as a registered parameter of the wrapper --------------------

    def show_flat_param(self) -> None:
        """``use_orig_params=False``: the flat parameter is the wrapper's parameter
        (so optimizers, ``.to()`` and ``parameters()`` see it)."""
        handle = self.handle
        if handle is not None and not self.config.use_orig_params and self.registers_flat_param:
            self.module._parameters[FLAT_PARAM] = handle.flat_param

    def hide_flat_param(self) -> None:
        self.module._parameters.pop(FLAT_PARAM, None)

    # -- helpers for other layers ------------------------------------------------------------

    def assert_state(self, expected: TrainingState | list[TrainingState]) -> None:
        """Raises ``ValueError`` (torch's type and wording) outside ``expected``."""
        states = expected if isinstance(expected, list) else [expected]
        if self.training_state not in states:
            raise ValueError(
                f"expected to be in states {states} but current state is {self.training_state}"
            )


def _needs_grad(output: Any) -> bool:
    """Whether any tensor of a forward's output needs a gradient (its backward will run)."""
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(t, Tensor) and t.requires_grad for t in tree_leaves(output))
