"""The unit's hook bodies (``FlatParamHandle``, fsdp._flat_param) one by one, in
this process on a fake process group (see tests/fsdp/conftest.py)."""

from __future__ import annotations

import torch
from torch import nn

from fsdp._common import HandleShardingStrategy, HandleTrainingState
from fsdp._unit_state import Prefetch, UnitState
from tests.fsdp.unit_cases import make_unit


def test_pre_forward_unshards_and_shows_tensor_views(fake_group: object) -> None:
    """Forward computes on ``Tensor`` views of the gathered flat parameter."""
    module = nn.Linear(3, 2)
    unit = make_unit(fake_group, module)
    assert unit.flat_param.numel() == unit.shard_numel
    unit.pre_forward(full_precision=False)
    assert unit.training_state is HandleTrainingState.FORWARD
    assert unit.flat_param.numel() == unit.unpadded_numel
    assert type(module.weight) is torch.Tensor and module.weight.shape == (2, 3)


def test_post_forward_frees_and_awaits_backward(fake_group: object) -> None:
    """A freeing reshard goes back to the shard; an output needing a gradient
    leaves the unit awaiting its backward."""
    unit = make_unit(fake_group, nn.Linear(3, 2))
    unit.pre_forward(full_precision=False)
    unit.post_forward(free=True, keep_views=False, awaits_backward=True)
    assert unit.flat_param.numel() == unit.shard_numel
    assert not unit.storage.is_unsharded()
    assert unit.lifecycle.state is UnitState.AWAITING_BACKWARD


def test_post_forward_without_grad_returns_to_idle(fake_group: object) -> None:
    """No output needs a gradient: no backward is awaited."""
    unit = make_unit(fake_group, nn.Linear(3, 2))
    unit.pre_forward(full_precision=False)
    unit.post_forward(free=True, keep_views=False, awaits_backward=False)
    assert unit.lifecycle.state is UnitState.IDLE
    assert not unit.pre_backward()


def test_no_shard_post_forward_keeps_its_data(fake_group: object) -> None:
    """``NO_SHARD`` has no unsharded copy to free: the flat parameter stays whole."""
    unit = make_unit(fake_group, nn.Linear(3, 2), HandleShardingStrategy.NO_SHARD)
    unit.pre_forward(full_precision=False)
    unit.post_forward(free=True, keep_views=False, awaits_backward=False)
    assert unit.flat_param.numel() == unit.unpadded_numel


def test_one_iteration_leaves_the_sharded_gradient(fake_group: object) -> None:
    """Forward, backward, reduction and end of backward: the optimizer sees a
    shard-sized gradient and the unit is idle, its post-backward hook gone."""
    module = nn.Linear(3, 2)
    unit = make_unit(fake_group, module)
    unit.pre_forward(full_precision=False)
    loss = module(torch.ones(4, 3)).sum()
    unit.post_forward(free=True, keep_views=False, awaits_backward=True)
    assert unit.pre_backward()
    assert unit.flat_param.numel() == unit.unpadded_numel
    loss.backward()
    assert unit.post_backward()
    unit.reshard(free_unsharded=True)
    unit.reduce_grad(sync=True, hook=None)
    unit.finalize_backward(free=True, synced=True)
    assert unit.lifecycle.state is UnitState.IDLE
    grad = unit.flat_param.grad
    assert grad is not None and grad.numel() == unit.shard_numel
    assert not unit.post_backward_hook.is_registered()


def test_no_sync_keeps_the_unsharded_gradient(fake_group: object) -> None:
    """Without sync no reduction runs: the gradient stays unsharded and whole."""
    module = nn.Linear(3, 2)
    unit = make_unit(fake_group, module)
    unit.pre_forward(full_precision=False)
    loss = module(torch.ones(4, 3)).sum()
    unit.post_forward(free=True, keep_views=False, awaits_backward=True)
    unit.pre_backward()
    loss.backward()
    assert unit.post_backward()
    unit.reshard(free_unsharded=True)
    unit.reduce_grad(sync=False, hook=None)
    unit.finalize_backward(free=True, synced=False)
    grad = unit.flat_param.grad
    assert grad is not None and grad.numel() == unit.unpadded_numel


def test_post_backward_at_end_only_finishes_a_missed_backward(fake_group: object) -> None:
    """The end of backward finishes a unit whose pre-backward ran but whose
    hooked node did not; any other unit is left as it is."""
    unit = make_unit(fake_group, nn.Linear(3, 2))
    assert not unit.post_backward(at_end=True)
    assert unit.lifecycle.state is UnitState.IDLE
    unit.pre_forward(full_precision=False)
    unit.post_forward(free=True, keep_views=False, awaits_backward=True)
    unit.pre_backward()
    assert not unit.post_backward(at_end=True)  # no gradient came
    assert unit.lifecycle.state is UnitState.POST_BACKWARD


def test_forward_prefetch_shows_views_the_forward_keeps(fake_group: object) -> None:
    """A forward prefetch shows forward's views at once; the unit's own
    pre-forward then only waits and keeps them."""
    module = nn.Linear(3, 2)
    unit = make_unit(fake_group, module)
    unit.unshard_ahead(full_precision=False, for_forward=True)
    assert unit.prefetch.state is Prefetch.SHOWN and unit.prefetched
    weight = module.weight
    unit.pre_forward(full_precision=False)
    assert module.weight is weight


def test_forward_prefetch_under_inference_mode_makes_no_inference_views(
    fake_group: object,
) -> None:
    """A prefetch issued under ``inference_mode`` (a frozen trunk) still makes
    views autograd can record later ([Note: Views are made with autograd on])."""
    module = nn.Linear(3, 2)
    unit = make_unit(fake_group, module)
    with torch.inference_mode():
        unit.unshard_ahead(full_precision=False, for_forward=True)
    assert not module.weight.is_inference()
    assert not unit.flat_param.is_inference()


def test_backward_prefetch_gathers_without_showing(fake_group: object) -> None:
    """A backward prefetch (or ``_unshard``) gathers ahead and leaves the flat
    parameter sharded until the unit's own unshard."""
    unit = make_unit(fake_group, nn.Linear(3, 2))
    unit.unshard_ahead(full_precision=False)
    assert unit.prefetch.state is Prefetch.GATHERED
    assert unit.flat_param.numel() == unit.shard_numel
