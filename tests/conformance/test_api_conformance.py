"""``fsdp``'s public API against ``torch.distributed.fsdp``'s (FSDP1), compared with
``inspect``: a user who changes one import must find every name, parameter,
default, enum member and dataclass field where torch has it.

[Note: Differences and exceptions]
Each compared object yields a list of ``Difference``s. A difference's key is the
dotted path of what differs: ``FullyShardedDataParallel.__init__.device_mesh``
(a parameter), ``MixedPrecision.param_dtype`` (a field), ``OptimStateKeyType``
(a whole object), ``__all__.FSDPModule`` (an export). ``EXCEPTIONS`` maps a key
to the reason it may differ; every difference at that key is then accepted. An
exception that matches no difference any more is stale and fails too, so the
list shrinks as the API grows. Annotations are never compared (ours are strings
under ``from __future__ import annotations``); defaults are compared by value,
enum members by class and member name.

A member that torch's wrapper overrides from ``nn.Module`` must be overridden by
ours as well: ``nn.Module``'s version does not know about flat parameters (torch's
``apply`` runs ``fn`` inside ``summon_full_params``), so inheriting it unchanged
counts as a difference even where the signatures agree.

Calling each of our methods on a trivial instance is not attempted: building a
``FullyShardedDataParallel`` resolves the default process group, which a plain
pytest module does not have. ``test_unimplemented_fsdp_members_are_excepted``
makes sure instead that nothing torch's class has is silently absent from ours.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.fsdp.sharded_grad_scaler as torch_scaler
import torch.distributed.fsdp.wrap as torch_wrap
from torch import nn

import fsdp
import fsdp.api
import fsdp.sharded_grad_scaler
import fsdp.wrap

_SPMD_MESH = (
    "torch 2.13's fully_shard of parameters that are DTensors on a whole SPMD mesh "
    "(dp_mesh_dims naming its data-parallel dimensions); this fully_shard shards plain "
    "parameters over a 1-D or 2-D data-parallel mesh"
)

EXCEPTIONS: dict[str, str] = {
    "__all__.DataParallelMeshDims": _SPMD_MESH,
    "fully_shard.dp_mesh_dims": _SPMD_MESH,
}
"""Differences from torch's API that are meant to stay, by key: the reason each may differ.
Only DTensor / DeviceMesh-only and deprecated-in-torch items belong here."""

SINCE: dict[str, tuple[int, int]] = {
    "__all__.DataParallelMeshDims": (2, 13),
    "fully_shard.dp_mesh_dims": (2, 13),
}
"""Exceptions for names that torch exports from a version on (torch 2.11 has no
``DataParallelMeshDims``): before it, the difference does not exist."""

_NO_DEFAULT: Any = inspect.Parameter.empty
_MISSING: Any = object()
# Dunders that are Python's class machinery, not API the wrapper chose to define.
_MACHINERY = frozenset({"__init_subclass__", "__subclasshook__", "__class_getitem__", "__new__"})
_CALLABLE_KINDS = frozenset({"method", "staticmethod", "classmethod", "property"})


class Difference(NamedTuple):
    """One way ours differs from torch's; ``key`` is what ``EXCEPTIONS`` names."""

    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


class Target(NamedTuple):
    """One object of torch's API and the modules (searched in order) that should hold ours."""

    name: str
    theirs: ModuleType
    ours: tuple[ModuleType, ...]
    attr: str
    base: type = object
    """Members ``theirs`` inherits unchanged from this class are not compared."""
    private: frozenset[str] = frozenset()
    """Private members compared all the same: other code relies on their signatures."""

    def find_ours(self) -> Any:
        for module in self.ours:
            if hasattr(module, self.attr):
                return getattr(module, self.attr)
        return _MISSING


class Check(NamedTuple):
    """A parametrized case: the id and the function that lists its differences."""

    name: str
    run: Callable[[], list[Difference]]

    def __repr__(self) -> str:
        return self.name


# ----------------------------------------------------------------- comparing values


def _same_value(theirs: Any, ours: Any) -> bool:
    """Equal by value; enums by class and member name; dataclass instances field by field."""
    if theirs is _NO_DEFAULT or ours is _NO_DEFAULT:
        return theirs is ours
    if isinstance(theirs, enum.Enum) or isinstance(ours, enum.Enum):
        return _enum_id(theirs) == _enum_id(ours)
    if _is_dataclass_instance(theirs) or _is_dataclass_instance(ours):
        return (
            _is_dataclass_instance(theirs)
            and _is_dataclass_instance(ours)
            and type(theirs).__name__ == type(ours).__name__
            and _same_value(_field_values(theirs), _field_values(ours))
        )
    if isinstance(theirs, (tuple, list)):
        return (
            type(theirs) is type(ours)
            and len(theirs) == len(ours)
            and all(_same_value(t, o) for t, o in zip(theirs, ours))
        )
    if isinstance(theirs, bool) or isinstance(ours, bool):
        return type(theirs) is type(ours) and theirs == ours
    try:
        return bool(theirs == ours)
    except Exception:  # a value whose == does not give a truth value (a tensor)
        return False


def _enum_id(value: Any) -> tuple[str, str] | None:
    return (type(value).__name__, value.name) if isinstance(value, enum.Enum) else None


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _field_values(value: Any) -> dict[str, Any]:
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}


def _show(value: Any) -> str:
    if value is _NO_DEFAULT:
        return "no default"
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    return repr(value)


def _order_difference(key: str, what: str, theirs: list[str], ours: list[str]) -> list[Difference]:
    """The order of the names both sides have, where it differs."""
    common_theirs = [n for n in theirs if n in ours]
    common_ours = [n for n in ours if n in theirs]
    if common_theirs == common_ours:
        return []
    return [Difference(key, f"{what} order: torch {common_theirs}, ours {common_ours}")]


# ----------------------------------------------------------------- signatures and members


def signature_differences(
    key: str, theirs: Callable[..., Any], ours: Callable[..., Any]
) -> list[Difference]:
    """Parameter names, kinds, order and defaults of two callables."""
    their_params = inspect.signature(theirs).parameters
    our_params = inspect.signature(ours).parameters
    diffs = [
        Difference(f"{key}.{name}", f"missing parameter `{param}`")
        for name, param in their_params.items()
        if name not in our_params
    ]
    diffs += [
        Difference(f"{key}.{name}", f"extra parameter `{param}` (not in torch)")
        for name, param in our_params.items()
        if name not in their_params
    ]
    diffs += _order_difference(key, "parameter", list(their_params), list(our_params))
    for name, their in their_params.items():
        our = our_params.get(name)
        if our is None:
            continue
        if their.kind != our.kind:
            message = f"kind: torch {their.kind.description}, ours {our.kind.description}"
            diffs.append(Difference(f"{key}.{name}", message))
        if not _same_value(their.default, our.default):
            message = f"default: torch {_show(their.default)}, ours {_show(our.default)}"
            diffs.append(Difference(f"{key}.{name}", message))
    return diffs


def _provider(cls: type, name: str) -> tuple[type, Any] | None:
    """The class in ``cls``'s MRO that defines ``name``, and the raw (static) value."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass, vars(klass)[name]
    return None


def _kind(value: Any) -> str:
    if isinstance(value, staticmethod):
        return "staticmethod"
    if isinstance(value, classmethod):
        return "classmethod"
    if isinstance(value, property):
        return "property"
    if inspect.isfunction(value):
        return "method"
    return "attribute"


def _is_compared(name: str, value: Any, private: frozenset[str]) -> bool:
    if name in private:
        return True
    if name.startswith("__") and name.endswith("__"):
        return name not in _MACHINERY and _kind(value) in _CALLABLE_KINDS
    return not name.startswith("_")


def compared_members(cls: type, base: type, private: frozenset[str] = frozenset()) -> list[str]:
    """``cls``'s public members, callable dunders and ``private`` ones, in definition
    order, except those it inherits unchanged from ``base`` (or ``object``)."""
    names: list[str] = []
    for klass in cls.__mro__:
        if klass in base.__mro__:
            continue
        names += [n for n in vars(klass) if n not in names]
    return [n for n in names if _is_compared(n, _provider(cls, n)[1], private)]


def _settable(has_setter: bool) -> str:
    return "settable" if has_setter else "read-only"


def _unwrapped(value: Any) -> Callable[..., Any]:
    return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value


def member_differences(key: str, their_value: Any, our_value: Any) -> list[Difference]:
    """Kind, settability (properties) and signature (callables) of one member."""
    their_kind, our_kind = _kind(their_value), _kind(our_value)
    if their_kind != our_kind:
        return [Difference(key, f"a {their_kind} in torch, a {our_kind} in ours")]
    if their_kind == "property":
        their_setter, our_setter = their_value.fset is not None, our_value.fset is not None
        if their_setter != our_setter:
            message = f"property: torch {_settable(their_setter)}, ours {_settable(our_setter)}"
            return [Difference(key, message)]
        return []
    if their_kind == "attribute":
        return []
    return signature_differences(key, _unwrapped(their_value), _unwrapped(our_value))


def class_differences(target: Target, theirs: type, ours: Any) -> list[Difference]:
    """Every compared member of torch's class: present, overridden, same kind and signature."""
    if not isinstance(ours, type):
        return [Difference(target.name, f"not a class in ours: {ours!r}")]
    diffs: list[Difference] = []
    for name in compared_members(theirs, target.base, target.private):
        key = f"{target.name}.{name}"
        their_value = _provider(theirs, name)[1]
        found = _provider(ours, name)
        if found is None:
            diffs.append(Difference(key, f"missing {_kind(their_value)}"))
        elif found[0] in target.base.__mro__:
            owner = found[0].__qualname__
            message = f"inherited unchanged from {owner}; torch's class overrides it"
            diffs.append(Difference(key, message))
        else:
            diffs += member_differences(key, their_value, found[1])
    return diffs


def enum_differences(name: str, theirs: type[enum.Enum], ours: Any) -> list[Difference]:
    """Member names, in order."""
    if not (isinstance(ours, type) and issubclass(ours, enum.Enum)):
        return [Difference(name, f"not an enum in ours: {ours!r}")]
    their_members, our_members = list(theirs.__members__), list(ours.__members__)
    diffs = [
        Difference(f"{name}.{m}", "missing member") for m in their_members if m not in our_members
    ]
    diffs += [
        Difference(f"{name}.{m}", "extra member (not in torch)")
        for m in our_members
        if m not in their_members
    ]
    return diffs + _order_difference(name, "member", their_members, our_members)


def _field_default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return _NO_DEFAULT


def dataclass_differences(name: str, theirs: type, ours: Any) -> list[Difference]:
    """Field names, order and defaults."""
    if not (isinstance(ours, type) and dataclasses.is_dataclass(ours)):
        return [Difference(name, f"not a dataclass in ours: {ours!r}")]
    their_fields = {f.name: f for f in dataclasses.fields(theirs)}
    our_fields = {f.name: f for f in dataclasses.fields(ours)}
    diffs = [
        Difference(f"{name}.{f}", f"missing field (torch default {_show(_field_default(field))})")
        for f, field in their_fields.items()
        if f not in our_fields
    ]
    diffs += [
        Difference(f"{name}.{f}", "extra field (not in torch)")
        for f in our_fields
        if f not in their_fields
    ]
    diffs += _order_difference(name, "field", list(their_fields), list(our_fields))
    for f, field in their_fields.items():
        if f not in our_fields:
            continue
        their_default, our_default = _field_default(field), _field_default(our_fields[f])
        if not _same_value(their_default, our_default):
            message = f"default: torch {_show(their_default)}, ours {_show(our_default)}"
            diffs.append(Difference(f"{name}.{f}", message))
    return diffs


def function_differences(name: str, theirs: Callable[..., Any], ours: Any) -> list[Difference]:
    """The signature, and public attributes torch hangs on the function
    (``size_based_auto_wrap_policy.FORCE_LEAF_MODULES``; a function's by signature)."""
    if not callable(ours):
        return [Difference(name, f"not callable in ours: {ours!r}")]
    diffs = signature_differences(name, theirs, ours)
    for attr, value in vars(theirs).items():
        if attr.startswith("_"):
            continue
        if not hasattr(ours, attr):
            diffs.append(Difference(f"{name}.{attr}", "missing attribute"))
        elif inspect.isfunction(value) and callable(getattr(ours, attr)):
            # a function hung on the function (``fully_shard.state``): its signature
            diffs += signature_differences(f"{name}.{attr}", value, getattr(ours, attr))
        elif not _same_value(value, getattr(ours, attr)):
            message = f"value: torch {_show(value)}, ours {_show(getattr(ours, attr))}"
            diffs.append(Difference(f"{name}.{attr}", message))
    return diffs


def differences(target: Target) -> list[Difference]:
    """Every way ours differs from torch's object ``target``."""
    theirs = getattr(target.theirs, target.attr)
    ours = target.find_ours()
    if ours is _MISSING:
        where = ", ".join(m.__name__ for m in target.ours)
        return [Difference(target.name, f"missing from {where}")]
    if isinstance(theirs, type) and issubclass(theirs, enum.Enum):
        return enum_differences(target.name, theirs, ours)
    if isinstance(theirs, type) and dataclasses.is_dataclass(theirs):
        return dataclass_differences(target.name, theirs, ours)
    if isinstance(theirs, type):
        return class_differences(target, theirs, ours)
    return function_differences(target.name, theirs, ours)


def export_differences() -> list[Difference]:
    """Every name in ``torch.distributed.fsdp.__all__`` importable from ``fsdp`` and in its ``__all__``."""
    diffs = []
    for name in torch_fsdp.__all__:
        key = f"__all__.{name}"
        if not hasattr(fsdp, name):
            diffs.append(Difference(key, "not importable from fsdp"))
        elif name not in fsdp.__all__:
            diffs.append(Difference(key, "importable from fsdp but not in fsdp.__all__"))
    return diffs


# ----------------------------------------------------------------- what is compared

_CONFIG_NAMES = (
    "ShardingStrategy",
    "BackwardPrefetch",
    "StateDictType",
    "OptimStateKeyType",
    "MixedPrecision",
    "CPUOffload",
    "StateDictConfig",
    "FullStateDictConfig",
    "ShardedStateDictConfig",
    "LocalStateDictConfig",
    "OptimStateDictConfig",
    "FullOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "LocalOptimStateDictConfig",
    "StateDictSettings",
)
# FSDP2: the function, the module class, its policies and companions.
_FSDP2_NAMES = (
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "register_fsdp_forward_method",
    "share_comm_ctx",
)
# Private names of torch's wrap module that user policies and our tests build on.
_WRAP_PRIVATE = ("_Policy", "_or_policy", "_wrap_module_cls_individually")
_POLICY_PRIVATE = frozenset({"_run_policy"})


def _public_wrap_names() -> list[str]:
    """torch's ``wrap.__all__``, or failing that the public names its module defines."""
    exported = getattr(torch_wrap, "__all__", None)
    if exported is not None:
        return list(exported)
    return [
        name
        for name, value in vars(torch_wrap).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == torch_wrap.__name__
    ]


def _targets() -> Iterator[Target]:
    yield Target(
        "FullyShardedDataParallel",
        torch_fsdp,
        (fsdp,),
        "FullyShardedDataParallel",
        base=nn.Module,
    )
    for name in _CONFIG_NAMES:
        yield Target(name, torch_fsdp, (fsdp, fsdp.api), name)
    for name in _FSDP2_NAMES:
        yield Target(name, torch_fsdp, (fsdp,), name)
    yield Target(
        "sharded_grad_scaler.ShardedGradScaler",
        torch_scaler,
        (fsdp.sharded_grad_scaler,),
        "ShardedGradScaler",
        private=frozenset({"_unscale_grads_"}),
    )
    for name in [*_public_wrap_names(), *_WRAP_PRIVATE]:
        private = _POLICY_PRIVATE if isinstance(getattr(torch_wrap, name), type) else frozenset()
        yield Target(f"wrap.{name}", torch_wrap, (fsdp.wrap,), name, private=private)


TARGETS = list(_targets())
CHECKS = [Check(t.name, functools.partial(differences, t)) for t in TARGETS]
CHECKS.append(Check("__all__", export_differences))


@functools.cache
def _all_differences() -> tuple[Difference, ...]:
    return tuple(d for check in CHECKS for d in check.run())


# ----------------------------------------------------------------- tests


@pytest.mark.parametrize("check", CHECKS, ids=[c.name for c in CHECKS])
def test_api_matches_torch(check: Check) -> None:
    """Ours has torch's names, signatures, members and fields, up to ``EXCEPTIONS``."""
    unexpected = [d for d in check.run() if d.key not in EXCEPTIONS]
    listing = "\n".join(f"  {d}" for d in unexpected)
    assert not unexpected, f"{len(unexpected)} difference(s) from torch:\n{listing}"


def test_exceptions_are_not_stale() -> None:
    """Every ``EXCEPTIONS`` entry still names a difference that exists."""
    keys = {d.key for d in _all_differences()}
    torch_version = tuple(int(part) for part in torch.__version__.split(".")[:2])
    expected = [key for key in EXCEPTIONS if SINCE.get(key, (0, 0)) <= torch_version]
    stale = [key for key in expected if key not in keys]
    assert not stale, f"exceptions that match no difference (remove them): {stale}"


def test_exceptions_give_reasons() -> None:
    """Every ``EXCEPTIONS`` entry says why the difference may stay."""
    unreasoned = [key for key, reason in EXCEPTIONS.items() if not reason.strip()]
    assert not unreasoned, f"exceptions without a reason: {unreasoned}"


def test_unimplemented_fsdp_members_are_excepted() -> None:
    """Every member of torch's wrapper that ours lacks (or leaves to nn.Module) is a named exception."""
    theirs = torch_fsdp.FullyShardedDataParallel
    ours = fsdp.FullyShardedDataParallel
    unimplemented = []
    for name in compared_members(theirs, nn.Module):
        found = _provider(ours, name)
        if found is None or found[0] in nn.Module.__mro__:
            unimplemented.append(f"FullyShardedDataParallel.{name}")
    silent = [key for key in unimplemented if key not in EXCEPTIONS]
    assert not silent, (
        f"torch's FSDP members ours does not implement, without an exception: {silent}"
    )


def test_differences_finds_each_kind_of_mismatch() -> None:
    """The comparison itself reports missing, extra, reordered, re-kinded and
    re-defaulted parameters and members, and an nn.Module override left out."""

    class Theirs(nn.Module):
        def __init__(self, module: nn.Module, limit: int = 1, *, mesh: object = None) -> None: ...
        def apply(self, fn: Callable[[nn.Module], None]) -> Theirs: ...
        @staticmethod
        def gather(module: nn.Module) -> None: ...
        def hook(self) -> None: ...

    class Ours(nn.Module):
        def __init__(self, limit: int = 2, module: nn.Module | None = None) -> None: ...
        def gather(self, module: nn.Module) -> None: ...

    class TheirKind(enum.Enum):
        A = 1
        B = 2

    class OurKind(enum.Enum):
        B = 1

    @dataclasses.dataclass
    class TheirConfig:
        kind: TheirKind = TheirKind.A

    @dataclasses.dataclass
    class OurConfig:
        kind: OurKind = OurKind.B

    their_module, our_module = ModuleType("theirs"), ModuleType("ours")
    their_module.Absent = len
    for name, theirs, ours in [
        ("W", Theirs, Ours),
        ("K", TheirKind, OurKind),
        ("C", TheirConfig, OurConfig),
    ]:
        setattr(their_module, name, theirs)
        setattr(our_module, name, ours)
    found = [
        str(d)
        for name in ("W", "K", "C", "Absent")
        for d in differences(Target(name, their_module, (our_module,), name, base=nn.Module))
    ]
    assert found == [
        "W.__init__.mesh: missing parameter `mesh: 'object' = None`",
        "W.__init__: parameter order: torch ['self', 'module', 'limit'], ours ['self', 'limit', 'module']",
        "W.__init__.module: default: torch no default, ours None",
        "W.__init__.limit: default: torch 1, ours 2",
        "W.apply: inherited unchanged from Module; torch's class overrides it",
        "W.gather: a staticmethod in torch, a method in ours",
        "W.hook: missing method",
        "K.A: missing member",
        "C.kind: default: torch TheirKind.A, ours OurKind.B",
        "Absent: missing from ours",
    ]
