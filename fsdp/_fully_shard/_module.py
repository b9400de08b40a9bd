"""``FSDPModule``: the class ``fully_shard`` puts in front of a module's own, and
the functions around it (``UnshardHandle``, ``register_fsdp_forward_method``,
``share_comm_ctx``).

[Note: The class swap]
``fully_shard(module)`` changes ``module.__class__`` to ``FSDP<Class>``, a
subclass of ``FSDPModule`` and of the module's class (one per class, kept), so
``isinstance(module, FSDPModule)`` holds and the methods below are the
module's. Constructing that class (``nn.Sequential`` slicing does
``type(self)(...)``) builds the original class instead: a new module is not
sharded. A sharded module cannot be deep-copied (its state dict is the way).
``_apply`` (``.to()``, ``to_empty()``) reshards first, then re-reads every
sharded parameter.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from fsdp import _comm
from fsdp._fully_shard._param_group import ParamGroup
from fsdp._fully_shard._state import FullyShardState, state_of

__all__ = ["FSDPModule", "UnshardHandle", "register_fsdp_forward_method", "share_comm_ctx"]


class FSDPModule:
    """The methods a ``fully_shard`` module gains (see [Note: The class swap])."""

    # FSDP<Class>.__mro__ is (FSDP<Class>, FSDPModule, Class, ...)
    _orig_cls_mro_index: int = 2

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        orig_cls = cls.__mro__[cls._orig_cls_mro_index]
        module = orig_cls.__new__(orig_cls, *args, **kwargs)
        module.__init__(*args, **kwargs)
        return module

    def _get_fsdp_state(self) -> FullyShardState:
        state = state_of(self)  # type: ignore[arg-type]
        if state is None:
            raise AssertionError(f"No FSDP state found on {self}")
        return state

    def _groups(self) -> list[ParamGroup]:
        group = self._get_fsdp_state().group
        return [group] if group is not None else []

    def _subtree_groups(self, recurse: bool) -> Iterator[ParamGroup]:
        modules = list(self.modules()) if recurse else [self]  # type: ignore[attr-defined]
        for module in modules:
            if isinstance(module, FSDPModule):
                yield from module._groups()

    # ------------------------------------------------------------ residence

    def reshard(self) -> None:
        """Reshards the module's parameters: the sharded DTensors are registered
        and the unsharded parameters freed. Not recursive."""
        for group in self._groups():
            group.reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gathers the module's parameters (in ``param_dtype``). Not recursive.
        With ``async_op`` returns a handle to wait on (the module's pre-forward
        waits if nobody did); else waits and returns None."""
        groups = self._groups()
        for group in groups:
            group.lazy_init()
            # the shards may have just been written (an optimizer step, a load) on
            # the current stream: unlike the hooks' all-gathers, an explicit one waits
            group.comm.streams.unshard_waits_for_compute()
            group.unshard(async_op)
        handle = _UnshardHandleImpl(groups)
        if async_op:
            return handle
        handle.wait()
        return None

    def reset_iter_state(self) -> None:
        """After an exception aborted forward or backward: reshards every group of
        the tree and forgets the iteration (its gradients are lost). Call on the root."""
        self._get_fsdp_state().reset_iter_state()

    # ------------------------------------------------------------ gradients

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last before the optimizer step: the
        last one waits for the gradient reductions and clears prefetch state."""
        self._get_fsdp_state().tree.is_last_backward = is_last_backward

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Whether gradients are reduced (reduce-scatter and, for HSDP, all-reduce);
        without, they accumulate unsharded (FSDP1's ``no_sync``)."""
        for group in self._subtree_groups(recurse):
            group.reduce_grads = group.all_reduce_grads = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: whether the reduce-scattered gradients are all-reduced across
        replicas now (else kept and added to the next backward's)."""
        for group in self._subtree_groups(recurse):
            group.all_reduce_grads = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether parameters are resharded after forward (this also applies to
        the root, which by default keeps them)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}"
            )
        modules = list(self.modules()) if recurse else [self]  # type: ignore[attr-defined]
        for module in modules:
            if isinstance(module, FSDPModule):
                state = module._get_fsdp_state()
                state.auto_reshard_after_forward = False
                for group in module._groups():
                    group.post_forward_info = group.mesh_info if reshard_after_forward else None

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Whether parameters are resharded after backward (keeping them saves the
        next forward's all-gather, e.g. between microbatches)."""
        for group in self._subtree_groups(recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divides the reduced gradients by ``factor`` instead of the data-parallel size."""
        for group in self._groups():
            group.gradient_divide_factor = factor

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in torch for ``set_gradient_divide_factor``; the same."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with sums only, dividing before and after instead of ``AVG`` /
        ``PREMUL_SUM``."""
        for group in self._groups():
            group.force_sum_reduction_for_comms = enable

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Whether parameters without a gradient this backward are reduced as
        zeros, so ranks that used different parameters issue the same collective."""
        for group in self._subtree_groups(recurse):
            group.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_all_reduce_hook(
        self, hook: Callable[[Tensor], None], *, stream: torch.cuda.Stream | None = None
    ) -> None:
        """``hook(output)`` runs on each reduced gradient buffer (after the HSDP
        all-reduce, or after the reduce-scatter), before the final division; on
        ``stream`` when given (not with HSDP), else on the reduce stream."""
        for group in self._groups():
            group.all_reduce_hook = hook
            if stream is not None:
                if group.mesh_info.is_hsdp:
                    raise ValueError("stream cannot be set when using native HSDP")
                group.all_reduce_hook_stream = stream

    # ------------------------------------------------------------ prefetch and streams

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """The modules whose all-gathers this module's pre-forward issues."""
        _assert_all_fsdp_modules(modules)
        self._get_fsdp_state().forward_prefetch = [m._get_fsdp_state() for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """The modules whose all-gathers this module's pre-backward issues
        (instead of the implicit previous module)."""
        _assert_all_fsdp_modules(modules)
        self._get_fsdp_state().backward_prefetch = [m._get_fsdp_state() for m in modules]

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The event the root's next pre-forward makes the all-gathers wait for,
        instead of everything issued so far on the current stream (once)."""
        self._get_fsdp_state().tree.post_optim_event = event

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward needs this module's parameters (an embedding's does not)."""
        for group in self._groups():
            group.unshard_in_backward = unshard_in_backward

    # ------------------------------------------------------------ communication

    def set_custom_all_gather(self, comm: Any) -> None:
        """All-gathers through ``comm`` (torch's ``AllGather`` interface: its
        ``allocate`` gives the buffer, its call runs the collective)."""
        for group in self._groups():
            group.comms.all_gather = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Reduce-scatters through ``comm`` (torch's ``ReduceScatter`` interface)."""
        for group in self._groups():
            group.comms.reduce_scatter = comm

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Collective buffers from the process group's own allocator, where its
        backend has one (NCCL's, for zero-copy transfers); not with custom comms."""
        for group in self._groups():
            for name in ("all_gather", "reduce_scatter"):
                custom = getattr(group.comms, name)
                if custom is not None:
                    label = name.replace("_", " ")
                    raise AssertionError(
                        "cannot call set_allocate_memory_from_process_group() "
                        f"when {label} comm is custom: {type(custom).__name__}"
                    )
            group.comms.from_group = enable

    def set_symm_mem_for_comm(self, backend: Literal["NCCL"] = "NCCL") -> None:
        """Symmetric-memory all-gather buffers: not provided by this implementation."""
        raise NotImplementedError(
            f"set_symm_mem_for_comm({backend!r}): symmetric-memory collective buffers are "
            "not supported by this fully_shard"
        )

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Reduce-scatters on a process group of its own over the shard ranks (one
        per set of ranks), so it can overlap the all-gathers; ``False`` goes back
        to the shard group. Every rank of the mesh must call it alike."""
        made: dict[tuple[int, ...], ProcessGroup] = {}
        for group in self._subtree_groups(recurse):
            if not enable:
                group.reduce_scatter_group = None
                continue
            ranks = tuple(_comm.group_ranks(group.mesh_info.shard_group))
            if ranks not in made:
                made[ranks] = group.reduce_scatter_group or _comm.new_group(
                    list(ranks), use_local_synchronization=True
                )
            group.reduce_scatter_group = made[ranks]

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """Torch's cap on reduce-scatter input buffers in flight. Accepted and
        checked; here a reduce-scatter's input is handed back to the allocator
        recorded on the reduce stream, never waited for by the compute stream, so
        no cap applies (as with an unlimited one)."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for group in self._subtree_groups(recurse):
            group.reduce_scatter_max_input_buffers = max_input_buffers

    def _set_unshard_async_op(self, async_op: bool) -> None:
        for module in self.modules():  # type: ignore[attr-defined]
            if isinstance(module, FSDPModule):
                for group in module._groups():
                    group.unshard_async_op = async_op

    # ------------------------------------------------------------ nn.Module

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        self.reshard()
        result = super()._apply(*args, **kwargs)  # type: ignore[misc]
        for group in self._groups():
            for param in group.params:
                param.reset_sharded_param()
        return result


class UnshardHandle:
    """What ``FSDPModule.unshard(async_op=True)`` returns."""

    def wait(self) -> None:
        """Makes the current stream wait for the all-gather and registers the
        unsharded parameters on the module."""
        return


class _UnshardHandleImpl(UnshardHandle):
    _groups: list[ParamGroup] | None

    def __init__(self, groups: list[ParamGroup]) -> None:
        self._groups = groups or None

    def wait(self) -> None:
        if self._groups is not None:
            for group in self._groups:
                group.wait_for_unshard()
            self._groups = None


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Makes ``module.<method_name>`` run the module's pre- and post-forward
    (unshard before, reshard after) as ``forward`` does. A no-op for a module
    that is not an ``FSDPModule``."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    method = getattr(module, method_name)

    @functools.wraps(method)
    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = self._get_fsdp_state()  # type: ignore[operator]
        args, kwargs = state.pre_forward(self, args, kwargs)
        return state.post_forward(self, method(*args, **kwargs))

    setattr(module, method_name, wrapped.__get__(module, type(module)))


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Lets several roots (pipeline stages) share one set of streams."""
    if not modules:
        return
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects list of FSDPModules but got {module}")
    states = [m._get_fsdp_state() for m in modules]
    for state in states[1:]:
        state.comm = states[0].comm
        if state.group is not None:
            state.group.comm = states[0].comm


def _assert_all_fsdp_modules(modules: Any) -> None:
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects FSDPModule but got {type(module)}: {module}")
