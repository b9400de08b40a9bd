"""Building one FSDP unit: groups, devices, what it manages, its flat parameter.

[Note: What a unit manages]
A unit manages the parameters and buffers of its module's subtree, except those
of ignored modules (and their subtrees) and those under a module that already
has FSDP applied (a nested unit manages them). Parameters are flattened in
module order; buffers stay where they are and only change dtype and device.

[Note: Devices]
The compute device is ``device_id`` when given (the module is moved there before
flattening), else the device of the module's parameters when not the CPU, else
the current CUDA device when CUDA is available, else the CPU. A module left on
the CPU without ``device_id`` on a CUDA machine must be moved by the user before
training (lazy initialisation checks it). With parameter offloading the shard
moves to the CPU after sharding.

[Note: Process groups]
``process_group`` is the sharding group (default: the world). Hybrid strategies
take a ``(shard_group, replicate_group)`` pair, or build one from the world:
ranks of one host shard (a host holds ``torch.cuda.device_count()`` ranks under
NCCL, the whole world under gloo), ranks with the same local rank replicate.
With one rank in the sharding group, sharding strategies fall back to
``NO_SHARD`` (with a warning), as there is nothing to shard; a hybrid strategy
keeps its name and its replicate group, and its replicas still sum gradients
(torch's FSDP switches it to ``NO_SHARD`` and drops the replicate group there,
so its replicas drift apart). ``sync_module_states`` broadcasts from the first
rank of the shard group, then from the first rank of the replicate group.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from fsdp import _comm, _registry
from fsdp._common import HYBRID_STRATEGIES, EnvSwitches, ProcessGroups
from fsdp._flat_param import FlatParamHandle, HandleShardingStrategy
from fsdp._ignored import Ignored
from fsdp._runtime import FSDPState, UnitConfig
from fsdp.api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy


def resolve_groups(
    process_group: Any, device_mesh: Any, strategy: ShardingStrategy, auto_wrapping: bool
) -> ProcessGroups:
    """The unit's groups (see [Note: Process groups]), with torch's errors."""
    if process_group is not None and device_mesh is not None:
        raise ValueError(
            "Cannot pass both process_group and device_mesh at the same time. "
            "Please just pass only one of them."
        )
    hybrid = strategy in HYBRID_STRATEGIES
    if device_mesh is not None:
        return _groups_of_mesh(device_mesh, hybrid)
    if not hybrid:
        return ProcessGroups(process_group if process_group is not None else _comm.world(), None)
    if process_group is None:
        if not auto_wrapping:
            raise ValueError(
                f"Manual wrapping with {strategy} requires explicit specification of "
                "process group or device_mesh."
            )
        return _hybrid_groups_from_world()
    if isinstance(process_group, tuple) and len(process_group) == 2:
        return ProcessGroups(*process_group)
    raise ValueError(
        "Expected process_group to be passed in as either None or "
        f"Tuple[dist.ProcessGroup, dist.ProcessGroup] but got {type(process_group)}"
    )


def _groups_of_mesh(mesh: Any, hybrid: bool) -> ProcessGroups:
    """A 1-D mesh shards over its group; a 2-D mesh (hybrid) replicates over
    dimension 0 and shards over dimension 1."""
    if not hybrid:
        return ProcessGroups(mesh.get_group(mesh_dim=0), None)
    if mesh.ndim != 2:
        raise ValueError(f"Expected device_mesh to have ndim=2 but got {mesh.ndim}")
    return ProcessGroups(mesh.get_group(mesh_dim=1), mesh.get_group(mesh_dim=0))


def _hybrid_groups_from_world() -> ProcessGroups:
    world = _comm.world()
    world_size, rank = world.size(), world.rank()
    per_host = world_size
    if torch.cuda.is_available() and torch.distributed.get_backend(world) == "nccl":
        per_host = min(torch.cuda.device_count(), world_size)
    shard = replicate = None
    for start in range(0, world_size, per_host):
        group = _comm.new_group(list(range(start, start + per_host)))
        if start <= rank < start + per_host:
            shard = group
    for local in range(per_host):
        group = _comm.new_group(list(range(local, world_size, per_host)))
        if rank % per_host == local:
            replicate = group
    return ProcessGroups(shard, replicate)


def resolve_strategy(strategy: ShardingStrategy | None, shard_group_size: int) -> ShardingStrategy:
    strategy = strategy or ShardingStrategy.FULL_SHARD
    if (
        shard_group_size == 1
        and strategy is not ShardingStrategy.NO_SHARD
        and strategy not in HYBRID_STRATEGIES
    ):
        warnings.warn(
            f"FSDP is switching to use `NO_SHARD` instead of {strategy} since the world size is 1.",
            stacklevel=4,
        )
        return ShardingStrategy.NO_SHARD
    return strategy


def handle_strategy(strategy: ShardingStrategy, shard_group_size: int) -> HandleShardingStrategy:
    if shard_group_size == 1:
        return HandleShardingStrategy.NO_SHARD
    return HandleShardingStrategy[strategy.name]


def managed_modules(root: nn.Module, ignored: Ignored) -> list[nn.Module]:
    """The modules of ``root``'s subtree this unit manages (see the module note)."""
    result: list[nn.Module] = []
    stack = [root]
    seen: set[int] = set()
    while stack:
        module = stack.pop()
        if id(module) in seen or module in ignored.modules:
            continue
        seen.add(id(module))
        if module is not root and _registry.has_fsdp(module):
            continue
        result.append(module)
        stack.extend(reversed(list(module.children())))
    return result


def managed_params(modules: list[nn.Module], ignored: Ignored) -> list[nn.Parameter]:
    params: list[nn.Parameter] = []
    seen: set[nn.Parameter] = set()
    for module in modules:
        for param in module.parameters(recurse=False):
            if param not in seen and param not in ignored.params:
                seen.add(param)
                params.append(param)
    return params


def managed_buffers(modules: list[nn.Module]) -> list[tuple[nn.Module, str]]:
    return [
        (m, name) for m in modules for name, b in m.named_buffers(recurse=False) if b is not None
    ]


def resolve_device(device_id: int | torch.device | None) -> torch.device | None:
    if device_id is None:
        return None
    if isinstance(device_id, int):
        return torch.device("cuda", device_id)
    device = torch.device(device_id)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def compute_device(params: list[nn.Parameter], device_id: torch.device | None) -> torch.device:
    if device_id is not None:
        return device_id
    devices = {p.device for p in params if p.device.type not in ("cpu", "meta")}
    if len(devices) > 1:
        raise RuntimeError(
            f"FSDP does not support modules with parameters on several devices: {devices}"
        )
    if devices:
        return devices.pop()
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def materialize(
    modules: list[nn.Module],
    param_init_fn: Callable[[nn.Module], None] | None,
    device: torch.device,
) -> None:
    """Initialises parameters created on the meta device."""
    meta = [
        m
        for m in modules
        if any(t.is_meta for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))
    ]
    if not meta:
        return
    if param_init_fn is not None:
        param_init_fn(modules[0])
        return
    for module in meta:
        module.to_empty(device=device, recurse=False)
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


def move_to(modules: list[nn.Module], device: torch.device, ignored: Ignored) -> None:
    for module in modules:
        for param in module._parameters.values():
            if param is not None and param not in ignored.params and param.device != device:
                with torch.no_grad():
                    param.data = param.data.to(device)
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def sync_states(
    params: list[nn.Parameter],
    buffers: list[tuple[nn.Module, str]],
    group: Any,
    device: torch.device,
) -> None:
    """``sync_module_states``: every rank starts from the first rank's values."""
    src = _comm.group_ranks(group)[0]
    tensors = [p.data for p in params] + [m._buffers[n] for m, n in buffers]
    with torch.no_grad():
        for tensor in tensors:
            if tensor is None:
                continue
            on_device = tensor if tensor.device == device else tensor.to(device)
            _comm.broadcast(on_device, src=src, group=group)
            if on_device is not tensor:
                tensor.copy_(on_device)


class UnitArgs(NamedTuple):
    """The constructor arguments of FullyShardedDataParallel that shape a unit
    (its process groups and what it ignores are resolved before)."""

    sharding_strategy: ShardingStrategy
    cpu_offload: CPUOffload | None
    backward_prefetch: BackwardPrefetch | None
    mixed_precision: MixedPrecision | None
    param_init_fn: Callable[[nn.Module], None] | None
    device_id: int | torch.device | str | None
    sync_module_states: bool
    forward_prefetch: bool
    limit_all_gathers: bool
    use_orig_params: bool


def build_unit(
    owner: nn.Module, managed: nn.Module, args: UnitArgs, ignored: Ignored, groups: ProcessGroups
) -> FSDPState:
    """Creates the unit's state and its (sharded) flat parameter."""
    if args.param_init_fn is not None and not callable(args.param_init_fn):
        raise ValueError(
            f"Expected {args.param_init_fn} to be callable but got {type(args.param_init_fn)}"
        )
    strategy = resolve_strategy(args.sharding_strategy, groups.shard.size())
    modules = managed_modules(managed, ignored)
    device_id = resolve_device(args.device_id)
    materialize(modules, args.param_init_fn, device_id or torch.device("cpu"))
    if device_id is not None:
        move_to(modules, device_id, ignored)
    params = managed_params(modules, ignored)
    buffers = managed_buffers(modules)
    device = compute_device(params, device_id)
    if args.sync_module_states:
        sync_states(params, buffers, groups.shard, device)
        if groups.replicate is not None:
            sync_states(params, buffers, groups.replicate, device)
    config = UnitConfig(
        sharding_strategy=strategy,
        mixed_precision=args.mixed_precision or MixedPrecision(),
        cpu_offload=args.cpu_offload or CPUOffload(),
        backward_prefetch=args.backward_prefetch,
        forward_prefetch=args.forward_prefetch,
        limit_all_gathers=args.limit_all_gathers,
        use_orig_params=args.use_orig_params,
        env=EnvSwitches.read(),
    )
    handle = _build_handle(params, managed, device, strategy, config, groups) if params else None
    return FSDPState(owner, config, groups, device, handle, buffers, ignored)


def _build_handle(
    params: list[nn.Parameter],
    managed: nn.Module,
    device: torch.device,
    strategy: ShardingStrategy,
    config: UnitConfig,
    groups: ProcessGroups,
) -> FlatParamHandle:
    mp = config.mixed_precision
    handle = FlatParamHandle(
        params,
        managed,
        device,
        handle_strategy(strategy, groups.shard.size()),
        config.cpu_offload.offload_params,
        mp.param_dtype,
        mp.reduce_dtype,
        mp.keep_low_precision_grads,
        groups.shard,
        config.use_orig_params,
    )
    handle.shard_in_place()
    if config.cpu_offload.offload_params and handle.flat_param.device.type != "cpu":
        handle.move_shard_to(torch.device("cpu"))
    return handle
