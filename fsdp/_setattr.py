"""Showing a tensor or an ``nn.Parameter`` under an original parameter name of a
module, as ``hasattr``, ``delattr`` and ``setattr`` would, cheaply where they
would run only ``nn.Module``'s own code.

[Note: Setting the original names]
By default the names are set with ``delattr`` and ``setattr``, through
``nn.Module``'s checks and any ``__setattr__`` override of the module's class,
as torch's FSDP does. ``FSDP_USE_UNSAFE_SETATTR=1`` (read when a unit is built)
writes the module's dicts directly instead, bypassing overrides. Forward's views
with ``use_orig_params`` are always written in place in ``_parameters`` (the
order of ``named_parameters()`` is kept).

[Note: Writing the module's dicts]
Showing a tensor under a name where ``hasattr``, ``delattr`` and ``setattr``
would run only ``nn.Module``'s own code writes the module's dicts as that code
would, about ten times cheaper (it runs twice per unit and iteration, see
[Note: Cheap between-use bookkeeping] in fsdp._orig_params): ``__delattr__``
removes the name from the first of ``_parameters``, the buffers, the
submodules and the instance dict that holds it; ``__setattr__`` puts a plain tensor in the instance dict, and for an
``nn.Parameter`` removes the name from the instance dict, the buffers and the
submodules and registers it at the end of ``_parameters``, names moving to the
end of their dicts as they would. This holds where the module's class
overrides none of ``__setattr__``, ``__delattr__``, ``__getattr__`` and
``__getattribute__`` and has no class attribute of that name, and, for a
parameter, no global registration hook is set and the parameter is a leaf
(``register_parameter``'s checks then pass: the name is in no dict any more
when it looks). Otherwise ``setattr`` runs, with its checks and errors. After a
``use_orig_params`` forward a name is in both ``_parameters`` and the instance
dict, where reshard's ``setattr`` found it on every unit and step before this
path covered it (tests/fsdp/test_orig_param_names.py compares both paths).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from fsdp._layout import ParamInfo

__all__ = ["set_param", "set_params", "set_tensor", "set_tensors"]


def set_param(module: nn.Module, name: str, param: nn.Parameter, safe: bool) -> None:
    """See [Note: Setting the original names]."""
    if safe:
        if _plain_parameter_name(module, name, param):
            _reregister_parameter(module, name, param)
        else:
            _safe_setattr(module, name, param)
        return
    module._parameters[name] = param
    # The instance dict wins over nn.Module.__getattr__ (and subclass
    # __setattr__ overrides are bypassed).
    object.__setattr__(module, name, param)


def set_tensor(module: nn.Module, name: str, tensor: Tensor, safe: bool) -> None:
    """Shows a tensor that is not an ``nn.Parameter`` (a view or a placeholder)."""
    if safe:
        if _plain_module_attribute(module, name):
            _write_tensor(module, name, tensor)
        else:
            _safe_setattr(module, name, tensor)
        return
    module._parameters.pop(name, None)
    object.__setattr__(module, name, tensor)


def set_tensors(infos: Sequence[ParamInfo], tensors: Sequence[Tensor], safe: bool) -> None:
    """``set_tensor`` for each name in turn (see ``_ClassChecks``)."""
    if not safe:
        for info, tensor in zip(infos, tensors):
            set_tensor(info.module, info.param_name, tensor, False)
        return
    checks = _ClassChecks()
    for info, tensor in zip(infos, tensors):
        module, name = info.module, info.param_name
        if checks.plain(module, name):
            _write_tensor(module, name, tensor)
        else:
            _safe_setattr(module, name, tensor)
            checks.forget()


def set_params(infos: Sequence[ParamInfo], params: Iterable[nn.Parameter], safe: bool) -> None:
    """``set_param`` for each name in turn (see ``_ClassChecks``); ``params`` is
    consumed one parameter per name, after the previous name was set."""
    checks = _ClassChecks()
    for info, param in zip(infos, params):
        module, name = info.module, info.param_name
        if safe and _plain_parameter(param) and checks.plain(module, name):
            _reregister_parameter(module, name, param)
        else:
            set_param(module, name, param, safe)
            checks.forget()


class _ClassChecks:
    """``_plain_module_attribute`` over the names of one unit: its class checks
    made once per class and name. Nothing but ``setattr`` (a class's own code)
    can change a class meanwhile; after it, ``forget`` makes them again."""

    __slots__ = ("_known",)

    _known: dict[tuple[type, str], bool]

    def __init__(self) -> None:
        self._known = {}

    def plain(self, module: nn.Module, name: str) -> bool:
        key = (type(module), name)
        known = self._known.get(key)
        if known is None:
            known = self._known[key] = _plain_class_attribute(*key)
        return known and (name in module.__dict__ or name in module._parameters)

    def forget(self) -> None:
        self._known.clear()


def _write_tensor(module: nn.Module, name: str, tensor: Tensor) -> None:
    """``delattr`` then ``setattr`` of a plain tensor where
    ``_plain_module_attribute`` holds (see [Note: Writing the
    module's dicts]), the usual cases of ``_delete_attribute`` inline."""
    params, attributes = module._parameters, module.__dict__
    if name in params:
        del params[name]
    elif name in module._buffers or name in module._modules:
        _delete_attribute(module, name)
    else:
        del attributes[name]  # then set again: the name moves to the end
    attributes[name] = tensor  # nn.Module.__setattr__ of a plain tensor


def _safe_setattr(module: nn.Module, name: str, value: Tensor) -> None:
    if hasattr(module, name):
        delattr(module, name)
    setattr(module, name, value)


def _plain_module_attribute(module: nn.Module, name: str) -> bool:
    """Whether ``hasattr``, ``delattr`` then ``setattr`` of a plain tensor under
    ``name`` would run only ``nn.Module``'s own code on an instance attribute (no
    attribute method overridden in the module's class, no descriptor of that
    name)."""
    return (name in module.__dict__ or name in module._parameters) and _plain_class_attribute(
        type(module), name
    )


def _plain_class_attribute(cls: type, name: str) -> bool:
    """``cls`` overrides none of the attribute methods and has no attribute ``name``."""
    return (
        cls.__setattr__ is _MODULE_SETATTR
        and cls.__delattr__ is _MODULE_DELATTR
        and cls.__getattr__ is _MODULE_GETATTR
        and cls.__getattribute__ is _OBJECT_GETATTRIBUTE
        and not hasattr(cls, name)
    )


def _plain_parameter_name(module: nn.Module, name: str, param: nn.Parameter) -> bool:
    """Whether ``hasattr``, ``delattr`` then ``setattr`` of ``param`` under
    ``name`` would run only ``nn.Module``'s own code and pass its checks (a
    leaf ``nn.Parameter``, no registration hook): the name only leaves the
    module's dicts and is registered again (see ``_reregister_parameter``)."""
    return _plain_parameter(param) and _plain_module_attribute(module, name)


def _plain_parameter(param: nn.Parameter) -> bool:
    """``register_parameter`` takes ``param`` without error or hook."""
    return (
        not _PARAMETER_REGISTRATION_HOOKS
        and isinstance(param, nn.Parameter)
        and param.grad_fn is None
    )


def _delete_attribute(module: nn.Module, name: str) -> None:
    """What ``nn.Module.__delattr__`` does (see [Note: Writing the
    module's dicts]): the first of ``_parameters``, the buffers, the submodules
    and the instance dict that holds the name loses it."""
    if name in module._parameters:
        del module._parameters[name]
    elif name in module._buffers:
        del module._buffers[name]
        module._non_persistent_buffers_set.discard(name)
    elif name in module._modules:
        del module._modules[name]
    else:
        del module.__dict__[name]  # object.__delattr__


def _reregister_parameter(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """``delattr`` then ``setattr`` of a parameter, as ``nn.Module`` does them
    where ``_plain_parameter_name`` holds: the name leaves whichever dict held
    it, ``__setattr__`` takes it out of the instance dict, the buffers and the
    submodules, and ``register_parameter`` adds it at the end of
    ``_parameters`` (the order of ``named_parameters()`` and of state dicts
    follows)."""
    params = module._parameters
    if name in params:  # the usual case of _delete_attribute, inline
        del params[name]
    else:
        _delete_attribute(module, name)
    module.__dict__.pop(name, None)
    module._buffers.pop(name, None)
    module._modules.pop(name, None)
    module._non_persistent_buffers_set.discard(name)
    params[name] = param


_MODULE_SETATTR = nn.Module.__setattr__
_MODULE_DELATTR = nn.Module.__delattr__
_MODULE_GETATTR = nn.Module.__getattr__
_OBJECT_GETATTRIBUTE = object.__getattribute__
# nn.Module's global parameter registration hooks (a private dict: when a torch
# version lacks it, every parameter goes through setattr).
_PARAMETER_REGISTRATION_HOOKS = getattr(
    torch.nn.modules.module, "_global_parameter_registration_hooks", {None: None}
)
