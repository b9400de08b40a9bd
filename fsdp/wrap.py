"""Auto-wrap policies, ``enable_wrap``/``wrap``, and the wrapping pass that
FullyShardedDataParallel runs on its module before it wraps the root.

[Note: Two kinds of policy]
A policy is a ``_Policy`` object or a function policy. A ``_Policy`` sees the
whole tree at once: ``_run_policy`` returns every module to wrap with its own
constructor kwargs. A function policy is asked about one module at a time,
always with the keywords ``module``, ``recurse`` and ``nonwrapped_numel``:

- ``recurse=True``: may the walk descend into ``module``'s children? If not,
  nothing in ``module``'s subtree is wrapped, ``module`` included.
- ``recurse=False`` (asked after the children were decided): wrap ``module``?
  ``nonwrapped_numel`` is then the numel of the parameters in its subtree that
  no unit chosen below it manages.

Parameters of ignored modules and ``ignored_params`` are never counted, and
ignored modules are never descended into. The root is asked only with
``recurse=True``: the caller wraps it. ``ModuleWrapPolicy`` is both kinds.

[Note: Selection, then wrapping]
``_auto_wrap`` decides every target and its kwargs on the untouched tree,
validates them, then wraps in one post-order pass, so a module is wrapped
after all of its wrapped descendants and replaces itself in its parent. A
module reachable through several attributes (shared or aliased) is wrapped
once, and every one of those attributes is re-pointed at the same wrapper.

[Note: Kwargs of the wrapped children]
Each target gets its own dict: the root kwargs without the policy keys
(``auto_wrap_policy`` of the wrapper class, ``policy`` of the composable
form, so that a child never auto-wraps again), updated with the policy's
overrides. The caller's ``root_kwargs`` is never mutated.

[Note: Modules kept in full precision]
With mixed precision and an auto-wrap policy, modules of the classes in
``MixedPrecision._module_classes_to_ignore`` (``_BatchNorm`` by default) are
wrapped as units of their own with ``mixed_precision=None``, whatever the
policy says (a function policy is or-ed with ``_wrap_module_cls_individually``
for these classes, which also changes what its ancestors count). Their
floating-point inputs are cast to float32 by a forward pre-hook and their
outputs back to the inputs' low-precision dtype by a forward hook, both
appended after the module's other hooks; a UserWarning names the classes
found.

[Note: Frozen parameters in one unit]
A unit flattens the parameters it manages into one flat parameter. With
``use_orig_params=False`` parameters of mixed ``requires_grad`` cannot share
one (ValueError); with ``True`` they can, but the gradient is as large as the
whole flat parameter (UserWarning). A target manages the parameters of the
modules it reaches without passing through a target checked before it.
Targets are checked in post-order with children in registration order, so
descendants claim their modules first and the first offending module
registered is the one reported. As in torch, only the targets of a
``_Policy`` are checked here; for function policies, the flat parameter is
where mixed ``requires_grad`` is refused.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from fsdp import _registry

__all__ = [
    "CustomPolicy",
    "ModuleWrapPolicy",
    "always_wrap_policy",
    "enable_wrap",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]

FunctionPolicy = Callable[..., bool]
"""Called as ``policy(module=..., recurse=..., nonwrapped_numel=...)``."""
FsdpFn = Callable[..., nn.Module]
"""Builds a unit: ``fsdp_fn(module, **kwargs)``, e.g. the wrapper class."""
LambdaResult = bool | dict[str, Any]
ModuleClasses = Iterable[type[nn.Module]]

_POLICY_KWARGS = ("auto_wrap_policy", "policy")


def _is_instance(module: nn.Module, module_classes: ModuleClasses) -> bool:
    return isinstance(module, tuple(module_classes))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _subtrees(modules: Iterable[nn.Module]) -> set[nn.Module]:
    """``modules`` and all of their submodules."""
    return {submodule for module in modules for submodule in module.modules()}


def _candidates(
    root_module: nn.Module, ignored_modules: AbstractSet[nn.Module]
) -> Iterator[nn.Module]:
    """``root_module.modules()`` without the subtrees of ``ignored_modules``."""
    ignored = _subtrees(ignored_modules)
    return (module for module in root_module.modules() if module not in ignored)


class _Policy(ABC):
    """A policy that sees the whole module tree at once (see [Note: Two kinds of policy])."""

    @abstractmethod
    def _run_policy(
        self,
        root_module: nn.Module,
        ignored_modules: AbstractSet[nn.Module],
        root_kwargs: dict[str, Any],
    ) -> dict[nn.Module, dict[str, Any]]:
        """Each module to wrap (the root may be among them), mapped to its own
        kwargs dict. Modules in ``ignored_modules`` and their subtrees are never
        returned; ``root_kwargs`` is not mutated."""


AutoWrapPolicy = _Policy | FunctionPolicy


class ModuleWrapPolicy(_Policy):
    """Wraps every instance of ``module_classes`` with the root's kwargs.

    Also usable as a function policy: it descends everywhere and wraps those
    instances, e.g. inside ``functools.partial(_or_policy, policies=[...])``.
    """

    _module_classes: frozenset[type[nn.Module]]

    def __init__(self, module_classes: ModuleClasses) -> None:
        self._module_classes = frozenset(module_classes)

    def _run_policy(
        self,
        root_module: nn.Module,
        ignored_modules: AbstractSet[nn.Module],
        root_kwargs: dict[str, Any],
    ) -> dict[nn.Module, dict[str, Any]]:
        return {
            module: dict(root_kwargs)
            for module in _candidates(root_module, ignored_modules)
            if _is_instance(module, self._module_classes)
        }

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        return recurse or _is_instance(module, self._module_classes)

    def __repr__(self) -> str:
        return f"{super().__repr__()}({set(self._module_classes)})"


class CustomPolicy(_Policy):
    """Wraps the modules for which ``lambda_fn(module)`` is truthy.

    ``False`` or ``{}``: not wrapped. ``True``: wrapped with the root's kwargs.
    A non-empty dict: wrapped with the root's kwargs updated by the dict.
    """

    _lambda_fn: Callable[[nn.Module], LambdaResult]

    def __init__(self, lambda_fn: Callable[[nn.Module], LambdaResult]) -> None:
        self._lambda_fn = lambda_fn

    def _run_policy(
        self,
        root_module: nn.Module,
        ignored_modules: AbstractSet[nn.Module],
        root_kwargs: dict[str, Any],
    ) -> dict[nn.Module, dict[str, Any]]:
        targets: dict[nn.Module, dict[str, Any]] = {}
        for module in _candidates(root_module, ignored_modules):
            overrides = self._overrides_for(module)
            if overrides is not None:
                targets[module] = {**root_kwargs, **overrides}
        return targets

    def _overrides_for(self, module: nn.Module) -> dict[str, Any] | None:
        """None when ``module`` is not wrapped, else the kwargs overriding the root's."""
        result = self._lambda_fn(module)
        if not isinstance(result, bool | dict):
            raise ValueError(
                "The lambda_fn passed to CustomPolicy should return "
                f"False/True or a kwarg dict, but it returned {result}"
            )
        if not result:
            return None
        return result if isinstance(result, dict) else {}


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Descends everywhere and wraps every module."""
    return True


def lambda_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    lambda_fn: Callable[[nn.Module], bool],
) -> bool:
    """Descends everywhere and wraps the modules for which ``lambda_fn`` is true."""
    return recurse or bool(lambda_fn(module))


def transformer_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    transformer_layer_cls: ModuleClasses,
) -> bool:
    """Descends everywhere and wraps every instance of ``transformer_layer_cls``."""
    return recurse or _is_instance(module, transformer_layer_cls)


def _wrap_module_cls_individually(
    module: nn.Module,
    module_classes: Sequence[type[nn.Module]],
    recurse: bool,
    *args: Any,
    **kwargs: Any,
) -> bool:
    """Descends everywhere and wraps every instance of ``module_classes``."""
    return recurse or _is_instance(module, module_classes)


def _or_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    policies: Iterable[FunctionPolicy],
) -> bool:
    """True when any of ``policies`` is, for the same question."""
    return any(
        policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel)
        for policy in policies
    )


class _SizeBasedAutoWrapPolicy:
    """The function policy ``size_based_auto_wrap_policy``.

    A callable object rather than a function so that its defaults,
    ``FORCE_LEAF_MODULES`` and ``EXCLUDE_WRAP_MODULES``, are typed attributes.
    A module is descended into when ``nonwrapped_numel >= min_num_params`` and
    it is not a force-leaf module (so a force-leaf module is never wrapped
    either); it is wrapped when its remainder is ``>= min_num_params`` and it
    is not an excluded module. ``None`` for either set means the default.
    """

    FORCE_LEAF_MODULES: set[type[nn.Module]]
    EXCLUDE_WRAP_MODULES: set[type[nn.Module]]

    def __init__(self) -> None:
        self.FORCE_LEAF_MODULES = {nn.MultiheadAttention}
        self.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}

    def __call__(
        self,
        module: nn.Module,
        recurse: bool,
        nonwrapped_numel: int,
        min_num_params: int = int(1e8),
        force_leaf_modules: set[type[nn.Module]] | None = None,
        exclude_wrap_modules: set[type[nn.Module]] | None = None,
    ) -> bool:
        if nonwrapped_numel < min_num_params:
            return False
        if recurse:
            leaves = self.FORCE_LEAF_MODULES if force_leaf_modules is None else force_leaf_modules
            return not _is_instance(module, leaves)
        excluded = (
            self.EXCLUDE_WRAP_MODULES if exclude_wrap_modules is None else exclude_wrap_modules
        )
        return not _is_instance(module, excluded)


size_based_auto_wrap_policy = _SizeBasedAutoWrapPolicy()


class _WrapContext(NamedTuple):
    wrapper_cls: FsdpFn
    kwargs: dict[str, Any]


_ACTIVE_WRAP_CONTEXT: contextvars.ContextVar[_WrapContext | None] = contextvars.ContextVar(
    "fsdp_wrap_context", default=None
)


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: FsdpFn, **wrapper_kwargs: Any) -> Iterator[None]:
    """Makes ``wrap(module)`` return ``wrapper_cls(module, **wrapper_kwargs)``
    inside the ``with`` block. Contexts do not nest."""
    if _ACTIVE_WRAP_CONTEXT.get() is not None:
        raise NotImplementedError(
            "You are already within an autowrap context and we currently do not "
            "supported nested autowrap."
        )
    token = _ACTIVE_WRAP_CONTEXT.set(_WrapContext(wrapper_cls, dict(wrapper_kwargs)))
    try:
        yield
    finally:
        _ACTIVE_WRAP_CONTEXT.reset(token)


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Wraps ``module`` inside ``enable_wrap`` (``wrap_overrides`` win over the
    context's kwargs); returns it unchanged outside."""
    context = _ACTIVE_WRAP_CONTEXT.get()
    if context is None:
        return module
    return context.wrapper_cls(module, **{**context.kwargs, **wrap_overrides})


class _Ignored(NamedTuple):
    """What no auto-wrapped unit manages: ``modules`` is closed under submodules
    and ``params`` includes all of their parameters."""

    modules: set[nn.Module]
    params: set[nn.Parameter]

    @classmethod
    def expand(cls, modules: Iterable[nn.Module], params: Iterable[nn.Parameter]) -> _Ignored:
        subtree = _subtrees(modules)
        owned = {param for module in subtree for param in module.parameters(recurse=False)}
        return cls(subtree, set(params) | owned)

    def numel_in(self, module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters() if p not in self.params)


class _FunctionPolicyWalk:
    """Runs a function policy over a module tree (see [Note: Two kinds of policy])."""

    _policy: FunctionPolicy
    _ignored: _Ignored
    _chosen: dict[nn.Module, None]

    def __init__(self, policy: FunctionPolicy, ignored: _Ignored) -> None:
        self._policy = policy
        self._ignored = ignored
        self._chosen = {}

    def choose(self, root_module: nn.Module) -> list[nn.Module]:
        """The modules to wrap below ``root_module``, in the order they were chosen."""
        if self._ask(root_module, True, self._ignored.numel_in(root_module)):
            self._descend(root_module)
        return list(self._chosen)

    def _visit(self, module: nn.Module) -> int:
        """The numel that ends up managed by units chosen at or below ``module``."""
        numel = self._ignored.numel_in(module)
        if not self._ask(module, True, numel):
            return 0
        numel_below = self._descend(module)
        if not self._ask(module, False, numel - numel_below):
            return numel_below
        self._chosen[module] = None
        return numel

    def _descend(self, module: nn.Module) -> int:
        children = (child for child in module.children() if child not in self._ignored.modules)
        return sum(self._visit(child) for child in children)

    def _ask(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return self._policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel)


class _Float32Forward:
    """Forward hooks of a module kept in full precision (see [Note: Modules kept
    in full precision])."""

    _input_dtype: torch.dtype | None

    def __init__(self) -> None:
        self._input_dtype = None

    @classmethod
    def attach(cls, module: nn.Module) -> None:
        hooks = cls()
        module.register_forward_pre_hook(hooks.pre_forward)
        module.register_forward_hook(hooks.post_forward)

    def pre_forward(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """Post: every floating-point tensor in ``args`` is float32; the dtype of
        the last one cast is remembered (None when none was cast)."""
        self._input_dtype = None
        return tree_map_only(torch.Tensor, self._to_float32, args)

    def post_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """Post: when ``pre_forward`` cast an input, every floating-point tensor
        in ``output`` has that input's dtype."""
        dtype = self._input_dtype
        if dtype is None:
            return output
        return tree_map_only(torch.Tensor, functools.partial(_cast_floating, dtype=dtype), output)

    def _to_float32(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_floating_point() and tensor.dtype != torch.float32:
            self._input_dtype = tensor.dtype
        return _cast_floating(tensor, torch.float32)


def _cast_floating(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def _full_precision_classes(root_kwargs: dict[str, Any]) -> tuple[type[nn.Module], ...]:
    """The classes kept in full precision, empty without mixed precision."""
    mixed_precision = root_kwargs.get("mixed_precision")
    if mixed_precision is None:
        return ()
    return tuple(set(mixed_precision._module_classes_to_ignore))


def _keep_in_full_precision(
    root_module: nn.Module, module_classes: tuple[type[nn.Module], ...]
) -> None:
    """Hooks every instance of ``module_classes`` to run in float32 and warns
    with the classes found (see [Note: Modules kept in full precision])."""
    found: set[type[nn.Module]] = set()
    for module in root_module.modules():
        if isinstance(module, module_classes):
            found.add(type(module))
            _Float32Forward.attach(module)
    if found:
        # "instacnes" is torch's spelling, kept so that the message matches.
        warnings.warn(
            "Both mixed precision and an auto_wrap_policy were specified to FSDP, "
            f"where the wrapped module has submodules of type:\n{found}\n"
            "These modules will be wrapped as separate FSDP instacnes with mixed "
            "precision disabled.",
            stacklevel=3,
        )


def _select_targets(
    root_module: nn.Module,
    policy: AutoWrapPolicy,
    ignored: _Ignored,
    child_kwargs: dict[str, Any],
    full_precision: tuple[type[nn.Module], ...],
) -> dict[nn.Module, dict[str, Any]]:
    """Every module the policy wraps, with its own kwargs (see [Note: Kwargs of
    the wrapped children] and [Note: Modules kept in full precision])."""
    if isinstance(policy, _Policy):
        targets = policy._run_policy(root_module, ignored.modules, child_kwargs)
    else:
        chosen = _choose_by_function(root_module, policy, ignored, full_precision)
        targets = {module: dict(child_kwargs) for module in chosen}
    for module in _candidates(root_module, ignored.modules):
        if isinstance(module, full_precision):
            targets[module] = {**targets.get(module, child_kwargs), "mixed_precision": None}
    return targets


def _choose_by_function(
    root_module: nn.Module,
    policy: FunctionPolicy,
    ignored: _Ignored,
    full_precision: tuple[type[nn.Module], ...],
) -> list[nn.Module]:
    if full_precision:
        individually = functools.partial(
            _wrap_module_cls_individually, module_classes=full_precision
        )
        policy = functools.partial(_or_policy, policies=[policy, individually])
    return _FunctionPolicyWalk(policy, ignored).choose(root_module)


def _wrap_bottom_up(
    root_module: nn.Module, targets: dict[nn.Module, dict[str, Any]], fsdp_fn: FsdpFn
) -> None:
    """Replaces every target below ``root_module`` by ``fsdp_fn(target, **kwargs)``
    (see [Note: Selection, then wrapping])."""
    wrappers: dict[nn.Module, nn.Module] = {}
    visited: set[nn.Module] = {root_module}

    def visit(module: nn.Module) -> None:
        for name, child in list(module._modules.items()):
            if child is None:
                continue
            if child not in visited:
                visited.add(child)
                visit(child)
            if child in targets:
                if child not in wrappers:
                    wrappers[child] = fsdp_fn(child, **targets[child])
                setattr(module, name, wrappers[child])

    visit(root_module)


def _check_no_fsdp_applied(root_module: nn.Module) -> None:
    for name, module in root_module.named_modules():
        if _registry.has_fsdp(module):
            raise ValueError(
                "FSDP auto wrapping requires modules to not already have "
                f"FSDP applied but found {name} in\n{root_module}"
            )


def _auto_wrap(
    root_module: nn.Module,
    policy: AutoWrapPolicy,
    ignored_modules: AbstractSet[nn.Module],
    ignored_params: AbstractSet[nn.Parameter],
    root_kwargs: dict[str, Any],
    fsdp_fn: FsdpFn,
) -> None:
    """Wraps, in place and bottom-up, the modules under ``root_module`` that
    ``policy`` selects, each as ``fsdp_fn(module, **kwargs)``; never the root.

    ``root_kwargs`` are the kwargs the caller builds the root with (the module
    aside); the children get copies without the policy (see [Note: Kwargs of
    the wrapped children]). Raises ValueError if FSDP was already applied to
    any module under ``root_module``. With mixed precision, see [Note: Modules
    kept in full precision]; for ``_Policy`` targets, [Note: Frozen parameters
    in one unit].
    """
    _check_no_fsdp_applied(root_module)
    ignored = _Ignored.expand(ignored_modules, ignored_params)
    child_kwargs = {k: v for k, v in root_kwargs.items() if k not in _POLICY_KWARGS}
    full_precision = _full_precision_classes(root_kwargs)
    targets = _select_targets(root_module, policy, ignored, child_kwargs, full_precision)
    if full_precision:
        _keep_in_full_precision(root_module, full_precision)
    if isinstance(policy, _Policy):
        use_orig_params = bool(root_kwargs.get("use_orig_params", False))
        _validate_frozen_params(root_module, set(targets), ignored.params, use_orig_params)
    _wrap_bottom_up(root_module, targets, fsdp_fn)


def _post_order_named_modules(root_module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module once, children in registration order before their parent,
    named by the first path that reaches it."""
    order: list[tuple[str, nn.Module]] = []
    visited: set[nn.Module] = {root_module}

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            if child not in visited:
                visited.add(child)
                visit(_join(prefix, name), child)
        order.append((prefix, module))

    visit("", root_module)
    return order


def _claim_subtree(
    module: nn.Module, prefix: str, claimed: set[nn.Module]
) -> list[tuple[str, nn.Module]]:
    """The modules reachable from ``module`` through unclaimed modules,
    breadth-first with their names; claims them all."""
    reached: list[tuple[str, nn.Module]] = []
    claimed.add(module)
    queue = deque([(prefix, module)])
    while queue:
        name, current = queue.popleft()
        reached.append((name, current))
        for child_name, child in current.named_children():
            if child not in claimed:
                claimed.add(child)
                queue.append((_join(name, child_name), child))
    return reached


def _mixed_requires_grad_message(
    module_name: str, managed: dict[nn.Parameter, str], use_orig_params: bool
) -> str | None:
    """Why ``managed`` cannot (or should not) form one unit, None if it can."""
    trainable = [fqn for param, fqn in managed.items() if param.requires_grad]
    frozen = [fqn for param, fqn in managed.items() if not param.requires_grad]
    if not trainable or not frozen:
        return None
    msg = f"{module_name} has both parameters with requires_grad=True and False."
    if use_orig_params:
        total_numel = sum(param.numel() for param in managed)
        trainable_numel = sum(param.numel() for param in managed if param.requires_grad)
        msg += (
            " We do not recommend wrapping such modules since the gradient memory usage "
            f"will be higher than expected ({total_numel} numel instead of {trainable_numel} "
            "numel before sharding via reduce-scatter). "
        )
    else:
        msg += " FSDP does not support wrapping such modules when use_orig_params=False. "
    return (
        f"{msg}If possible, wrap the frozen parameters with FSDP separately.\n"
        f"The following parameters have requires_grad=True:\n{trainable}\n"
        f"The following parameters have requires_grad=False:\n{frozen}"
    )


def _validate_frozen_params(
    root_module: nn.Module,
    modules_to_wrap: set[nn.Module],
    ignored_params: AbstractSet[nn.Parameter],
    use_orig_params: bool,
) -> None:
    """Checks that each module to wrap would manage parameters that are all
    frozen or all trainable: raises ValueError if not and ``use_orig_params``
    is False, warns otherwise (see [Note: Frozen parameters in one unit])."""
    claimed: set[nn.Module] = set()
    for module_name, module in _post_order_named_modules(root_module):
        if module not in modules_to_wrap:
            continue
        managed = {
            param: _join(prefix, param_name)
            for prefix, reached in _claim_subtree(module, module_name, claimed)
            for param_name, param in reached.named_parameters(recurse=False)
            if param not in ignored_params
        }
        message = _mixed_requires_grad_message(module_name, managed, use_orig_params)
        if message is None:
            continue
        if not use_orig_params:
            raise ValueError(message)
        warnings.warn(message, stacklevel=2)
