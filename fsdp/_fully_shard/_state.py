"""The per-module state of ``fully_shard``: its hooks, and the tree of states
under the root.

[Note: One iteration of fully_shard]
- Root pre-forward (the first state whose forward runs in an iteration): the
  tree is set up once (``lazy_init``: which state is the root, the parameter
  names, the shared streams, each group's checks and dtypes), the unshard
  stream waits for the optimizer (or for ``set_post_optim_event``'s event) and,
  on an accelerator, the inputs move to the device.
- Each state's pre-forward casts the inputs (``mp_policy``), has its group
  unshard, and issues the explicit forward prefetches
  (``set_modules_to_forward_prefetch``).
- Post-forward: the group reshards (``reshard_after_forward``), the outputs that
  need a gradient get a hook that runs the state's pre-backward, and the outputs
  are cast to ``output_dtype``.
- Pre-backward (the first gradient reaching an output) queues the root's
  end-of-backward callback once, unshards, and prefetches: implicitly the group
  that ran before in forward, or the explicit ``set_modules_to_backward_prefetch``.
- Post-backward: see fsdp._fully_shard._param_group.
- End of backward (the callback): groups whose post-backward did not run are
  finished, every group goes idle, and after the last backward
  (``set_is_last_backward``) the current stream waits for the reductions.

A forward that runs during backward (activation checkpointing recomputing a
module whose group is in its pre-backward) only unshards and casts.

[Note: Which module holds which state]
A weak registry maps each module ``fully_shard`` was applied to to its state;
the module keeps the state alive through its forward hooks, which are the
state's methods, and the state refers back to the module (as in
fsdp._registry, which holds our FSDP1 states: a registry that held the state
strongly would keep the module alive for ever).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd import Variable

from fsdp._common import profiler_label
from fsdp._fully_shard._api import MixedPrecisionPolicy
from fsdp._fully_shard._lifecycle import Phase
from fsdp._fully_shard._mesh import logger
from fsdp._fully_shard._param_group import CommContext, ParamGroup
from fsdp._utils import _apply_to_tensors, cast_floats, to_device

__all__ = ["FullyShardState", "TreeContext", "state_of"]

_STATES: weakref.WeakKeyDictionary[nn.Module, weakref.ReferenceType[FullyShardState]] = (
    weakref.WeakKeyDictionary()
)


def state_of(module: nn.Module) -> FullyShardState | None:
    """The ``fully_shard`` state of ``module``, or None."""
    ref = _STATES.get(module)
    return ref() if ref is not None else None


def _eager(fn: Any) -> Any:
    """Hooks run eagerly under ``torch.compile`` (see [Note: FSDP under
    torch.compile] in fsdp._runtime)."""
    return torch._disable_dynamo(fn, recursive=True)


class TreeContext:
    """What the states of one root's tree share across an iteration."""

    states: list[FullyShardState]
    iter_forward_root: FullyShardState | None
    callback_queued: bool
    is_last_backward: bool
    post_optim_event: torch.Event | None

    def __init__(self) -> None:
        self.states = []
        self.iter_forward_root = None
        self.callback_queued = False
        self.is_last_backward = True
        self.post_optim_event = None

    @property
    def all_states(self) -> list[FullyShardState]:
        """torch's name for ``states`` (upstream's tests read it)."""
        return self.states


class FullyShardState:
    """The hooks of one ``fully_shard`` module and its place in the tree (see
    [Note: One iteration of fully_shard])."""

    modules: tuple[nn.Module, ...]  # several for fully_shard([a, b])
    group: ParamGroup | None
    device: torch.device
    mp_policy: MixedPrecisionPolicy
    auto_reshard_after_forward: bool
    is_root: bool | None  # None until the tree is set up
    tree: TreeContext
    comm: CommContext
    forward_prefetch: list[FullyShardState]
    backward_prefetch: list[FullyShardState]
    _to_run: set[nn.Module]  # a group of several modules: those yet to run this forward

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        device: torch.device,
        mp_policy: MixedPrecisionPolicy,
        auto_reshard_after_forward: bool,
    ) -> None:
        self.modules = modules
        self.group = None
        self.device = device
        self.mp_policy = mp_policy
        self.auto_reshard_after_forward = auto_reshard_after_forward
        self.is_root = None
        self.tree = TreeContext()
        self.comm = CommContext(device)
        self.forward_prefetch = []
        self.backward_prefetch = []
        self._to_run = set()
        for module in modules:
            _STATES[module] = weakref.ref(self)
            module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            if len(modules) == 1:
                module.register_forward_hook(self._post_forward, prepend=False)
            else:
                module.register_forward_hook(
                    self._grouped_post_forward, prepend=False, always_call=True
                )

    @property
    def module(self) -> nn.Module:
        """The module (the first, for a group of several)."""
        return self.modules[0]

    # torch's private names for the tree, which upstream's tests read
    # (``fully_shard.state(m)._lazy_init()``, ``._is_root``, ...)
    def _lazy_init(self) -> None:
        self.lazy_init()

    @property
    def _is_root(self) -> bool | None:
        return self.is_root

    @property
    def _state_ctx(self) -> TreeContext:
        return self.tree

    @property
    def _fsdp_param_group(self) -> ParamGroup | None:
        return self.group

    def set_group(self, group: ParamGroup) -> None:
        self.group = group
        group.comm = self.comm

    # ------------------------------------------------------------ the tree

    def lazy_init(self) -> None:
        """Sets up the tree under this state when it is the first to run (no-op
        after). Raises when a state under it ran first."""
        if self.is_root is not None:
            return
        self.is_root = True
        if len(self.modules) > 1:
            raise RuntimeError(f"FSDP requires a single root module but got {self.modules}")
        self._collect_tree()
        if self.auto_reshard_after_forward and self.group is not None:
            self.group.post_forward_info = None  # the root's parameters are used again at once
        self._share_with_tree()
        self._init_names()
        self._check_no_shared_params()
        for state in self.tree.states:
            if state.group is not None:
                state.group.lazy_init()

    def _collect_tree(self) -> None:
        """The states under this one, in module order, marked as not roots."""
        seen: set[FullyShardState] = set()
        for name, module in self.module.named_modules():
            state = state_of(module)
            if state is None or state in seen:
                continue
            if module is not self.module:
                if state.is_root is not None:
                    raise RuntimeError(
                        f"FSDP state has already been lazily initialized for {name}\n"
                        "FSDP requires running forward through the root module first"
                    )
                state.is_root = False
            seen.add(state)
            self.tree.states.append(state)

    def _share_with_tree(self) -> None:
        for state in self.tree.states:
            state.tree, state.comm = self.tree, self.comm
            if state.group is not None:
                state.group.comm = self.comm

    def _init_names(self) -> None:
        by_param = {p.sharded_param: p for s in self.tree.states if s.group for p in s.group.params}
        for name, param in self.module.named_parameters():
            if param in by_param:
                by_param[param].fqn = name
        for name, module in self.module.named_modules():
            state = state_of(module)
            if state is not None and state.group is not None and module in state.modules:
                state.group.fqn = f"{state.group.fqn}, {name}" if state.group.fqn else name

    def _check_no_shared_params(self) -> None:
        seen: set[int] = set()
        for state in self.tree.states:
            for param in state.group.params if state.group else ():
                if param.orig_uid in seen:
                    raise ValueError(
                        f"Parameter '{param.fqn}' is shared with a parameter already managed "
                        "by another FSDP group. For shared/tied parameters, use "
                        "fully_shard([module_a, module_b]) to place them in the same FSDP group."
                    )
                seen.add(param.orig_uid)

    # ------------------------------------------------------------ forward

    def in_backward(self) -> bool:
        """A forward during this state's backward (activation checkpointing)."""
        return self.group is not None and self.group.phase is Phase.PRE_BACKWARD

    @_eager
    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return self.pre_forward(module, args, kwargs)

    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        group = self.group
        if self.in_backward():
            assert group is not None
            if not group.is_unsharded:
                group.unshard()
                group.wait_for_unshard()
            return self._cast_inputs(args, kwargs)
        first = group is None or group.phase is not Phase.FORWARD  # a group's first module
        if len(self.modules) > 1 and not self._to_run:
            self._to_run.update(self.modules)
        if first:
            args, kwargs = self._root_pre_forward(args, kwargs)
        args, kwargs = self._cast_inputs(args, kwargs)
        if group is not None:
            args, kwargs = group.pre_forward(module, args, kwargs)
        if first:
            for state in self.forward_prefetch:
                if state.group is not None:
                    state.group.prefetch(backward=False)
        return args, kwargs

    def _root_pre_forward(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self.lazy_init()
        tree = self.tree
        if tree.iter_forward_root is not None:
            return args, kwargs
        logger.debug("FSDP::root_pre_forward")
        tree.iter_forward_root = self
        streams = self.comm.streams
        if tree.post_optim_event is not None:
            streams.unshard_waits(tree.post_optim_event)
            tree.post_optim_event = None
        else:
            streams.unshard_waits_for_compute()
        if self.device.type != "cpu" and (args or kwargs):
            args, kwargs = to_device(self.device, args, kwargs)
        return args, kwargs

    def _cast_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        dtype = self.mp_policy.param_dtype
        if not self.mp_policy.cast_forward_inputs or dtype is None:
            return args, kwargs
        return cast_floats(dtype, args, kwargs)

    @_eager
    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        return self.post_forward(module, output)

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.in_backward():
            return self._cast_output(output)
        if self.group is not None:
            output = self.group.post_forward(module, output)
        output = self._register_pre_backward(output)
        if self.tree.iter_forward_root is self:
            output = self._complete_partial_groups(output)
            self.tree.iter_forward_root = None
        return self._cast_output(output)

    @_eager
    def _grouped_post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        """A module of ``fully_shard([a, b])``: the last of them to run this forward
        runs the post-forward; the others only cast their outputs."""
        if module in self._to_run:
            self._to_run.remove(module)
            if not self._to_run:
                return self.post_forward(module, output)
        return self._cast_output(output)

    def _complete_partial_groups(self, output: Any) -> Any:
        """At the end of the root's forward: the groups of several modules not all
        of which ran (a head called later, per chunk) finish their post-forward,
        innermost first."""
        for state in reversed(self.tree.states):
            if state is self or not state._to_run:
                continue
            logger.debug("FSDP::force_complete_post_forward")
            if state.group is not None:
                output = state.group.post_forward(None, output)
            output = state._cast_output(state._register_pre_backward(output))
            state._to_run.clear()
        return output

    def _cast_output(self, output: Any) -> Any:
        dtype = self.mp_policy.output_dtype
        if dtype is None:
            return output

        def cast(t: Tensor) -> Tensor:
            return t.to(dtype) if torch.is_floating_point(t) and t.dtype != dtype else t

        return _apply_to_tensors(cast, output)

    def _register_pre_backward(self, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return output

        def hook(t: Tensor) -> Tensor:
            if t.requires_grad:
                if t._base is not None:
                    self._warn_view_output()
                t.register_hook(self._pre_backward)
            return t

        return _apply_to_tensors(hook, output)

    def _warn_view_output(self) -> None:
        # An in-place op on a view replaces its grad_fn, and the hook with it
        warnings.warn(
            f"FSDP2-wrapped module ({type(self.module).__name__}) returned a view tensor. "
            "An in-place op on this view (e.g., `x += y`) will silently drop the pre-backward "
            "hook and skip the all-gather, which can cause backward to fail or produce wrong "
            "gradients. Use out-of-place ops (`out = out + y`, not `out += y`) or `.clone()` "
            "the output before any in-place op.",
            UserWarning,
            stacklevel=4,
        )

    # ------------------------------------------------------------ backward

    @_eager
    def _pre_backward(self, grad: Tensor) -> Tensor:
        self._queue_end_of_backward()
        if self.group is not None:
            self.group.pre_backward(default_prefetch=not self.backward_prefetch)
        for state in self.backward_prefetch:
            if state.group is not None:
                state.group.prefetch(backward=True)
        return grad

    def _queue_end_of_backward(self) -> None:
        root = self.tree.states[0] if self.tree.states else self
        if self.tree.callback_queued:
            return
        self.tree.callback_queued = True
        Variable._execution_engine.queue_callback(functools.partial(_end_of_backward, root))

    @_eager
    def end_of_backward(self) -> None:
        """The root's callback after backward (see [Note: One iteration of fully_shard])."""
        tree = self.tree
        tree.iter_forward_root = None
        for state in tree.states:
            state._to_run.clear()
            if state.group is None:
                continue
            state.group.end_backward()
            if tree.is_last_backward:
                state.group.finalize_backward()
        if tree.is_last_backward:
            self.comm.post_forward_order.clear()
            self._wait_for_reductions()
        tree.callback_queued = False

    def _wait_for_reductions(self) -> None:
        streams = self.comm.streams
        streams.compute_waits_for_reduce()
        if any(s.group is not None and s.group.offloads for s in self.tree.states):
            streams.synchronize()  # the CPU gradients' copies, before the optimizer reads them

    def reset_iter_state(self) -> None:
        if self.is_root is False:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")
        self.comm.post_forward_order.clear()
        for state in self.tree.states or [self]:
            if state.group is not None:
                state.group.reset_iter_state()
        self.tree.iter_forward_root = None
        self.tree.callback_queued = False


def _end_of_backward(root: FullyShardState) -> None:
    logger.debug("FSDP::root_post_backward")
    with profiler_label("FSDP::root_post_backward_callback"):
        root.end_of_backward()
