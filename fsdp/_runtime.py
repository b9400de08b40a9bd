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

[Note: Communication hooks]
``register_comm_hook(state, hook)`` on the root gives every unit of its tree a
hook that replaces the gradient reduction (torch's semantics): sharded
strategies call ``hook(state, padded_unsharded_grad, output)``, where ``output``
is an empty shard the hook must fill; ``NO_SHARD`` calls ``hook(state, grad)``,
which reduces ``grad`` in place. The hook divides as it sees fit (the default
path divides by ``pre`` before and ``post`` after the collective). The gradient
reaches the hook in the reduce dtype, except for torch's two low-precision
hooks (``fp16_compress_hook``, ``bf16_compress_hook``), which cast it
themselves and, as in torch, get it in the dtype backward produced. Whatever
dtype the hook leaves, the result is cast to the gradient dtype the optimizer
expects. Hybrid strategies refuse hooks (their reduction has two steps).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_unflatten

from fsdp import _comm, _registry
from fsdp._common import (
    FLAT_PARAM,
    NO_RESHARD_AFTER_FORWARD_STRATEGIES,
    EnvSwitches,
    HandleTrainingState,
    ProcessGroups,
    TrainingState,
    clean_tensor_name,
    profiler_label,
)
from fsdp._exec_order import ExecutionOrder
from fsdp._flat_param import FlatParamHandle
from fsdp._ignored import Ignored
from fsdp._storage import free_storage
from fsdp._streams import CommStreams
from fsdp._utils import _apply_to_tensors
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


CommHook = Callable[..., None]

# torch's low-precision hooks (see [Note: Communication hooks]), known by name:
# this package does not import torch's hook module.
_LOW_PRECISION_HOOKS = frozenset(
    ("torch.distributed.algorithms._comm_hooks.default_hooks", name)
    for name in ("fp16_compress_hook", "bf16_compress_hook")
)


def _is_low_precision_hook(hook: CommHook | None) -> bool:
    key = (getattr(hook, "__module__", None), getattr(hook, "__qualname__", None))
    return key in _LOW_PRECISION_HOOKS


@dataclass
class RootContext:
    """What the units of one root's tree share."""

    root: FSDPState
    states: list[FSDPState]
    streams: CommStreams
    exec_order: ExecutionOrder
    backward_started: bool = False

    @classmethod
    def of(cls, root: FSDPState, states: list[FSDPState]) -> RootContext:
        streams = CommStreams(root.compute_device, root.config.limit_all_gathers)
        handles = [s.handle for s in states if s.handle is not None]
        fqns = _fqns_from_root(root.module)
        order = ExecutionOrder(handles, fqns, root.process_group, root.config.env.check_exec_order)
        return cls(root, states, streams, order)

    def state_of(self, handle: FlatParamHandle) -> FSDPState:
        return next(s for s in self.states if s.handle is handle)


class UnshardHandle:
    """What ``_unshard(async_op=True)`` returns: ``wait()`` makes the current
    stream wait for the all-gather (nothing to wait for on the CPU)."""

    _streams: CommStreams
    _event: torch.cuda.Event | None

    def __init__(self, streams: CommStreams, event: torch.cuda.Event | None) -> None:
        self._streams = streams
        self._event = event

    def wait(self) -> None:
        self._streams.compute_waits(self._event)
        self._event = None


def _fqns_from_root(root: nn.Module) -> dict[FlatParamHandle, list[str]]:
    """Each handle's original parameter names as seen from the root (no wrapper prefixes)."""
    fqns = {}
    for name, module in root.named_modules():
        state = _registry.state_of(module)
        if state is None or state.handle is None or state.handle in fqns:
            continue
        prefix = clean_tensor_name(f"{name}.") if name else ""
        fqns[state.handle] = [prefix + fqn for fqn in state.handle.fqns]
    return fqns


def _cast_floats(dtype: torch.dtype, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """Casts floating-point tensors (never integer ones, e.g. token ids)."""

    def cast(t: Tensor) -> Tensor:
        return t.to(dtype) if torch.is_floating_point(t) and t.dtype != dtype else t

    cast_args, cast_kwargs = _apply_to_tensors(cast, (args, kwargs))
    return cast_args, cast_kwargs


def _to_device(device: torch.device, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """See [Note: Forward inputs keep their identity]."""

    def move(tree: Any) -> Any:
        leaves, spec = tree_flatten(tree)
        moved = [
            x.to(device) if isinstance(x, Tensor) and x.device != device else x for x in leaves
        ]
        if all(new is old for new, old in zip(moved, leaves)):
            return tree
        return tree_unflatten(moved, spec)

    return move(args), move(kwargs)


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
    flat_param_owner: nn.Module | None  # the wrapper's ``module`` (None: fully_shard)
    device_mesh: Any | None  # the constructor's, if given (SHARDED_STATE_DICT saves DTensors)
    comm_hook: CommHook | None  # see [Note: Communication hooks]
    comm_hook_state: object

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
        # The dtypes at construction (torch's), kept across lazy initialisations
        # (``apply`` before the first forward initialises and resets the tree).
        self.orig_buffer_dtypes = _buffer_dtypes(buffers)
        self.training_state = TrainingState.IDLE
        self.is_root = None
        self.root_context = None
        self.sync_gradients = True
        self.state_dict_settings = StateDictSettings(
            StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig()
        )
        self.flat_param_owner = None
        self.device_mesh = None
        self.comm_hook = None
        self.comm_hook_state = None
        _registry.register(module, self)

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
            handle.find_optimizers_in_backward()
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
        with profiler_label("FSDP::root_pre_forward"):
            context = self.root
            context.streams.unshard_waits_for_compute()
            context.exec_order.begin_root_forward()
            for state in context.states:
                state._cast_buffers(state.full_precision_now())
                if state.handle is not None:
                    state.handle.sync_requires_grad()
                if self.config.forward_prefetch and state.handle is not None:
                    state.handle.prefetched = False
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
        with profiler_label("FSDP::pre_forward"):
            self.training_state = TrainingState.FORWARD_BACKWARD
            handle.begin_forward(self.full_precision_now())
            self.root.exec_order.record_pre_forward(handle, self.module.training)
            self.unshard(handle)
            self.wait_for_unshard(handle)
            handle._use_unsharded_views(as_params=False)
            if torch.is_grad_enabled():
                self._register_post_backward_hook(handle)
                self._register_post_backward_reshard_only_hook(handle, args, kwargs)
            self._prefetch_after(handle)
        return args, kwargs

    @_eager
    def post_forward(self, output: Any) -> Any:
        """Reshards (see [Note: One iteration]) and hooks the outputs; a forward
        recomputed inside this unit's backward (activation checkpointing) keeps
        the unsharded parameter for the backward that follows."""
        handle = self.handle
        if handle is not None and handle.recomputing_in_backward():
            return output
        with profiler_label("FSDP::post_forward"):
            if handle is not None:
                self.root.exec_order.record_post_forward(handle)
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

        return _apply_to_tensors(register, output)

    def _register_post_backward_hook(self, handle: FlatParamHandle) -> None:
        """Hooks the first forward's ``AccumulateGrad`` node of this iteration
        (see [Note: The post-backward hook's node] in fsdp._flat_param)."""
        handle.register_post_backward_hook(self._make_post_backward_hook(handle))

    def _register_post_backward_reshard_only_hook(
        self, handle: FlatParamHandle, args: Any, kwargs: Any
    ) -> None:
        """A unit whose flat parameter needs no gradient has no post-backward
        hook: it reshards once the gradients of its inputs are computed (all
        gradients that need its parameters are then done). Inputs that need no
        gradient leave it to the end of backward."""
        if handle.flat_param.requires_grad:
            return
        inputs = [t for t in _tensors_in((args, kwargs)) if t.requires_grad]
        if inputs:
            handle.register_reshard_only_hook(inputs, self._make_reshard_only_hook(handle))

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
        with profiler_label("FSDP::pre_backward"):
            self.training_state = TrainingState.FORWARD_BACKWARD
            self.unshard(handle)
            self.wait_for_unshard(handle)
            handle._use_unsharded_views(as_params=False)
            handle.prepare_gradient_for_backward()
            self._prefetch_after(handle)

    def _make_post_backward_hook(self, handle: FlatParamHandle) -> Callable[[], None]:
        def hook() -> None:
            self._post_backward(handle)

        return hook

    @_eager
    def _post_backward(self, handle: FlatParamHandle, in_backward: bool = True) -> None:
        """Reshards, prefetches (not once backward is over) and reduces."""
        with profiler_label("FSDP::post_backward"):
            handle.end_backward()
            if handle.flat_param.grad is None:
                return
            if in_backward:
                self._post_backward_reshard(handle)
            else:
                self.reshard(handle, free=self._frees_in_backward())
            if not self.sync_gradients:
                handle.keep_unsharded_grad()
                return
            self._reduce_grad(handle)

    def _frees_in_backward(self) -> bool:
        """Backward frees the unsharded parameter, except under ``no_sync`` for
        the strategies that keep it from forward to backward: the next forward
        then needs no all-gather (torch's trade of memory for speed)."""
        return self.sync_gradients or not self.config.keeps_unsharded_after_forward

    def _make_reshard_only_hook(self, handle: FlatParamHandle) -> Callable[[], None]:
        def hook() -> None:
            self._post_backward_reshard_only(handle)

        return hook

    @_eager
    def _post_backward_reshard_only(self, handle: FlatParamHandle) -> None:
        with profiler_label("FSDP::post_backward_reshard_only"):
            self.training_state = TrainingState.FORWARD_BACKWARD
            handle.end_backward()
            self._post_backward_reshard(handle)

    def _post_backward_reshard(self, handle: FlatParamHandle) -> None:
        """Reshards after the unit's backward and prefetches. Runs once per unit
        and backward, from its post-backward hook or its reshard-only hook, never
        from the end of backward: tests count it."""
        self.reshard(handle, free=self._frees_in_backward())
        self._prefetch_after(handle)

    def _reduce_grad(self, handle: FlatParamHandle) -> None:
        grad = handle.take_unsharded_grad()
        assert grad is not None
        with self.root.streams.on_reduce(grad, handle.grad_set_aside()):
            reduce_dtype = handle.reduce_dtype()
            if grad.dtype != reduce_dtype and not _is_low_precision_hook(self.comm_hook):
                grad = grad.to(reduce_dtype)
            if self.comm_hook is None:
                reduced = self._default_reduce(handle, grad)
            else:
                reduced = self._hook_reduce(handle, grad)
            handle.set_reduced_grad(reduced)
            if handle.has_optim_in_backward:
                handle.step_optimizers_in_backward()

    def _default_reduce(self, handle: FlatParamHandle, grad: Tensor) -> Tensor:
        """Averages over the data-parallel ranks, dividing in two steps (see
        ``_comm.gradient_divide_factors``)."""
        pre, post = _comm.gradient_divide_factors(self._data_parallel_size())
        if pre > 1:
            grad.div_(pre)
        reduced = self._reduce(handle, grad)
        if post > 1:
            reduced.div_(post)
        return reduced

    def _hook_reduce(self, handle: FlatParamHandle, grad: Tensor) -> Tensor:
        """Hands the reduction to the registered hook (see [Note: Communication hooks])."""
        assert self.comm_hook is not None
        if not handle.uses_sharded_strategy:
            self.comm_hook(self.comm_hook_state, grad)
            return grad
        padded, output = self._reduce_scatter_tensors(handle, grad)
        self.comm_hook(self.comm_hook_state, padded, output)
        return output

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
        padded, reduced = self._reduce_scatter_tensors(handle, grad)
        _comm.reduce_scatter(reduced, padded, self.process_group)
        return reduced

    @staticmethod
    def _reduce_scatter_tensors(handle: FlatParamHandle, grad: Tensor) -> tuple[Tensor, Tensor]:
        """The padded unsharded gradient and an empty shard for the result."""
        padded = grad
        if grad.numel() != handle.padded_numel:
            padded = torch.zeros(handle.padded_numel, dtype=grad.dtype, device=grad.device)
            padded[: grad.numel()].copy_(grad)
        return padded, torch.empty(handle.shard_numel, dtype=grad.dtype, device=grad.device)

    def _data_parallel_size(self) -> int:
        replicas = self.replicate_group.size() if self.replicate_group is not None else 1
        return self.world_size * replicas

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
        handle = self.handle
        if handle is not None and handle.backward_missed():
            self._post_backward(handle, in_backward=False)

    def _finalize_unit(self) -> None:
        handle = self.handle
        self.training_state = TrainingState.IDLE
        if handle is None:
            return
        free = self._frees_in_backward()
        if handle.is_unsharded() or (free and handle.holds_unsharded_buffers()):
            self.reshard(handle, free)  # also a copy kept for a backward that never ran
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
        with streams.on_unshard(), profiler_label("FSDP::unshard"):
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
        # An int32 count, as torch's (the collective traces agree).
        missing = torch.tensor(
            [int(sharded is None)], dtype=torch.int32, device=self.compute_device
        )
        _comm.all_reduce(missing, self.process_group)
        if int(missing.item()) == self.world_size:
            handle.use_unsharded_grad(None)
            return
        # Every rank gathers in the gradients' dtype (low precision with
        # keep_low_precision_grads), also one that has none and sends zeros.
        dtype = handle.grad_dtype()
        if sharded is None:
            sharded = torch.zeros_like(handle.flat_param._local_shard, dtype=dtype)
        local = sharded.to(handle.device, dtype).contiguous()
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

    def _get_handle_to_prefetch(self, current_handle: FlatParamHandle) -> FlatParamHandle | None:
        """The handle to unshard ahead of its use now that ``current_handle``'s
        hook runs, by its training state (forward, pre- or post-backward) and this
        unit's prefetch settings; None for none (see [Note: Execution order and
        prefetch] in fsdp._exec_order). The seam tests patch (torch's
        ``_runtime_utils._get_handle_to_prefetch(state, current_handle)``)."""
        order = self.root.exec_order
        training_state = current_handle.training_state
        prefetch = self.config.backward_prefetch
        if (
            training_state is HandleTrainingState.BACKWARD_PRE
            and prefetch is BackwardPrefetch.BACKWARD_PRE
        ) or (
            training_state is HandleTrainingState.BACKWARD_POST
            and prefetch is BackwardPrefetch.BACKWARD_POST
        ):
            candidate = order.backward_candidate(current_handle)
            if candidate is not None and candidate.awaits_backward() and not candidate.prefetched:
                return candidate
        elif training_state is HandleTrainingState.FORWARD and self.config.forward_prefetch:
            candidate = order.forward_candidate(current_handle)
            if candidate is not None and not candidate.prefetched:
                return candidate
        return None

    def _prefetch_after(self, handle: FlatParamHandle) -> None:
        target = self._get_handle_to_prefetch(handle)
        if target is not None:
            self.root.state_of(target).unshard_ahead()

    def unshard_ahead(self) -> torch.cuda.Event | None:
        """Starts this unit's all-gather ahead of its use (a prefetch, or
        ``_unshard``); its own unshard later finds the data ready. Returns the
        event the all-gather's users wait for (CUDA). Nothing is gathered for a
        unit that holds its data already (``NO_SHARD``, kept since forward)."""
        handle = self.handle
        if handle is None:
            return None
        handle.prefetched = True
        if handle.uses_sharded_strategy and not handle.is_unsharded():
            handle.set_force_full_precision(self.full_precision_now())
            with profiler_label("FSDP::prefetch"):
                self.unshard(handle, prefetch=True)
        return handle.pending_unshard_event()

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


def _needs_grad(output: Any) -> bool:
    """Whether any tensor of a forward's output needs a gradient (its backward will run)."""
    if not torch.is_grad_enabled():
        return False
    return any(t.requires_grad for t in _tensors_in(output))


def _tensors_in(tree: Any) -> list[Tensor]:
    """Every tensor of ``tree``, found as ``_apply_to_tensors`` finds them."""
    found: list[Tensor] = []

    def visit(tensor: Tensor) -> Tensor:
        found.append(tensor)
        return tensor

    _apply_to_tensors(visit, tree)
    return found
