"""``summon_full_params``: the full, original parameters for a while.

[Note: Summoning]
Each unit in scope all-gathers its parameters in full precision (mixed
precision never applies here) and exposes them as ``nn.Parameter`` s under their
original names; the flat parameter is hidden from ``named_parameters()`` and
names lose the wrapper prefix, so the module looks like the unwrapped one. On
exit, with ``writeback`` each rank copies its part of the (possibly modified)
parameters back into its shard, then every unit reshards completely: a copy
kept since forward (no-reshard strategies) is dropped and rebuilt when needed,
so it can never be stale. Units already summoned by an enclosing call are left
to it. ``rank0_only`` unshards on rank 0 only; ``offload_to_cpu`` exposes CPU
copies (no writeback then); ``with_grads`` also exposes unsharded gradients
(``use_orig_params=True`` only; the sharded gradients are untouched).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from fsdp import _registry
from fsdp._common import HandleTrainingState, TrainingState
from fsdp._runtime import FSDPState


def states_in(module: nn.Module, recurse: bool) -> list[FSDPState]:
    if not recurse:
        state = _registry.state_of(module)
        return [state] if state is not None else []
    states: list[FSDPState] = []
    for submodule in module.modules():
        state = _registry.state_of(submodule)
        if state is not None and state not in states:
            states.append(state)
    return states


def ensure_initialized(module: nn.Module) -> None:
    """Lazily initialises the FSDP trees rooted in ``module`` (outermost units first)."""
    for state in states_in(module, recurse=True):
        if state.is_root is None:
            state.lazy_init()


def _validate(
    states: list[FSDPState],
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
) -> None:
    for state in states:
        if state.training_state is TrainingState.FORWARD_BACKWARD:
            raise AssertionError("Cannot manually unshard parameters during forward/backward")
        if with_grads and (offload_to_cpu or not state.config.use_orig_params):
            raise NotImplementedError(
                f"with_grads={with_grads}, use_orig_params={state.config.use_orig_params}, "
                f"offload_to_cpu={offload_to_cpu} is not supported yet"
            )
    if writeback and rank0_only:
        raise NotImplementedError(
            "writeback=True and rank0_only=True is not supported, as model parameter shapes will "
            "be different across ranks, and writing to them can lead to inconsistencies across "
            "ranks when the context is exited."
        )


@contextlib.contextmanager
def summon_full_params(
    module: nn.Module,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    ensure_initialized(module)
    states = [
        s
        for s in states_in(module, recurse)
        if s.training_state is not TrainingState.SUMMON_FULL_PARAMS
    ]
    _validate(states, writeback, rank0_only, offload_to_cpu, with_grads)
    entered: list[FSDPState] = []
    try:
        for state in states:
            entered.append(state)
            expose_full_params(state, rank0_only, offload_to_cpu, with_grads)
        yield
    finally:
        for state in reversed(entered):
            restore_sharded(state, writeback and not offload_to_cpu, rank0_only)


def expose_full_params(
    state: FSDPState,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> None:
    """Unshards ``state``'s unit in full precision and exposes the original
    parameters under their names (summon_full_params, state dicts)."""
    state.training_state = TrainingState.SUMMON_FULL_PARAMS
    handle = state.handle
    if handle is None:
        return
    handle._training_state = HandleTrainingState.SUMMON_FULL_PARAMS
    handle.set_force_full_precision(True)
    # Outside forward nothing else orders the all-gather after the optimizer
    # step or a writeback on the current stream (see fsdp._streams).
    state.root.streams.unshard_waits_for_compute()
    state.unshard(handle)
    state.wait_for_unshard(handle)
    if with_grads:
        state.unshard_grad(handle)
    if rank0_only and state.rank != 0:
        return
    if offload_to_cpu:
        handle.flat_param.data = handle.flat_param.data.cpu()
    state.hide_flat_param()
    handle._use_unsharded_views(as_params=True)


def restore_sharded(state: FSDPState, writeback: bool, rank0_only: bool = False) -> None:
    """Undoes ``expose_full_params``: writes back (when asked), reshards."""
    handle = state.handle
    try:
        if handle is None:
            return
        if writeback:
            handle.writeback_unsharded()
        if not handle._use_orig_params and not (rank0_only and state.rank != 0):
            handle._use_unsharded_views(as_params=False)
        state.reshard(handle, free=True)
        handle.drop_unsharded_grad()
        state.show_flat_param()
        handle.set_force_full_precision(False)
        handle._training_state = HandleTrainingState.IDLE
    finally:
        state.training_state = TrainingState.IDLE
