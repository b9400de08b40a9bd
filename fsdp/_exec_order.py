"""The order in which one root's units run forward: for prefetching, and checked across ranks.

[Note: Execution order and prefetch]
Two orders are recorded, as torch's FSDP records them:

- The *pre-forward* order of the first iteration (an iteration ends with the
  root's end of backward), fixed afterwards. Forward prefetch unshards the unit
  after the current one in it.
- The *post-forward* order, recorded again in every iteration (see the next
  note). Backward runs in roughly the reverse order, so backward prefetch
  unshards the unit before the current one in it. The root's forward ends last:
  its pre-backward prefetches the last unit whose forward ended before it, and
  the first unit's forward has nothing before it.

[Note: The post-forward order's positions]
Torch records every forward's end in the post-forward order, with autograd on
or off (a frozen trunk run under ``no_grad`` takes its place in it, and an eval
forward before a training one of the same iteration does too), and the order is
cleared only at the end of backward. Each use appends the unit; its position,
from which backward prefetch looks one back, is that of its first use, except
that a unit placed at position 0 is placed again at its next use (torch tests
the position for truth). A candidate placed by a forward without autograd has no
backward to await, so it is not prefetched (``awaits_backward``, torch's
``_needs_pre_backward_unshard``), and the unit before it is not prefetched
either: recording only the forwards with autograd would skip over the frozen
unit and all-gather the one before it, which torch does not.

A candidate is prefetched only if it still needs its unshard in this pass
(forward: its forward has not run since the root's pre-forward; backward: its
pre-backward has not run) and nothing was prefetched for it since its last
reshard, so a prefetch never adds an all-gather.

[Note: Prefetched units]
An all-gather issued ahead of the unit's own use (a backward prefetch, or
``_unshard``) leaves the flat parameter sharded and the unshard's CUDA event
with the unit; the unit's own unshard then finds the data ready and waits on
it. ``prefetched`` (torch's ``_prefetched``) says that such an unshard was
issued since the last reshard, so that the unit is not chosen for another one;
it is prefetch bookkeeping that any state may carry, not a step of the
lifecycle. A forward prefetch unshards in full instead (see the next note).

[Note: Forward prefetch shows the views at once]
Torch's forward prefetch runs the prefetched unit's whole unshard as if in its
forward: the flat parameter points at the gathered data and the module's
``Tensor`` views of it are made right then, and the unit's own pre-forward
(finding it prefetched) only waits for the all-gather. Autograd records those
views when they are made, before the current unit's computation, and its CPU
engine runs ready nodes newest first: in the backward, the views of a
forward-prefetched unit (and with them its ``AccumulateGrad`` node, its
post-backward hook and reduce-scatter) come after the backward of the unit
that prefetched it. So with ``forward_prefetch=True`` torch's backward issues
the next unit's prefetch all-gather before the reduce-scatter of the unit
whose backward just ran. This project's unit does the same
(``FlatParamHandle.unshard_ahead`` for forward, then ``pre_forward``), so both
issue the same collectives in the same order; the views stay those of the prefetch until the unit's reshard (its
post-forward), a root pre-forward with forward prefetch, or the end of the
iteration.

[Note: Checking the forward order across ranks]
FSDP's collectives only match across ranks when every rank unshards the same
units in the same order. With the DETAIL debug level (see [Note: Environment
switches] in fsdp._common; the root's setting counts) each unshard in a forward
in training mode in the first iteration is checked before it is issued: the
ranks all-gather how many flat parameters they are about to gather (always one
here), then which one (its index in the tree's module order, the same on every
rank), and a difference raises ``RuntimeError("Forward order differs across
ranks: ...")`` on every rank. These are the two extra all-gathers per unshard
that torch issues, and collective counts include them. Later iterations are
compared with the first one's order on each rank alone: the first iteration
that deviates warns (``UserWarning``) at each deviation, and no later
iteration is checked. A forward in eval mode is not checked: no end of backward
marks the end of such an iteration.
"""

from __future__ import annotations

import enum
import itertools
import warnings
from typing import Any

import torch
from torch import nn

from fsdp import _comm, _registry
from fsdp._common import HandleTrainingState, clean_tensor_name
from fsdp._flat_param import FlatParamHandle
from fsdp.api import BackwardPrefetch

_ACROSS_RANKS = "Forward order differs across ranks:"


class _WarnStatus(enum.Enum):
    """Warnings about a forward order that differs from the first iteration's."""

    NONE = enum.auto()  # no deviation yet
    WARNING = enum.auto()  # this iteration deviated: each deviation warns
    WARNED = enum.auto()  # an earlier iteration deviated: no more checks


class ExecutionOrder:
    """The forward orders of one root's tree, and their check (see the module notes)."""

    handles: list[FlatParamHandle]  # every handle of the tree, in module order
    fqns: dict[FlatParamHandle, list[str]]  # original parameter names from the root
    process_group: Any
    rank: int
    world_size: int
    checks_order: bool
    iteration: int
    pre_forward: list[FlatParamHandle]
    post_forward: list[FlatParamHandle]
    _post_forward_index: dict[FlatParamHandle, int]
    _forwarded: set[FlatParamHandle]  # forwards run since the root's pre-forward
    _order_index: int  # the next position in ``pre_forward`` a later iteration should match
    _warn_status: _WarnStatus

    def __init__(
        self,
        handles: list[FlatParamHandle],
        fqns: dict[FlatParamHandle, list[str]],
        process_group: Any,
        checks_order: bool,
    ) -> None:
        self.handles = handles
        self.fqns = fqns
        self.process_group = process_group
        self.rank = process_group.rank()
        self.world_size = process_group.size()
        self.checks_order = checks_order
        self.iteration = 0
        self.pre_forward = []
        self.post_forward = []
        self._post_forward_index = {}
        self._forwarded = set()
        self._order_index = 0
        self._warn_status = _WarnStatus.NONE

    # -- recording ---------------------------------------------------------------------

    def begin_root_forward(self) -> None:
        self._forwarded.clear()

    def record_pre_forward(self, handle: FlatParamHandle, training: bool) -> None:
        """Before ``handle``'s unshard in forward: checks, then records, the order."""
        self._forwarded.add(handle)
        if training and self.checks_order:
            self._check(handle)
        if self.iteration == 0 and handle not in self.pre_forward:
            self.pre_forward.append(handle)

    def record_post_forward(self, handle: FlatParamHandle) -> None:
        """After ``handle``'s forward, with autograd on or off (see [Note: The
        post-forward order's positions])."""
        if self._post_forward_index.get(handle):
            self.post_forward.append(handle)
            return
        self._post_forward_index[handle] = len(self.post_forward)
        self.post_forward.append(handle)

    def next_iteration(self) -> None:
        """At the end of backward."""
        self.iteration += 1
        self.post_forward.clear()
        self._post_forward_index.clear()
        self._order_index = 0
        if self._warn_status is _WarnStatus.WARNING:
            self._warn_status = _WarnStatus.WARNED

    # -- prefetch candidates --------------------------------------------------------------

    def prefetch_candidate(
        self, handle: FlatParamHandle, backward: BackwardPrefetch | None, forward: bool
    ) -> FlatParamHandle | None:
        """The unit to unshard ahead of its use now that ``handle``'s hook runs, by
        ``handle``'s state (forward, pre- or post-backward) and the settings; None
        for none. A candidate that was prefetched already, or (backward) does not
        await its backward, is none."""
        state = handle.training_state
        if (
            state is HandleTrainingState.BACKWARD_PRE and backward is BackwardPrefetch.BACKWARD_PRE
        ) or (
            state is HandleTrainingState.BACKWARD_POST
            and backward is BackwardPrefetch.BACKWARD_POST
        ):
            candidate = self.backward_candidate(handle)
            if candidate is not None and candidate.lifecycle.awaits_backward():
                return None if candidate.prefetched else candidate
        elif state is HandleTrainingState.FORWARD and forward:
            candidate = self.forward_candidate(handle)
            if candidate is not None and not candidate.prefetched:
                return candidate
        return None

    def forward_candidate(self, handle: FlatParamHandle) -> FlatParamHandle | None:
        """The unit after ``handle`` in the first iteration's pre-forward order,
        if its forward has not run yet since the root's pre-forward."""
        if handle not in self.pre_forward:
            return None
        index = self.pre_forward.index(handle) + 1
        if index >= len(self.pre_forward):
            return None
        candidate = self.pre_forward[index]
        return None if candidate in self._forwarded else candidate

    def backward_candidate(self, handle: FlatParamHandle) -> FlatParamHandle | None:
        """The unit before ``handle`` in this iteration's post-forward order."""
        index = self._post_forward_index.get(handle)
        if index is None or index == 0:
            return None
        return self.post_forward[index - 1]

    # -- checking (see [Note: Checking the forward order across ranks]) ---------------------

    def _check(self, handle: FlatParamHandle) -> None:
        if self.iteration == 0:
            self._check_across_ranks(handle)
        elif self._warn_status is not _WarnStatus.WARNED:
            self._check_against_first_iteration(handle)

    def _gather(self, values: list[int], device: torch.device) -> list[list[int]]:
        """Every rank's ``values`` (the same length on every rank), in rank order."""
        local = torch.tensor(values, dtype=torch.int32, device=device)
        gathered = torch.zeros(self.world_size * len(values), dtype=torch.int32, device=device)
        _comm.all_gather(gathered, local, self.process_group)
        return [chunk.tolist() for chunk in gathered.cpu().split(len(values))]

    def _check_across_ranks(self, handle: FlatParamHandle) -> None:
        counts = self._gather([1], handle.device)
        for (r1, n1), (r2, n2) in itertools.combinations(enumerate(counts), 2):
            if n1 != n2:
                raise RuntimeError(
                    f"{_ACROSS_RANKS} rank {r1} is all-gathering {n1[0]} parameters "
                    f"while rank {r2} is all-gathering {n2[0]} parameters"
                )
        indices = self._gather([self.handles.index(handle)], handle.device)
        for (r1, i1), (r2, i2) in itertools.combinations(enumerate(indices), 2):
            if i1 != i2:
                raise RuntimeError(
                    f"{_ACROSS_RANKS} rank {r1} is all-gathering parameters for "
                    f"{self._names(i1)} while rank {r2} is all-gathering parameters for "
                    f"{self._names(i2)}"
                )

    def _names(self, indices: list[int]) -> list[list[str]]:
        return [self.fqns[self.handles[i]] for i in indices if 0 <= i < len(self.handles)]

    def _check_against_first_iteration(self, handle: FlatParamHandle) -> None:
        prefix = None
        if self._order_index >= len(self.pre_forward):
            prefix = (
                "Expected to not all-gather any more parameters in the forward but trying "
                "to all-gather parameters for "
            )
        elif (expected := self.pre_forward[self._order_index]) is not handle:
            prefix = (
                f"Expected to all-gather for {[self.fqns[expected]]} but trying to all-gather "
                "parameters for "
            )
        if prefix is not None:
            names = [self.fqns[handle]] if handle in self.fqns else []
            suffix = f"{names}" if names else "a newly-added parameter since construction time"
            warnings.warn(
                f"Forward order differs from that of the first iteration on rank {self.rank}. "
                f"Collectives are unchecked and may give incorrect results or hang.\n"
                f"{prefix}{suffix}",
                stacklevel=2,
            )
            self._warn_status = _WarnStatus.WARNING
        self._order_index += 1


def fqns_from_root(root: nn.Module) -> dict[FlatParamHandle, list[str]]:
    """Each handle's original parameter names as seen from the root (no wrapper prefixes)."""
    fqns: dict[FlatParamHandle, list[str]] = {}
    for name, module in root.named_modules():
        state = _registry.state_of(module)
        if state is None or state.handle is None or state.handle in fqns:
            continue
        prefix = clean_tensor_name(f"{name}.") if name else ""
        fqns[state.handle] = [prefix + fqn for fqn in state.handle.fqns]
    return fqns
