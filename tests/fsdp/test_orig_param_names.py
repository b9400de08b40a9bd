"""Showing a tensor or a parameter under an original name by writing the
module's dicts leaves the module exactly as ``hasattr``/``delattr``/``setattr``
through ``nn.Module`` leave it (see [Note: Writing the module's dicts] in
fsdp._setattr), and classes or hooks that change attribute access still go
through ``setattr``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from fsdp import _setattr

State = tuple[list[str], list[str], list[str], list[str], list[int]]


def _state(module: nn.Module) -> State:
    """Names in order in each of the module's dicts, and the ids they hold."""
    public = [k for k in module.__dict__ if not k.startswith("_")]
    held = [id(v) for v in module._parameters.values()] + [id(module.__dict__[k]) for k in public]
    return (
        list(module._parameters),
        public,
        list(module._buffers),
        sorted(module._non_persistent_buffers_set),
        held,
    )


def _forward_view(module: nn.Linear) -> None:
    """What forward shows with use_orig_params: a view in both dicts."""
    view = module.weight.detach().view(-1).view(module.weight.shape)
    module._parameters["weight"] = view  # type: ignore[assignment]
    object.__setattr__(module, "weight", view)


def _plain_view(module: nn.Linear) -> None:
    """What use_orig_params=False shows: a view in the instance dict only."""
    view = module.weight.detach().view(module.weight.shape)
    del module._parameters["weight"]
    module.__dict__["weight"] = view
    module.later = 0  # the name is not last: showing it again moves it


def _registered(module: nn.Linear) -> None:
    """The parameter as nn.Module registered it."""


SETUPS: dict[str, Callable[[nn.Linear], None]] = {
    "registered": _registered,
    "forward_view": _forward_view,
    "plain_view": _plain_view,
}


def _pair(setup: Callable[[nn.Linear], None]) -> tuple[nn.Linear, nn.Linear]:
    """Two identical modules (same tensors) prepared by ``setup``."""
    torch.manual_seed(0)
    fast = nn.Linear(3, 2)
    reference = nn.Linear(3, 2)
    reference.weight, reference.bias = fast.weight, fast.bias
    for module in (fast, reference):
        setup(module)
    return fast, reference


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_set_param_writes_the_dicts_as_setattr_would(setup: str) -> None:
    """A parameter shown again: same names, order and objects as delattr/setattr."""
    fast, reference = _pair(SETUPS[setup])
    param = nn.Parameter(torch.zeros(2, 3))
    assert _setattr._plain_parameter_name(fast, "weight", param)
    _setattr.set_param(fast, "weight", param, safe=True)
    _setattr._safe_setattr(reference, "weight", param)
    assert _state(fast) == _state(reference)
    assert fast.weight is param and list(fast._parameters) == ["bias", "weight"]


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_set_tensor_writes_the_dicts_as_setattr_would(setup: str) -> None:
    """A plain tensor shown: same names, order and objects as delattr/setattr."""
    fast, reference = _pair(SETUPS[setup])
    tensor = torch.ones(2, 3)
    assert _setattr._plain_module_attribute(fast, "weight")
    _setattr.set_tensor(fast, "weight", tensor, safe=True)
    _setattr._safe_setattr(reference, "weight", tensor)
    assert _state(fast) == _state(reference)
    assert fast.weight is tensor and "weight" not in fast._parameters


class _CountingSetattr(nn.Linear):
    calls: int = 0

    def __setattr__(self, name: str, value: object) -> None:
        type(self).calls += 1
        super().__setattr__(name, value)


class _Getattr(nn.Linear):
    def __getattr__(self, name: str) -> Tensor | nn.Module:
        return super().__getattr__(name)


def test_overrides_and_hooks_take_setattr() -> None:
    """Any override of attribute access, a registration hook or a non-leaf
    parameter leaves the dicts to ``setattr`` (its checks and errors included)."""
    param = nn.Parameter(torch.zeros(2, 3))
    counting = _CountingSetattr(3, 2)
    _forward_view(counting)
    before = _CountingSetattr.calls
    _setattr.set_param(counting, "weight", param, safe=True)
    assert _CountingSetattr.calls == before + 1 and counting.weight is param
    assert not _setattr._plain_module_attribute(_Getattr(3, 2), "weight")
    plain = nn.Linear(3, 2)
    handle = nn.modules.module.register_module_parameter_registration_hook(
        lambda module, name, p: None
    )
    try:
        assert not _setattr._plain_parameter_name(plain, "weight", param)
    finally:
        handle.remove()
    assert _setattr._plain_parameter_name(plain, "weight", param)
    non_leaf = nn.Parameter(torch.zeros(2, 3), requires_grad=False)
    non_leaf.add_(torch.ones(2, 3, requires_grad=True))
    assert non_leaf.grad_fn is not None
    assert not _setattr._plain_parameter_name(plain, "weight", non_leaf)
    with pytest.raises(ValueError, match="non-leaf Tensor"):
        _setattr.set_param(plain, "weight", non_leaf, safe=True)


def test_set_tensors_is_set_tensor_in_turn() -> None:
    """The batched form leaves every module as ``set_tensor`` one by one does,
    also with a class that overrides ``__setattr__`` among plain ones."""
    from fsdp._layout import ParamInfo

    def modules() -> list[nn.Linear]:
        torch.manual_seed(0)
        built = [nn.Linear(3, 2), _CountingSetattr(3, 2), nn.Linear(3, 2)]
        for module in built:
            _plain_view(module)
        return built

    batched, reference = modules(), modules()
    tensors = [torch.ones(2, 3) for _ in batched]
    infos = [ParamInfo("weight", m, f"m{i}") for i, m in enumerate(batched)]
    before = _CountingSetattr.calls
    _setattr.set_tensors(infos, tensors, safe=True)
    assert _CountingSetattr.calls == before + 1
    for module, tensor in zip(reference, tensors):
        _setattr.set_tensor(module, "weight", tensor, safe=True)
    for fast, slow, tensor in zip(batched, reference, tensors):
        assert _state(fast)[:4] == _state(slow)[:4]  # the names (the objects differ)
        assert fast.weight is tensor and slow.weight is tensor
