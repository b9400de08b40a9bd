"""Prefetch candidates from the recorded forward orders (fsdp._exec_order), on
units of the fake process group (see tests/fsdp/conftest.py)."""

from __future__ import annotations

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
