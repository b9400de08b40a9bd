"""``summon_full_params``: the full, original parameters for a while.

[Note: Summoning]
Each unit in scope gathers its parameters in full precision (mixed precision
never applies here) and exposes them as ``nn.Parameter`` s under their original
names; the flat parameter is hidden from ``named_parameters()`` and names lose
the wrapper prefix, so the module looks like the unwrapped one. As in torch,
each unit is checked, then summoned, in turn; summoning a unit that is already
summoned raises (a state dict saved or loaded inside a summon is not a summon:
it sees what the summon exposes).

- ``writeback``: on exit each rank copies its part of the (possibly modified)
  parameters back into its shard (and, with ``with_grads``, of the gradients
  into its sharded gradient). ``NO_SHARD`` exposes the real storage, so edits
  persist whatever ``writeback`` says.
- ``rank0_only``: every rank takes part in the all-gather, then ranks other
  than 0 reshard at once and keep seeing their sharded parameters.
- ``offload_to_cpu``: the exposed parameters are CPU copies (written back from
  there).
- ``with_grads`` (``use_orig_params=True`` only): the sharded gradients are
  gathered too and exposed as the original parameters' ``.grad``; if no rank has
  a gradient, every ``.grad`` is None.

[Note: Summoning keeps what forward kept]
A unit whose unsharded parameter forward kept (the root, ``SHARD_GRAD_OP``)
uses it without another all-gather and keeps it on exit, so the backward that
follows needs no all-gather either. Under parameter mixed precision the kept
copy is in low precision: it is freed on entry (it would go stale if the
summoned full-precision parameters were edited), the full-precision copy is
gathered, and freed on exit; the next forward or backward gathers again.
"""

from __future__ import annotations

import contextlib
import warnings
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


def validate_unshard(
    state: FSDPState,
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
) -> None:
    """Torch's checks of the unshard arguments for one unit, in its order and
    with its messages (``summon_full_params`` and the full and sharded state
    dicts, which unshard the same way); the warning about ``offload_to_cpu``
    has torch's text."""
    if with_grads and (offload_to_cpu or not state.config.use_orig_params):
        raise NotImplementedError(
            f"with_grads={with_grads}, use_orig_params={state.config.use_orig_params}, "
            f"offload_to_cpu={offload_to_cpu} is not supported yet"
        )
    if offload_to_cpu and state.handle is not None and not state.handle.uses_sharded_strategy:
        raise NotImplementedError("offload_to_cpu=True and NO_SHARD is not supported yet")
    if writeback and rank0_only:
        raise NotImplementedError("writeback=True and rank0_only=True is not supported yet")
    if offload_to_cpu and not rank0_only:
        warnings.warn(
            "offload_to_cpu=True and rank0_only=False may result in the"
            "unsharded parameters being redundantly copied to CPU memory for GPUs sharing the "
            "same CPU memory, which risks CPU OOM. We recommend using offload_to_cpu=True with "
            "rank0_only=True.",
            stacklevel=1,  # inside the library, where torch's points
        )


def check_can_summon(state: FSDPState) -> None:
    """``summon_full_params`` is not for a unit in forward or backward, nor for
    one that a summon already exposes (torch's errors)."""
    if state.training_state is TrainingState.FORWARD_BACKWARD:
        raise AssertionError("Cannot manually unshard parameters during forward/backward")
    if state.training_state is TrainingState.SUMMON_FULL_PARAMS:
        raise AssertionError(
            "Cannot manually unshard parameters when already unsharding parameters"
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
    entered: list[SummonedUnit] = []
    initialized = False
    try:
        for state in states_in(module, recurse):
            # Torch checks the arguments before and after the unit's own checks
            # (the summon's, then the unshard's), so its warning comes twice;
            # its lazy initialisation comes after the first unit's first check.
            validate_unshard(state, writeback, rank0_only, offload_to_cpu, with_grads)
            if not initialized:
                ensure_initialized(module)
                initialized = True
            check_can_summon(state)
            validate_unshard(state, writeback, rank0_only, offload_to_cpu, with_grads)
            unit = SummonedUnit(state, rank0_only, offload_to_cpu, with_grads)
            entered.append(unit)
            unit.enter()
        yield
    finally:
        for unit in reversed(entered):
            unit.exit(writeback)


class SummonedUnit:
    """One unit while its full parameters are exposed (summon_full_params, state
    dicts, ``apply``); see [Note: Summoning]. A unit that an enclosing
    ``summon_full_params`` already exposes is left as it is (a state dict saved
    or loaded inside the summon reads or writes what the summon exposes)."""

    state: FSDPState
    rank0_only: bool
    offload_to_cpu: bool
    with_grads: bool
    _free_on_exit: bool
    _enclosed: bool  # an enclosing summon exposes the unit: enter and exit do nothing

    def __init__(
        self,
        state: FSDPState,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> None:
        self.state = state
        self.rank0_only = rank0_only
        self.offload_to_cpu = offload_to_cpu
        self.with_grads = with_grads
        self._free_on_exit = True
        self._enclosed = False

    @property
    def _hidden_here(self) -> bool:
        """Ranks other than 0 under ``rank0_only`` keep their shards."""
        return self.rank0_only and self.state.rank != 0

    def enter(self) -> None:
        state = self.state
        if state.training_state is TrainingState.SUMMON_FULL_PARAMS:
            self._enclosed = True
            return
        handle = state.handle
        if handle is not None and handle.training_state is not HandleTrainingState.IDLE:
            raise AssertionError(
                f"Expects the handle training to be IDLE but got {handle.training_state}"
            )
        state.begin_summon()
        if handle is None:
            return
        self._free_on_exit = handle.enter_summon(
            self.with_grads, self.offload_to_cpu, self._hidden_here
        )
        if not self._hidden_here:
            state.hide_flat_param()

    def exit(self, writeback: bool) -> None:
        if self._enclosed:
            return
        state = self.state
        handle = state.handle
        try:
            if handle is None:
                return
            handle.exit_summon(writeback, self._free_on_exit, self._hidden_here)
            if not self._hidden_here:
                state.show_flat_param()
        finally:
            state.end_summon()
