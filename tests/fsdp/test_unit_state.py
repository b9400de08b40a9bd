"""The unit's lifecycle (fsdp._unit_state): the moves of its hooks, checked."""

from __future__ import annotations

import pytest

from fsdp._common import HandleTrainingState
from fsdp._unit_state import UnitLifecycle, UnitState


def test_iteration_with_backward_moves_through_every_hook() -> None:
    """Forward with grad, pre- and post-backward, end of backward: back to IDLE."""
    lifecycle = UnitLifecycle()
    lifecycle.begin_forward()
    assert lifecycle.torch_state is HandleTrainingState.FORWARD
    lifecycle.end_forward(awaits_backward=True)
    assert lifecycle.awaits_backward()
    assert lifecycle.begin_backward()
    assert lifecycle.recomputing_in_backward() and lifecycle.backward_missed()
    lifecycle.end_backward()
    assert lifecycle.torch_state is HandleTrainingState.BACKWARD_POST
    lifecycle.move(UnitState.IDLE)
    assert lifecycle.state is UnitState.IDLE


def test_pre_backward_runs_once_per_iteration() -> None:
    """A second pre-backward (another output's gradient) finds nothing to do."""
    lifecycle = UnitLifecycle()
    lifecycle.begin_forward()
    lifecycle.end_forward(awaits_backward=True)
    assert lifecycle.begin_backward()
    assert not lifecycle.begin_backward()


def test_forward_without_backward_returns_to_idle() -> None:
    """No output needing a gradient: the unit awaits no backward."""
    lifecycle = UnitLifecycle()
    lifecycle.begin_forward()
    lifecycle.end_forward(awaits_backward=False)
    assert lifecycle.state is UnitState.IDLE
    assert not lifecycle.begin_backward()


def test_second_forward_before_backward_still_awaits_it() -> None:
    """A forward (without grad) between a forward and its backward keeps the wait."""
    lifecycle = UnitLifecycle()
    lifecycle.begin_forward()
    lifecycle.end_forward(awaits_backward=True)
    lifecycle.begin_forward()
    assert lifecycle.state is UnitState.FORWARD_BEFORE_BACKWARD
    lifecycle.end_forward(awaits_backward=False)
    assert lifecycle.awaits_backward()


def test_summon_returns_to_the_state_it_left() -> None:
    """A summon before backward goes back to awaiting it; an idle one to IDLE."""
    lifecycle = UnitLifecycle()
    lifecycle.begin_summon()
    assert lifecycle.torch_state is HandleTrainingState.SUMMON_FULL_PARAMS
    lifecycle.end_summon()
    assert lifecycle.state is UnitState.IDLE
    lifecycle.begin_forward()
    lifecycle.end_forward(awaits_backward=True)
    lifecycle.begin_summon()
    lifecycle.end_summon()
    assert lifecycle.awaits_backward()


def test_summon_inside_forward_raises_torchs_error() -> None:
    """Only an idle unit is summoned (torch's type and message)."""
    lifecycle = UnitLifecycle()
    lifecycle.begin_forward()
    with pytest.raises(AssertionError, match="Expects the handle training to be IDLE"):
        lifecycle.begin_summon()


def test_move_the_table_does_not_list_raises() -> None:
    """Post-backward straight from FORWARD is no listed transition."""
    lifecycle = UnitLifecycle()
    lifecycle.begin_forward()
    with pytest.raises(AssertionError, match="FORWARD -> POST_BACKWARD"):
        lifecycle.end_backward()
