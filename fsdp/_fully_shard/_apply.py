"""``fully_shard``: sharding a module in place.

[Note: What one call manages]
``fully_shard(module)`` manages the module and its submodules down to (not
into) those ``fully_shard`` was applied to before, so it is called bottom-up:
each call's parameters are the managed modules' own (each shared parameter
once), except ``ignored_params``; a managed module all of whose parameters are
ignored, and which has no buffers, is left out. The parameters and buffers
move to the mesh's device (meta tensors stay, for deferred initialisation;
ignored parameters stay where they are), each parameter is sharded in place
(fsdp._fully_shard._param) and one parameter group owns them. The module's
class then becomes its ``FSDPModule`` subclass.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from fsdp._fully_shard._api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from fsdp._fully_shard._mesh import (
    MeshInfo,
    default_mesh,
    device_of,
    post_forward_mesh,
    validate_mesh,
)
from fsdp._fully_shard._module import FSDPModule
from fsdp._fully_shard._param import ParamLocation, ShardedParam
from fsdp._fully_shard._param_group import ParamGroup
from fsdp._fully_shard._state import FullyShardState, state_of

__all__ = ["fully_shard"]

_FSDP_CLASSES: dict[type, type] = {}
# The prefix of the attributes torch's composable APIs (``contract``) keep in a
# module's ``__dict__``: their states by function, and their registry by function
# name (``REGISTRY_KEY``, the prefix and a uuid drawn per process)
_COMPOSABLE_KEY_PREFIX = "__composable_api_state_key"
# torch's defaults: frozen, so one instance serves every call
_NO_MIXED_PRECISION = MixedPrecisionPolicy()
_NO_OFFLOAD = OffloadPolicy()


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = _NO_MIXED_PRECISION,
    offload_policy: OffloadPolicy = _NO_OFFLOAD,
    ignored_params: set[nn.Parameter] | None = None,
) -> Any:
    """Shards ``module``'s parameters over ``mesh`` and returns ``module``, now an
    ``FSDPModule`` (see [Note: What one call manages]). A list of modules makes one
    group of them all (tied weights, a norm and a head), each an ``FSDPModule``.

    - ``mesh``: 1-D (``Shard(0)``) or 2-D with named dimensions (HSDP:
      replicate over dimension 0, shard over dimension 1). ``None``: a 1-D mesh
      of every rank on the accelerator, else the CPU.
    - ``reshard_after_forward``: ``True`` frees the unsharded parameters after
      forward (backward all-gathers again); ``False`` keeps them to the end of
      backward; an int ``k`` (a divisor of the shard size) reshards to ``k``
      ranks; ``None``: ``True``, except ``False`` for the root.
    - ``shard_placement_fn(param)``: a ``Shard(dim)`` to shard on another
      dimension (which must divide evenly), or ``None`` for ``Shard(0)``.
    - ``mp_policy``, ``offload_policy``: see ``MixedPrecisionPolicy``,
      ``CPUOffloadPolicy``.
    - ``ignored_params``: parameters left alone: not sharded, not moved, their
      gradients not reduced.
    """
    modules = _roots(module)
    for root in modules:
        _check_module(root)
    mesh = mesh or default_mesh()
    validate_mesh(mesh)
    info = MeshInfo.of(mesh)
    device = device_of(mesh)
    auto = reshard_after_forward is None
    post_forward = post_forward_mesh(True if auto else reshard_after_forward, info)  # type: ignore[arg-type]
    ignored = ignored_params or set()
    params, buffers = _managed_states(_managed_modules(modules, ignored), ignored)
    _move_to_device(params, buffers, device)
    state = FullyShardState(modules, device, mp_policy, auto)
    if params:
        sharded = _shard_params(
            params, modules, info, post_forward, device, shard_placement_fn, offload_policy
        )
        group = ParamGroup(sharded, modules, info, post_forward, device, mp_policy, offload_policy)
        state.set_group(group)
    for root in modules:
        _swap_class(root)
    return module


def _roots(module: nn.Module | list[nn.Module]) -> tuple[nn.Module, ...]:
    """The modules of one call: ``module``, or those of a list that are not inside
    another of it."""
    if isinstance(module, nn.Module):
        return (module,)
    listed = list(module)
    inside = {sub for m in listed for sub in m.modules() if sub is not m}
    return tuple(m for m in listed if m not in inside)


def _state(module: nn.Module) -> FullyShardState | None:
    """The ``fully_shard`` state of ``module`` (``fully_shard.state(module)``, as
    torch's ``contract`` gives one), or None."""
    return state_of(module)


fully_shard.state = _state  # type: ignore[attr-defined]


def _check_module(module: nn.Module) -> None:
    if not isinstance(module, nn.Module):
        raise ValueError(f"fully_shard expects an nn.Module but got {type(module)}")
    if (
        isinstance(module, (nn.ModuleList, nn.ModuleDict))
        and type(module).forward is nn.Module.forward
    ):
        raise ValueError(
            f"fully_shard does not support containers that do not implement forward: {module}"
        )
    if state_of(module) is not None:
        raise AssertionError(
            "Each distinct composable distributed API can only be applied to a module once. "
            f"fully_shard has already been applied to the following module:\n{module}"
        )


def _managed_modules(roots: tuple[nn.Module, ...], ignored: set[nn.Parameter]) -> list[nn.Module]:
    """The modules of the roots' trees down to earlier ``fully_shard`` modules,
    children before parents, without those entirely ignored. A module that
    torch's composable ``replicate`` was applied to is left out with its subtree
    (its parameters are ``replicate``'s, as torch's ``fully_shard`` leaves them)."""
    found: list[nn.Module] = []
    visited: set[nn.Module] = set()

    def visit(module: nn.Module) -> None:
        if _has_replicate(module):
            return
        if module not in roots and state_of(module) is not None:
            return
        visited.add(module)
        for child in module.children():
            if child not in visited:
                visit(child)
        found.append(module)

    for root in roots:
        visit(root)
    if not ignored:
        return found
    decided: dict[nn.Module, bool] = {}
    return [m for m in found if not _all_ignored(m, ignored, decided)]


def _has_replicate(module: nn.Module) -> bool:
    """Whether torch's composable ``replicate`` was applied to ``module`` (its
    registry, read from the module's ``__dict__`` without importing torch's
    composable package)."""
    return any(
        isinstance(value, dict) and "replicate" in value
        for key, value in vars(module).items()
        if key.startswith(_COMPOSABLE_KEY_PREFIX)
    )


def _all_ignored(
    module: nn.Module, ignored: set[nn.Parameter], decided: dict[nn.Module, bool]
) -> bool:
    if module not in decided:
        decided[module] = (
            not any(True for _ in module.buffers(recurse=False))
            and all(p in ignored for p in module.parameters(recurse=False))
            and all(_all_ignored(c, ignored, decided) for c in module.children())
        )
    return decided[module]


def _managed_states(
    modules: list[nn.Module], ignored: set[nn.Parameter]
) -> tuple[list[nn.Parameter], list[Tensor]]:
    params: dict[nn.Parameter, None] = {}
    buffers: dict[Tensor, None] = {}
    for module in modules:
        for name, param in module.named_parameters(recurse=False):
            if param in ignored or param in params:
                continue
            if param.dim() == 0:
                raise ValueError(
                    "fully_shard doesn't support scalar parameters. "
                    f"Change {name} to a 1D tensor with numel equal to 1."
                )
            params[param] = None
        buffers.update(dict.fromkeys(module.buffers(recurse=False)))
    return list(params), list(buffers)


def _move_to_device(
    params: list[nn.Parameter], buffers: list[Tensor], device: torch.device
) -> None:
    for tensor in itertools.chain(params, buffers):
        if tensor.device == device or tensor.device.type == "meta":
            continue
        if isinstance(tensor, DTensor):
            mesh_type = tensor.device_mesh.device_type
            if mesh_type != device.type:
                raise ValueError(
                    "Requires DTensor to have mesh of the same type as the FSDP mesh "
                    f"but got {mesh_type} for DTensor and {device.type} for FSDP"
                )
            raise AssertionError(
                f"Expects DTensor to be moved to {mesh_type} but got {tensor.device}"
            )
        tensor.data = tensor.to(device)


def _shard_params(
    params: list[nn.Parameter],
    roots: tuple[nn.Module, ...],
    info: MeshInfo,
    post_forward: MeshInfo | None,
    device: torch.device,
    placement_fn: Callable[[nn.Parameter], Shard | None] | None,
    offload: OffloadPolicy,
) -> list[ShardedParam]:
    locations = _locations(params, roots)
    cpu = isinstance(offload, CPUOffloadPolicy)
    pin = cpu and offload.pin_memory  # type: ignore[attr-defined]
    sharded = []
    for param, location in zip(params, locations):
        dim = _shard_dim(param, placement_fn)
        sharded.append(ShardedParam(param, location, info, post_forward, device, dim, cpu, pin))
    return sharded


def _shard_dim(param: nn.Parameter, placement_fn: Callable[[nn.Parameter], Any] | None) -> int:
    placement = placement_fn(param) if placement_fn is not None else None
    if placement is None:
        return 0
    if not isinstance(placement, Shard):
        raise ValueError(f"Invalid shard_placement_fn result: {placement}")
    return placement.dim + param.ndim if placement.dim < 0 else placement.dim


def _locations(params: list[nn.Parameter], roots: tuple[nn.Module, ...]) -> list[ParamLocation]:
    """Every place the trees hold each parameter (a shared module, a tied weight)."""
    wanted = set(params)
    found: dict[nn.Parameter, ParamLocation] = {}
    every = (m for root in roots for _, m in root.named_modules(remove_duplicate=False))
    for module in every:
        for name, param in module._parameters.items():
            if param is None or param not in wanted:
                continue
            if param in found:
                found[param].shared.append((module, name))
            else:
                found[param] = ParamLocation(module, name)
    if len(found) != len(params):
        raise AssertionError(f"Some parameters are not in the module tree of {roots}")
    return [found[p] for p in params]


def _no_deepcopy(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("FSDP does not support deepcopy. Please use state dict for serialization.")


def _swap_class(module: nn.Module) -> None:
    cls = type(module)
    fsdp_cls = _FSDP_CLASSES.get(cls)
    if fsdp_cls is None:
        fsdp_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__deepcopy__": _no_deepcopy})
        _FSDP_CLASSES[cls] = fsdp_cls
    module.__class__ = fsdp_cls
