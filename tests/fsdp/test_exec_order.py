"""Prefetch candidates from the recorded forward orders (fsdp._exec_order), on
units of the fake process group (see tests/fsdp/conftest.py)."""

from __future__ import annotations

import torch
from torch import nn

from fsdp._exec_order import ExecutionOrder
from fsdp._flat_param import FlatParamHandle
from fsdp.api import BackwardPrefetch
from tests.fsdp.unit_cases import make_unit


def _forward(order: ExecutionOrder, unit: FlatParamHandle) -> None:
    """The unit's pre- and post-forward with grad, as the runtime records them."""
    order.record_pre_forward(unit, training=True)
    unit.pre_forward(full_precision=False)
    order.record_post_forward(unit)
    unit.post_forward(free=True, keep_views=False, awaits_backward=True)


def _two_units(group: object) -> tuple[ExecutionOrder, FlatParamHandle, FlatParamHandle]:
    first, second = (make_unit(group, nn.Linear(3, 2)) for _ in range(2))
    order = ExecutionOrder([first, second], {}, group, checks_order=False)
    return order, first, second


def test_forward_prefetch_takes_the_next_unit_once(fake_group: object) -> None:
    """In forward the next unit of the first iteration's order is the candidate,
    until it was prefetched."""
    order, first, second = _two_units(fake_group)
    _forward(order, first)
    _forward(order, second)
    order.next_iteration()
    order.begin_root_forward()
    order.record_pre_forward(first, training=True)
    first.pre_forward(full_precision=False)
    assert order.prefetch_candidate(first, None, forward=True) is second
    assert order.prefetch_candidate(first, None, forward=False) is None
    second.unshard_ahead(full_precision=False, for_forward=True)
    assert order.prefetch_candidate(first, None, forward=True) is None


def test_backward_prefetch_takes_the_unit_before_awaiting_backward(fake_group: object) -> None:
    """In backward the unit whose forward ended before is the candidate while it
    awaits its backward, for the setting's pass only."""
    order, first, second = _two_units(fake_group)
    _forward(order, first)
    _forward(order, second)
    second.pre_backward()
    pre, post = BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST
    assert order.prefetch_candidate(second, pre, forward=False) is first
    assert order.prefetch_candidate(second, post, forward=False) is None
    assert order.prefetch_candidate(first, pre, forward=False) is None
    first.pre_backward()
    assert order.prefetch_candidate(second, pre, forward=False) is None


def _forward_without_grad(order: ExecutionOrder, unit: FlatParamHandle) -> None:
    """The unit's forward under ``no_grad``: recorded, but awaiting no backward."""
    with torch.no_grad():
        order.record_pre_forward(unit, training=True)
        unit.pre_forward(full_precision=False)
        order.record_post_forward(unit)
        unit.post_forward(free=True, keep_views=False, awaits_backward=False)


def _three_units(group: object) -> tuple[ExecutionOrder, list[FlatParamHandle]]:
    units = [make_unit(group, nn.Linear(3, 2)) for _ in range(3)]
    return ExecutionOrder(units, {}, group, checks_order=False), units


def test_a_frozen_unit_between_stops_backward_prefetch(fake_group: object) -> None:
    """A unit run without autograd takes its place in the post-forward order, so
    the unit after it prefetches nothing in backward: not the frozen unit (it
    awaits no backward) and not the unit before it (torch does not look past it)."""
    order, (first, frozen, last) = _three_units(fake_group)
    _forward(order, first)
    _forward_without_grad(order, frozen)
    _forward(order, last)
    assert order.post_forward == [first, frozen, last]
    last.pre_backward()
    assert order.prefetch_candidate(last, BackwardPrefetch.BACKWARD_PRE, forward=False) is None


def test_a_unit_first_placed_at_position_zero_is_placed_again(fake_group: object) -> None:
    """Each use appends the unit; its position is its first use's, except position
    0, which its next use replaces (torch tests the position for truth)."""
    order, (first, second, third) = _three_units(fake_group)
    _forward_without_grad(order, first)  # an eval forward earlier in the iteration
    _forward_without_grad(order, second)
    _forward(order, first)
    _forward(order, second)
    _forward(order, third)
    assert order.post_forward == [first, second, first, second, third]
    pre = BackwardPrefetch.BACKWARD_PRE
    third.pre_backward()  # position 4: looks at position 3
    assert order.prefetch_candidate(third, pre, forward=False) is second
    second.pre_backward()  # position 1 (its first use): looks at position 0
    assert order.prefetch_candidate(second, pre, forward=False) is first
    first.pre_backward()  # placed again at 2: looks at position 1, whose backward ran
    assert order.prefetch_candidate(first, pre, forward=False) is None
