"""The lifecycle of a parameter group: where its parameters are, and how far the
iteration got.

[Note: A parameter group's lifecycle]
A ``ParamGroup`` (one per ``fully_shard`` call) holds two checked lifecycles
(``fsdp._lifecycle.Lifecycle``), each an enum with its transition table below,
moved only by the group's own methods:

``Residence``, what the module's parameters are:

    SHARDED --unshard--> GATHERING --wait_for_unshard--> UNSHARDED
    UNSHARDED --reshard--> SHARDED                       (reshard_after_forward=True,
                                                          after backward, reshard())
    UNSHARDED --reshard after forward--> SHARDED_POST_FORWARD --unshard--> GATHERING
                                                         (reshard_after_forward=int)

A reshard while an all-gather is pending keeps it (GATHERING stays; see [Note:
A pending all-gather outlives a reshard]); a reshard of a group that is sharded
already is a move to the same state. The end of the last backward drops a
prefetch nobody waited for and leaves the parameters where the all-gather found
them (GATHERING -> SHARDED or SHARDED_POST_FORWARD), as torch's
``finalize_backward`` does.

[Note: A pending all-gather outlives a reshard]
torch's ``FSDPParamGroup.reshard`` leaves a pending all-gather alone, and the
next ``unshard`` is a no-op while one is pending: a backward prefetch of a group
whose backward never runs (a frozen module), after a backward that is not the
last (``set_is_last_backward(False)``), or an ``unshard(async_op=True)``
followed by ``reshard()``, is copied out by the next forward without a new
all-gather. This group does the same: the same collectives as torch's. A
state-dict load is the exception: it discards the pending all-gather (the
load's pre-hook, ``discard_pending``), as its values are about to be replaced.
torch's keeps it and its next forward computes with the parameters from before
the load (a defect of torch's: ``STALE_ALL_GATHER_AFTER_LOAD`` in
fsdptest.fsdp2search.check). Writes the group cannot see (an optimizer step
or an in-place edit of a parameter between the reshard and the next forward)
are the user's to avoid, as with torch's; the frozen modules whose prefetch
survives have no optimizer updates.

``Phase``, the iteration as this group sees it:

    IDLE --pre_forward--> FORWARD --post_forward--> IDLE
    IDLE --pre_backward--> PRE_BACKWARD --post_backward--> POST_BACKWARD --end--> IDLE

The modules of one ``fully_shard([a, b])`` each run a pre-forward
(FORWARD -> FORWARD after the first); when some of them run again after the
root's forward (a head called per chunk), the group's forward never completes
and its backward starts from there (FORWARD -> POST_BACKWARD). A module used twice before one backward has two post-backwards
(POST_BACKWARD -> POST_BACKWARD) and may run its second pre-backward after its
first post-backward (POST_BACKWARD -> PRE_BACKWARD). A group whose backward
never ran a pre-backward (its outputs needed no gradient) is finished at the
end of backward straight from IDLE (IDLE -> POST_BACKWARD), and a group's
backward can end while it waits for a gradient that never came
(PRE_BACKWARD -> IDLE). A forward during backward (activation checkpointing's
recomputation) goes IDLE -> FORWARD -> IDLE. The two lifecycles are apart
because they move apart: the user reshards, unshards and prefetches in any
phase, and a phase (IDLE) holds any residence.
"""

from __future__ import annotations

import enum

__all__ = ["PHASE_TRANSITIONS", "RESIDENCE_TRANSITIONS", "Phase", "Residence"]


class Residence(enum.Enum):
    """What the module's parameters are (see [Note: A parameter group's lifecycle])."""

    SHARDED = enum.auto()  # the sharded DTensors are registered
    GATHERING = enum.auto()  # an all-gather is in flight (or done, not yet copied out)
    UNSHARDED = enum.auto()  # the unsharded parameters are registered
    SHARDED_POST_FORWARD = enum.auto()  # resharded to the smaller post-forward mesh

    __hash__ = object.__hash__  # singletons: identity hashing (checked on every hook)


class Phase(enum.Enum):
    """How far the iteration got, for this group."""

    IDLE = enum.auto()
    FORWARD = enum.auto()
    PRE_BACKWARD = enum.auto()
    POST_BACKWARD = enum.auto()

    __hash__ = object.__hash__


_R = Residence
RESIDENCE_TRANSITIONS: dict[Residence, frozenset[Residence]] = {
    _R.SHARDED: frozenset({_R.SHARDED, _R.GATHERING}),
    _R.GATHERING: frozenset({_R.UNSHARDED, _R.SHARDED, _R.SHARDED_POST_FORWARD}),
    _R.UNSHARDED: frozenset({_R.SHARDED, _R.SHARDED_POST_FORWARD}),
    _R.SHARDED_POST_FORWARD: frozenset({_R.GATHERING, _R.SHARDED}),
}

_P = Phase
PHASE_TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    _P.IDLE: frozenset({_P.FORWARD, _P.PRE_BACKWARD, _P.POST_BACKWARD, _P.IDLE}),
    _P.FORWARD: frozenset({_P.IDLE, _P.FORWARD, _P.POST_BACKWARD}),
    _P.PRE_BACKWARD: frozenset({_P.POST_BACKWARD, _P.IDLE, _P.FORWARD}),
    _P.POST_BACKWARD: frozenset({_P.POST_BACKWARD, _P.PRE_BACKWARD, _P.IDLE, _P.FORWARD}),
}
