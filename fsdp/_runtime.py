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

[Note: Forward inputs keep their identity]
The root moves inputs to the compute device through lists, tuples, dicts,
namedtuples (a ``PackedSequence`` too) and the other pytree containers; units
cast them (mixed precision) and hook outputs through what ``_apply_to_tensors``
reaches (dataclasses and sets as well, see fsdp._utils). When no tensor of an
argument needed changing, the module gets the caller's objects themselves, not
rebuilt copies: a module may add to a list or dict it is given and the caller
may look (torch's ``_recursive_to`` after its fix for this, pytorch#157832).
When one did, the containers on its path are rebuilt.

[Note: FSDP under torch.compile]
Compiling a model that FSDP wraps compiles the modules' own computation; the
FSDP hooks (unshard, reshard, reduce) run eagerly: dynamo breaks the graph at
them instead of tracing storage resizes and collectives it cannot capture.

Prefetching and the check of the forward order across ranks follow the orders
recorded in fsdp._exec_order (see [Note: Execution order and prefetch] there);
``_get_handle_to_prefetch`` picks the unit to prefetch (tests patch that seam).

Gradient reduction, communication hooks included, is fsdp._reduce (see [Note:
Communication hooks] there).

[Note: The unit runs its hooks' bodies]
The unit object (``FlatParamHandle``, fsdp._flat_param) owns the body of each
hook: ``pre_forward``, ``post_forward``, ``pre_backward``, ``post_backward``
(then ``reduce_grad``) and ``finalize_backward``, as FSDP2's parameter group
does. ``FSDPState`` registers the hooks and does what depends on the tree
between those calls: the forward order and its check, prefetching the next
unit, the root's end of backward, and the decisions that read the unit's
configuration (whether to free, whether to reduce). The torch seams tests
patch (``_register_post_backward_hook``, ``_post_backward_reshard``,
``_get_handle_to_prefetch``) are FSDPState's, as torch's are its runtime's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd import Variable

from fsdp import _registry
from fsdp._common import (
    FLAT_PARAM,
    NO_RESHARD_AFTER_FORWARD_STRATEGIES,
    EnvSwitches,
    ProcessGroups,
    TrainingState,
    profiler_label,
)
from fsdp._exec_order import ExecutionOrder, fqns_from_root
from fsdp._flat_param import FlatParamHandle
from fsdp._ignored import Ignored
from fsdp._lifecycle import Lifecycle
from fsdp._reduce import CommHook, CommHookSpec
from fsdp._streams import CommStreams
from fsdp._utils import _apply_to_tensors, cast_floats, to_device
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

# The attributes every unit of one tree must agree on (torch's names; the
# process group is not one of them, for hybrid sharding and MoE).
HOMOGENEOUS_ATTR_NAMES = ("_use_orig_params", "limit_all_gathers", "_use_full_prec_in_eval")

# FSDPState's lifecycle (see [Note: One lifecycle per object] in fsdp._lifecycle):
# forward and backward hooks move IDLE <-> FORWARD_BACKWARD (a pre-backward or a
# reshard-only hook may find the unit in FORWARD_BACKWARD already); a summon
# moves IDLE -> SUMMON_FULL_PARAMS -> IDLE; the end of backward resets to IDLE.
_T = TrainingState
_TRANSITIONS: dict[TrainingState, frozenset[TrainingState]] = {
    _T.IDLE: frozenset({_T.IDLE, _T.FORWARD_BACKWARD, _T.SUMMON_FULL_PARAMS}),
    _T.FORWARD_BACKWARD: frozenset({_T.FORWARD_BACKWARD, _T.IDLE}),
    _T.SUMMON_FULL_PARAMS: frozenset({_T.IDLE}),
}


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

    def homogeneous_values(self) -> tuple[bool, bool, bool]:
        """The values of ``HOMOGENEOUS_ATTR_NAMES``, in that order."""
        return (self.use_orig_params, self.limit_all_gathers, self.env.use_full_prec_in_eval)

    @property
    def keeps_unsharded_after_forward(self) -> bool:
        """The strategy keeps the unsharded parameter from forward to backward."""
        return self.sharding_strategy in NO_RESHARD_AFTER_FORWARD_STRATEGIES


@dataclass
class RootContext:
    """What the units of one root's tree share."""

    root: FSDPState
    states: list[FSDPState]
    streams: CommStreams
    exec_order: ExecutionOrder
    by_handle: dict[FlatParamHandle, FSDPState] = field(default_factory=dict)
    backward_started: bool = False

    @classmethod
    def of(cls, root: FSDPState, states: list[FSDPState]) -> RootContext:
        streams = CommStreams(root.compute_device, root.config.limit_all_gathers)
        handles = [s.handle for s in states if s.handle is not None]
        fqns = fqns_from_root(root.module)
        order = ExecutionOrder(handles, fqns, root.process_group, root.config.env.check_exec_order)
        by_handle = {s.handle: s for s in states if s.handle is not None}
        return cls(root, states, streams, order, by_handle)

    def state_of(self, handle: FlatParamHandle) -> FSDPState:
        return self.by_handle[handle]


class FSDPState:
    """The hooks and the tree of one FSDP unit (a wrapper or a ``fully_shard``
    module); the unit object (``handle``) runs the hooks' bodies (see [Note: The
    unit runs its hooks' bodies])."""

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
    lifecycle: Lifecycle[TrainingState]
    is_root: bool | None
    root_context: RootContext | None
    sync_gradients: bool
    state_dict_settings: StateDictSettings
    flat_param_owner: nn.Module | None  # the wrapper's ``module`` (None: fully_shard)
    device_mesh: Any | None  # the constructor's, if given (SHARDED_STATE_DICT saves DTensors)
    comm_hook: CommHookSpec | None  # see [Note: Communication hooks] in fsdp._reduce

    def __init__(
        self,
        module: nn.Module,
        config: UnitConfig,
        groups: ProcessGroups,
        compute_device: torch.device,
        handle: FlatParamHandle | None,
        buffers: list[tuple[nn.Module, str]],
        ignored: Ignored,
        device_mesh: Any | None = None,
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
        # The dtypes at construction (torch's), kept across lazy initialisations
        # (``apply`` before the first forward initialises and resets the tree).
        self.orig_buffer_dtypes = _buffer_dtypes(buffers)
        self.lifecycle = Lifecycle(TrainingState.IDLE, _TRANSITIONS, "FSDPState")
        self.is_root = None
        self.root_context = None
        self.sync_gradients = True
        self.state_dict_settings = StateDictSettings(
            StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig()
        )
        self.flat_param_owner = None
        self.device_mesh = device_mesh
        self.comm_hook = None
        _registry.register(module, self)

    @property
    def training_state(self) -> TrainingState:
        return self.lifecycle.state

    @property
    def state_dict_type(self) -> StateDictType:
        return self.state_dict_settings.state_dict_type

    @property
    def state_dict_config(self) -> StateDictConfig:
        return self.state_dict_settings.state_dict_config

    @property
    def backward_prefetch(self) -> BackwardPrefetch | None:
        return self.config.backward_prefetch

    @property
    def forward_prefetch(self) -> bool:
        return self.config.forward_prefetch

    # -- settings (the wrapper's and the state dicts' API) ------------------------------------

    def set_state_dict_settings(self, settings: StateDictSettings) -> None:
        self.state_dict_settings = settings

    def set_sync_gradients(self, sync: bool) -> None:
        """``no_sync()``: False keeps gradients unreduced (see [Note: One iteration])."""
        self.sync_gradients = sync

    def set_comm_hook(self, hook: CommHook | None, hook_state: object) -> None:
        self.comm_hook = None if hook is None else CommHookSpec(hook, hook_state)

    def own_flat_param(self, owner: nn.Module) -> None:
        """The wrapper's ``module`` holds the flat parameter (see ``show_flat_param``)."""
        self.flat_param_owner = owner
        self.show_flat_param()

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
        _check_homogeneous(states)
        context = RootContext.of(self, states)
        for state in states:
            state.is_root = state is self
            state.root_context = context
            state._init_unit(context.streams)

    def reset_lazy_init(self) -> None:
        """Forgets the tree found by ``lazy_init`` (for a unit that initialised
        as a root before its real root ran, e.g. through ``apply``)."""
        for state in self.subtree_states():
            state.is_root = None
            state.root_context = None

    def _init_unit(self, streams: CommStreams) -> None:
        if self.handle is not None:
            self.handle.lazy_init(streams)
        self._cast_buffers(full_precision=False)

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

    def root_pre_forward(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """Lazy initialisation, then the root's work (see [Note: One iteration]);
        nothing for the other units."""
        if self.is_root is False:
            return args, kwargs
        return self._root_pre_forward(args, kwargs)

    @_eager
    def _root_pre_forward(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        self.lazy_init()
        if not self.is_root:
            return args, kwargs
        with profiler_label("FSDP::root_pre_forward"):
            context = self.root
            context.streams.unshard_waits_for_compute()
            context.exec_order.begin_root_forward()
            for state in context.states:
                state._cast_buffers(state.full_precision_now())
                if state.handle is not None:
                    state.handle.begin_root_forward(self.config.forward_prefetch)
            args, kwargs = to_device(self.compute_device, args, kwargs)
            dtype = self.config.mixed_precision.param_dtype
            if dtype is not None and self.config.mixed_precision.cast_root_forward_inputs:
                if not self.full_precision_now():
                    args, kwargs = cast_floats(dtype, args, kwargs)
        return args, kwargs

    def _cast_forward_inputs(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        mp = self.config.mixed_precision
        if mp.cast_forward_inputs and mp.param_dtype is not None and not self.full_precision_now():
            return cast_floats(mp.param_dtype, args, kwargs)
        return args, kwargs

    @_eager
    def pre_forward(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """Checks and records the forward order, lets the unit unshard, registers
        its post-backward hook (with grad) and prefetches the next unit."""
        args, kwargs = self._cast_forward_inputs(args, kwargs)
        unit = self.handle
        if unit is None or unit.lifecycle.recomputing_in_backward():
            return args, kwargs
        with profiler_label("FSDP::pre_forward"):
            self.lifecycle.move(TrainingState.FORWARD_BACKWARD)
            self.root.exec_order.record_pre_forward(unit, self.module.training)
            unit.pre_forward(self.full_precision_now())
            if torch.is_grad_enabled():
                self._register_post_backward_hook(unit)
                self._register_post_backward_reshard_only_hook(unit, args, kwargs)
            self._prefetch_after(unit, for_forward=True)
        return args, kwargs

    @_eager
    def post_forward(self, output: Any) -> Any:
        """Hooks the outputs and lets the unit reshard (see [Note: One iteration]); a
        forward recomputed inside this unit's backward (activation checkpointing)
        keeps the unsharded parameter for the backward that follows."""
        unit = self.handle
        if unit is not None and unit.lifecycle.recomputing_in_backward():
            return output
        with profiler_label("FSDP::post_forward"):
            grad_enabled = torch.is_grad_enabled()
            if unit is not None:
                self.root.exec_order.record_post_forward(unit)
                keeps = self.config.keeps_unsharded_after_forward
                awaits = grad_enabled and any(t.requires_grad for t in _tensors_in(output))
                # The root's backward starts right away: it keeps the unsharded parameter.
                unit.post_forward(not (keeps or self.is_root), keeps and grad_enabled, awaits)
            if grad_enabled:
                output = self._register_pre_backward_hooks(output, unit)
            self.lifecycle.move(TrainingState.IDLE)
        return output

    def _register_pre_backward_hooks(self, output: Any, handle: FlatParamHandle | None) -> Any:
        """Registers the pre-backward hook on every output tensor that needs a
        gradient (torch's seam and arguments; the hook finds the unit itself)."""
        for tensor in _tensors_in(output):
            if tensor.requires_grad:
                tensor.register_hook(self._pre_backward)
        return output

    def _register_post_backward_hook(self, handle: FlatParamHandle) -> None:
        """Hooks the first forward's ``AccumulateGrad`` node of this iteration
        (see [Note: The post-backward hook's node] in fsdp._backward_hook)."""
        if not handle.post_backward_hook.is_registered():
            handle.post_backward_hook.register(self._post_backward)

    def _register_post_backward_reshard_only_hook(
        self, handle: FlatParamHandle, args: Any, kwargs: Any
    ) -> None:
        """A unit whose flat parameter needs no gradient has no post-backward
        hook: it reshards once the gradients of its inputs are computed (all
        gradients that need its parameters are then done). Inputs that need no
        gradient leave it to the end of backward."""
        hook = handle.post_backward_hook
        if hook.is_registered() or not hook.reshard_only():
            return
        inputs = [t for t in _tensors_in((args, kwargs)) if t.requires_grad]
        if inputs:
            hook.register_reshard_only(inputs, self._post_backward_reshard_only)

    # -- backward ------------------------------------------------------------------------

    @_eager
    def _pre_backward(self, grad: Tensor) -> Tensor:
        """The pre-backward hook: queues the root's end of backward once; the unit
        unshards (once per iteration), then the previous unit is prefetched."""
        handle, context = self.handle, self.root
        if not context.backward_started:
            context.backward_started = True
            Variable._execution_engine.queue_callback(context.root.finalize_backward)
        if handle is not None and handle.pre_backward(self.full_precision_now()):
            self.lifecycle.move(TrainingState.FORWARD_BACKWARD)
            self._prefetch_after(handle, for_forward=False)
        return grad

    @_eager
    def _post_backward(self) -> None:
        """The post-backward hook: the unit reshards, the runtime prefetches, the
        unit reduces."""
        handle = self.handle
        assert handle is not None
        with profiler_label("FSDP::post_backward"):
            if handle.post_backward():
                self._post_backward_reshard(handle)
                handle.reduce_grad(self.sync_gradients, self.comm_hook, self.full_precision_now())

    def _frees_in_backward(self) -> bool:
        """Backward frees the unsharded parameter, except under ``no_sync`` for
        the strategies that keep it from forward to backward: the next forward
        then needs no all-gather (torch's trade of memory for speed)."""
        return self.sync_gradients or not self.config.keeps_unsharded_after_forward

    @_eager
    def _post_backward_reshard_only(self) -> None:
        handle = self.handle
        assert handle is not None
        with profiler_label("FSDP::post_backward_reshard_only"):
            self.lifecycle.move(TrainingState.FORWARD_BACKWARD)
            handle.post_backward()
            self._post_backward_reshard(handle)

    def _post_backward_reshard(self, handle: FlatParamHandle) -> None:
        """Reshards after the unit's backward and prefetches. Runs once per unit
        and backward, from its post-backward hook or its reshard-only hook, never
        from the end of backward: tests count it."""
        handle.reshard(self._frees_in_backward())
        self._prefetch_after(handle, for_forward=False)

    @_eager
    def finalize_backward(self) -> None:
        """The root's end-of-backward callback."""
        with profiler_label("FSDP::post_backward_final_callback"):
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
        unit = self.handle
        if unit is not None and unit.post_backward(at_end=True):
            with profiler_label("FSDP::post_backward"):
                unit.reshard(self._frees_in_backward())
                unit.reduce_grad(self.sync_gradients, self.comm_hook)

    def _finalize_unit(self) -> None:
        self.lifecycle.move(TrainingState.IDLE)
        if self.handle is not None:
            self.handle.finalize_backward(self._frees_in_backward(), self.sync_gradients)

    # -- summon_full_params ----------------------------------------------------------------

    def begin_summon(self) -> None:
        self.lifecycle.move(TrainingState.SUMMON_FULL_PARAMS)

    def end_summon(self) -> None:
        self.lifecycle.move(TrainingState.IDLE)

    # -- prefetch ----------------------------------------------------------------------------

    def _get_handle_to_prefetch(self, current_handle: FlatParamHandle) -> FlatParamHandle | None:
        """The handle to unshard ahead of its use now that ``current_handle``'s
        hook runs; None for none (see [Note: Execution order and prefetch] in
        fsdp._exec_order). The seam tests patch (torch's
        ``_runtime_utils._get_handle_to_prefetch(state, current_handle)``)."""
        backward, forward = self.config.backward_prefetch, self.config.forward_prefetch
        if backward is None and not forward:
            return None
        return self.root.exec_order.prefetch_candidate(current_handle, backward, forward)

    def _prefetch_after(self, handle: FlatParamHandle, for_forward: bool) -> None:
        target = self._get_handle_to_prefetch(handle)
        if target is not None:
            self.root.state_of(target).unshard_ahead(for_forward)

    def unshard_ahead(self, for_forward: bool = False) -> torch.cuda.Event | None:
        """Starts this unit's all-gather ahead of its use (a prefetch, or
        ``_unshard``); see ``FlatParamHandle.unshard_ahead``."""
        if self.handle is None:
            return None
        return self.handle.unshard_ahead(self.full_precision_now(), for_forward)

    # -- the flat parameter as a registered parameter of the wrapped module --------------

    def show_flat_param(self) -> None:
        """``use_orig_params=False``: the flat parameter is a parameter of the
        wrapped module (the wrapper's ``module``), named
        ``_fsdp_wrapped_module._flat_param`` from the wrapper, as in torch (so
        optimizers, ``.to()`` and ``parameters()`` see it)."""
        handle, owner = self.handle, self.flat_param_owner
        if handle is not None and owner is not None and not self.config.use_orig_params:
            owner._parameters[FLAT_PARAM] = handle.flat_param

    def hide_flat_param(self) -> None:
        if self.flat_param_owner is not None:
            self.flat_param_owner._parameters.pop(FLAT_PARAM, None)

    # -- helpers for other layers ------------------------------------------------------------

    def assert_state(self, expected: TrainingState | list[TrainingState]) -> None:
        """Raises ``ValueError`` (torch's type and wording) outside ``expected``."""
        states = expected if isinstance(expected, list) else [expected]
        if self.training_state not in states:
            raise ValueError(
                f"expected to be in states {states} but current state is {self.training_state}"
            )


def _buffer_dtypes(buffers: list[tuple[nn.Module, str]]) -> dict[tuple[int, str], torch.dtype]:
    dtypes = {}
    for module, name in buffers:
        buffer = module._buffers[name]
        if buffer is not None:
            dtypes[(id(module), name)] = buffer.dtype
    return dtypes


def _check_homogeneous(states: list[FSDPState]) -> None:
    """Torch's check at lazy initialisation, with its message."""
    for i, name in enumerate(HOMOGENEOUS_ATTR_NAMES):
        values = {state.config.homogeneous_values()[i] for state in states}
        if len(values) != 1:
            raise ValueError(f"Expects one homogeneous value for {name} but got {values}")


def _tensors_in(tree: Any) -> list[Tensor]:
    """Every tensor of ``tree``, found as ``_apply_to_tensors`` finds them."""
    found: list[Tensor] = []

    def visit(tensor: Tensor) -> Tensor:
        found.append(tensor)
        return tensor

    _apply_to_tensors(visit, tree)
    return found
