"""The lifecycle of one FSDP unit (``FlatParamHandle``, fsdp._flat_param).

[Note: The unit's lifecycle]
One ``UnitState`` says what the unit does now and how far the iteration got
(see [Note: One lifecycle per object] in fsdp._lifecycle for the checking):

    IDLE --forward with grad--> FORWARD --> AWAITING_BACKWARD --pre-backward-->
    PRE_BACKWARD --post-backward--> POST_BACKWARD --end of backward--> IDLE

A forward without grad goes IDLE -> FORWARD -> IDLE. Several forwards before
one backward: from AWAITING_BACKWARD a forward runs as
``FORWARD_BEFORE_BACKWARD`` and returns there; a summon as
``SUMMONED_BEFORE_BACKWARD``. A post-backward without a pre-backward (the
unit's outputs needed no gradient while its parameters got one through another
path) goes to POST_BACKWARD straight. ``UNIT_TRANSITIONS`` lists every move;
``UnitLifecycle`` holds it with the verbs of the unit's hooks, and
``UnitLifecycle.torch_state`` reads it as torch's ``HandleTrainingState``
(``TORCH_STATE``).
"""

from __future__ import annotations

import enum

from fsdp._common import HandleTrainingState
from fsdp._lifecycle import Lifecycle

__all__ = [
    "PREFETCH_TRANSITIONS",
    "TORCH_STATE",
    "UNIT_TRANSITIONS",
    "Prefetch",
    "UnitLifecycle",
    "UnitState",
]


class UnitState(enum.Enum):
    """The unit's lifecycle (see [Note: The unit's lifecycle])."""

    IDLE = enum.auto()
    FORWARD = enum.auto()
    AWAITING_BACKWARD = enum.auto()
    FORWARD_BEFORE_BACKWARD = enum.auto()
    SUMMONED = enum.auto()
    SUMMONED_BEFORE_BACKWARD = enum.auto()
    PRE_BACKWARD = enum.auto()
    POST_BACKWARD = enum.auto()

    # Members are singletons: identity hashing, in C, instead of Enum's
    # hash of the name (the lifecycle checks run on every hook of every unit).
    __hash__ = object.__hash__


_S = UnitState
UNIT_TRANSITIONS: dict[UnitState, frozenset[UnitState]] = {
    _S.IDLE: frozenset({_S.IDLE, _S.FORWARD, _S.SUMMONED, _S.POST_BACKWARD}),
    _S.FORWARD: frozenset({_S.IDLE, _S.AWAITING_BACKWARD}),
    _S.AWAITING_BACKWARD: frozenset(
        {
            _S.IDLE,  # end of a backward that never reached the unit
            _S.FORWARD_BEFORE_BACKWARD,
            _S.SUMMONED_BEFORE_BACKWARD,
            _S.PRE_BACKWARD,
            _S.POST_BACKWARD,
        }
    ),
    _S.FORWARD_BEFORE_BACKWARD: frozenset({_S.AWAITING_BACKWARD}),
    _S.SUMMONED: frozenset({_S.IDLE}),
    _S.SUMMONED_BEFORE_BACKWARD: frozenset({_S.AWAITING_BACKWARD}),
    _S.PRE_BACKWARD: frozenset({_S.POST_BACKWARD, _S.IDLE}),
    _S.POST_BACKWARD: frozenset({_S.IDLE}),
}

# What each state reads as in torch's terms (tests and prefetch look at these).
TORCH_STATE = {
    _S.IDLE: HandleTrainingState.IDLE,
    _S.FORWARD: HandleTrainingState.FORWARD,
    _S.AWAITING_BACKWARD: HandleTrainingState.IDLE,
    _S.FORWARD_BEFORE_BACKWARD: HandleTrainingState.FORWARD,
    _S.SUMMONED: HandleTrainingState.SUMMON_FULL_PARAMS,
    _S.SUMMONED_BEFORE_BACKWARD: HandleTrainingState.SUMMON_FULL_PARAMS,
    _S.PRE_BACKWARD: HandleTrainingState.BACKWARD_PRE,
    _S.POST_BACKWARD: HandleTrainingState.BACKWARD_POST,
}


class Prefetch(enum.Enum):
    """Whether the unit's next unshard was started ahead of its use (see [Note:
    Execution order and prefetch] in fsdp._exec_order), beside ``UnitState``: a
    unit is prefetched in any of its states, and every reshard, the end of
    backward and a root forward with forward prefetch start it afresh."""

    NONE = enum.auto()
    GATHERED = enum.auto()  # the all-gather started (torch's ``_prefetched``)
    # forward prefetch: gathered, and forward's views shown already (see [Note:
    # Forward prefetch shows the views at once] in fsdp._exec_order)
    SHOWN = enum.auto()

    __hash__ = object.__hash__  # see UnitState


_P = Prefetch
PREFETCH_TRANSITIONS: dict[Prefetch, frozenset[Prefetch]] = {
    _P.NONE: frozenset({_P.NONE, _P.GATHERED}),
    _P.GATHERED: frozenset({_P.NONE, _P.GATHERED, _P.SHOWN}),
    _P.SHOWN: frozenset({_P.NONE, _P.SHOWN}),
}


class UnitLifecycle(Lifecycle[UnitState]):
    """The unit's ``UnitState`` and the moves of its hooks (see [Note: The unit's
    lifecycle]); only the unit calls the verbs."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(UnitState.IDLE, UNIT_TRANSITIONS, "FlatParamHandle")

    @property
    def torch_state(self) -> HandleTrainingState:
        return TORCH_STATE[self.state]

    def recomputing_in_backward(self) -> bool:
        """A forward of the unit runs inside its own backward (activation
        checkpointing recomputes it): the unit is already unsharded for it."""
        return self.state is UnitState.PRE_BACKWARD

    def awaits_backward(self) -> bool:
        """Forward ran with grad this iteration and its backward has not started."""
        return self.state is UnitState.AWAITING_BACKWARD

    def backward_missed(self) -> bool:
        """Pre-backward ran but the hooked node never fired (its forward's graph
        was dropped): the end of backward must finish the unit."""
        return self.state is UnitState.PRE_BACKWARD

    def begin_forward(self) -> None:
        if self.state is UnitState.AWAITING_BACKWARD:
            self.move(UnitState.FORWARD_BEFORE_BACKWARD)
        else:
            self.move(UnitState.FORWARD)

    def end_forward(self, awaits_backward: bool) -> None:
        if self.state is UnitState.FORWARD_BEFORE_BACKWARD or awaits_backward:
            self.move(UnitState.AWAITING_BACKWARD)
        else:
            self.move(UnitState.IDLE)

    def begin_backward(self) -> bool:
        """The pre-backward; False when it already ran (or the unit produced
        nothing that needs a gradient), so that it runs once per iteration."""
        if self.state is not UnitState.AWAITING_BACKWARD:
            return False
        self.move(UnitState.PRE_BACKWARD)
        return True

    def end_backward(self) -> None:
        """The post-backward (the gradient is accumulated). Without a pre-backward
        first, the unit's outputs needed no gradient while its parameters got
        one through another path."""
        self.move(UnitState.POST_BACKWARD)

    def begin_summon(self) -> None:
        """Torch's check and message: only an idle unit is summoned."""
        if self.state is UnitState.AWAITING_BACKWARD:
            self.move(UnitState.SUMMONED_BEFORE_BACKWARD)
        elif self.state is UnitState.IDLE:
            self.move(UnitState.SUMMONED)
        else:
            raise AssertionError(
                f"Expects the handle training to be IDLE but got {self.torch_state}"
            )

    def end_summon(self) -> None:
        if self.state is UnitState.SUMMONED_BEFORE_BACKWARD:
            self.move(UnitState.AWAITING_BACKWARD)
        else:
            self.move(UnitState.IDLE)
