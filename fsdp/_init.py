"""Building one FSDP unit: groups, devices, what it manages, its flat parameter.

[Note: What a unit manages]
A unit manages the parameters and buffers of its module's subtree, except those
of ignored modules (and their subtrees) and those under a module that already
has FSDP applied (a nested unit manages them). Wrapping a unit again
(``FSDP(FSDP(m))``, as torch allows) gives an outer unit that manages nothing:
the inner one keeps everything, and the outer one is the root. Parameters are
flattened in module order; buffers stay where they are and only change dtype
and device.

[Note: Devices]
A unit's parameters are on one device; a module partly on the CPU needs
``device_id``, which moves what is on the CPU (parameters and buffers, not
ignored ones, not nested units') there. The compute device is the device of
the first managed parameter when it is not the CPU, else the current device of
``device_id``'s type (of CUDA when available, else the CPU); a ``device_id``
that disagrees raises, and one without an index means the current device (with
a warning). A module left on the CPU on a machine with CUDA warns and must be
moved before training (lazy initialisation checks it). With parameter
offloading the shard moves to the CPU after sharding. Torch's FSDP needs an
accelerator; ours also runs with the CPU as the compute device, where a CPU
module is not a mistake and ``sync_module_states`` broadcasts CPU tensors
(torch refuses CPU tensors there whatever the compute device).

[Note: Meta-device initialisation]
A unit with parameters or buffers on the meta device (its own modules, found
breadth-first up to nested units and ignored modules) is materialised before
anything else: ``param_init_fn(module)`` for each of those modules when given
(it must be callable), else ``to_empty(device)`` and ``reset_parameters()`` of
each module that has parameters or buffers of its own, on ``device_id`` or the
current device.

[Note: Process groups]
``process_group`` is the sharding group (default: the world). A ``device_mesh``
gives the groups instead: a non-hybrid unit shards over the group of its
dimension 0, a hybrid one needs a 2-D mesh and replicates over dimension 0,
sharding over dimension 1; a mesh sliced from a larger one composes with tensor
parallelism over the others (see [Note: Tensor-parallel parameters] in
fsdp._dtensor_extensions). Hybrid strategies
take a ``(shard_group, replicate_group)`` pair, or build one from the world:
ranks of one host shard (a host holds ``torch.cuda.device_count()`` ranks under
NCCL, the whole world under gloo), ranks with the same local rank replicate.
With one rank in the sharding group, sharding strategies fall back to
``NO_SHARD`` (with a warning), as there is nothing to shard; a hybrid strategy
keeps its name and its replicate group, and its replicas still sum gradients
(torch's FSDP switches it to ``NO_SHARD`` and drops the replicate group there,
so its replicas drift apart). ``sync_module_states``: fsdp._sync_states.

[Note: Deprecation notices]
As torch's, ``NO_SHARD`` on more than one rank gives torch's ``FutureWarning``
(its advice, ``DistributedDataParallel``, holds here too). Torch's notice that
``state_dict_type`` / ``set_state_dict_type`` are deprecated is not given: the
replacement it names (``torch.distributed.checkpoint.state_dict``) does not
know this implementation's units.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp import _comm, _registry
from fsdp._common import HYBRID_SHARDING_STRATEGIES, EnvSwitches, ProcessGroups
from fsdp._dtensor_extensions import DTensorExtensions
from fsdp._flat_param import FlatParamHandle, HandleShardingStrategy
from fsdp._ignored import Ignored
from fsdp._runtime import FSDPState, UnitConfig
from fsdp._sync_states import sync_module_states
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
    hybrid = strategy in HYBRID_SHARDING_STRATEGIES
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
    per_host = world.size()
    if torch.cuda.is_available() and torch.distributed.get_backend(world) == "nccl":
        per_host = min(torch.cuda.device_count(), per_host)
    return ProcessGroups(*_init_intra_and_inter_node_groups(world, per_host))


def _init_intra_and_inter_node_groups(
    global_group: Any, num_devices_per_node: int
) -> tuple[Any, Any]:
    """This rank's (intra-node, inter-node) groups of ``global_group`` with
    ``num_devices_per_node`` ranks per node (torch's name): ranks of one node
    shard, ranks with the same local rank replicate. Every rank creates every group."""
    ranks = _comm.group_ranks(global_group)
    rank = global_group.rank()
    intra = inter = None
    for start in range(0, len(ranks), num_devices_per_node):
        group = _comm.new_group(ranks[start : start + num_devices_per_node])
        if start <= rank < start + num_devices_per_node:
            intra = group
    for local in range(num_devices_per_node):
        group = _comm.new_group(ranks[local::num_devices_per_node])
        if rank % num_devices_per_node == local:
            inter = group
    assert intra is not None and inter is not None
    return intra, inter


def resolve_strategy(strategy: ShardingStrategy | None, shard_group_size: int) -> ShardingStrategy:
    strategy = strategy or ShardingStrategy.FULL_SHARD
    if (
        shard_group_size == 1
        and strategy is not ShardingStrategy.NO_SHARD
        and strategy not in HYBRID_SHARDING_STRATEGIES
    ):
        warnings.warn(
            f"FSDP is switching to use `NO_SHARD` instead of {strategy} since the world size is 1.",
            stacklevel=4,
        )
        return ShardingStrategy.NO_SHARD
    if strategy is ShardingStrategy.NO_SHARD and shard_group_size > 1:
        warnings.warn(
            "The `NO_SHARD` sharding strategy is deprecated. If having issues, please use "
            "`DistributedDataParallel` instead.",
            FutureWarning,
            stacklevel=4,
        )
    return strategy


_HANDLE_STRATEGIES = {s: HandleShardingStrategy[s.name] for s in ShardingStrategy}


def handle_strategy(strategy: ShardingStrategy, shard_group_size: int) -> HandleShardingStrategy:
    """(A strategy that is no ``ShardingStrategy`` raises torch's ``KeyError``.)"""
    if shard_group_size == 1:
        return HandleShardingStrategy.NO_SHARD
    return _HANDLE_STRATEGIES[strategy]


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
        if _registry.has_fsdp(module):
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


def check_single_device(params: list[nn.Parameter], device_id: object) -> None:
    """A unit's parameters live on one device; a module partly on the CPU may
    be brought together by ``device_id`` (torch's checks and messages)."""
    devices = {p.device for p in params}
    if len(devices) == 2 and torch.device("cpu") in devices:
        if device_id is None:
            raise RuntimeError(
                "To support a module with both CPU and GPU params, "
                "please pass in device_id argument."
            )
    elif len(devices) > 1:
        raise RuntimeError(f"FSDP only supports single device modules but got params on {devices}")


def _current_device(device_type: str) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


def _default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(device_id: int | torch.device | str | None, rank: int) -> torch.device | None:
    """``device_id`` as a device; an accelerator without an index means the
    current one (with torch's warning)."""
    if device_id is None:
        return None
    if isinstance(device_id, int):
        return torch.device(_default_device_type(), device_id)
    device = torch.device(device_id)
    if device.type != "cpu" and device.index is None:
        current = _current_device(device.type)
        warnings.warn(
            f"FSDP got the argument `device_id` {device_id} on rank {rank}, which does not "
            f"have an explicit index. FSDP will use the current device {current}. If this is "
            f"incorrect, please explicitly call `torch.{device.type}.set_device()` before FSDP "
            "initialization or pass in the explicit device index as the `device_id` argument.",
            stacklevel=5,
        )
        return current
    return device


def compute_device(
    params: list[nn.Parameter], device_id: torch.device | None, rank: int
) -> torch.device:
    """See [Note: Devices]; a ``device_id`` other than the compute device raises."""
    param = params[0] if params else None
    if param is not None and param.device.type != "cpu":
        device = param.device
    else:
        device = _current_device(
            device_id.type if device_id is not None else _default_device_type()
        )
    if device_id is not None and device != device_id:
        raise ValueError(
            f"Inconsistent compute device and `device_id` on rank {rank}: {device} vs {device_id}"
        )
    return device


def _warn_cpu_init() -> None:
    warnings.warn(
        "The passed-in `module` is on CPU and will thus have FSDP's sharding initialization run "
        "on CPU, which may be slower than on GPU. We recommend passing in the `device_id` "
        "argument for FSDP to move `module` to GPU for the sharding initialization. `module` "
        "must also be on GPU device to work with the `sync_module_states=True` flag since that "
        "requires GPU communication.",
        stacklevel=5,
    )


def modules_to_materialize(root: nn.Module, ignored: Ignored) -> list[nn.Module]:
    """Breadth-first from ``root``, stopping at units already built and at ignored modules."""
    result: list[nn.Module] = []
    queue = collections.deque([root])
    seen = {root}
    while queue:
        module = queue.popleft()
        result.append(module)
        for child in module.children():
            if child not in seen and not _registry.has_fsdp(child) and child not in ignored.modules:
                seen.add(child)
                queue.append(child)
    return result


def materialize(
    root: nn.Module,
    ignored: Ignored,
    param_init_fn: Callable[[nn.Module], None] | None,
    device: torch.device,
) -> None:
    """Initialises a unit whose parameters or buffers are on the meta device
    (see [Note: Meta-device initialisation])."""
    modules = modules_to_materialize(root, ignored)
    states = (
        t
        for m in modules
        for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))
        if not (isinstance(t, nn.Parameter) and t in ignored.params)
    )
    if not any(t.is_meta for t in states):
        return
    if param_init_fn is not None:
        if not callable(param_init_fn):
            raise ValueError(
                f"Expected {param_init_fn} to be callable but got {type(param_init_fn)}"
            )
        for module in modules:
            param_init_fn(module)
        return
    module = root
    try:
        with torch.no_grad():
            for module in modules:
                if any(True for _ in (*module.parameters(False), *module.buffers(False))):
                    module.to_empty(device=device, recurse=False)
                    module.reset_parameters()  # type: ignore[operator]
    except BaseException as e:
        warnings.warn(
            "Unable to call `reset_parameters()` for module on meta device with error "
            f"{e}. Please ensure that your module oftype {type(module)} implements a "
            "`reset_parameters()` method.",
            stacklevel=5,
        )
        raise


def move_to(modules: list[nn.Module], device: torch.device, ignored: Ignored) -> None:
    """``device_id``: what is on the CPU moves (parameters with their gradients,
    and buffers); what is elsewhere stays, for ``compute_device`` to check."""
    cpu = torch.device("cpu")
    with torch.no_grad():
        for module in modules:
            for param in module._parameters.values():
                if param is None or param in ignored.params or param.device != cpu:
                    continue
                param.data = param.data.to(device)
                if param.grad is not None:
                    param.grad.data = param.grad.to(device)
            for name, buffer in list(module._buffers.items()):
                if buffer is not None and buffer.device == cpu:
                    module._buffers[name] = buffer.to(device)


def check_scalar_params(root: nn.Module, params: list[nn.Parameter]) -> None:
    for param in params:
        if param.dim() == 0:
            name = next(n for n, p in root.named_parameters() if p is param)
            raise ValueError(
                "FSDP doesn't support scalar parameters. "
                f"Change {name} to a 1D tensor with numel equal to 1."
            )


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


def check_dtensor_params(
    root: nn.Module, params: list[nn.Parameter], extension: DTensorExtensions | None
) -> None:
    """DTensor parameters need a unit over a slice of their mesh (see [Note:
    Tensor-parallel parameters])."""
    if extension is not None:
        return
    for param in params:
        if isinstance(param, DTensor):
            name = next(n for n, p in root.named_parameters() if p is param)
            raise RuntimeError(
                f"FSDP got the DTensor parameter {name} (placements {param.placements}): "
                "DTensor parameters are flattened through their local tensors only when "
                "device_mesh is the data-parallel dimension of the mesh their tensor "
                'parallelism was sliced from (e.g. device_mesh=mesh_2d["dp"]), '
                "not with a process group or a mesh of its own"
            )


def build_unit(
    owner: nn.Module,
    managed: nn.Module,
    args: UnitArgs,
    ignored: Ignored,
    groups: ProcessGroups,
    device_mesh: Any = None,
) -> FSDPState:
    """Creates the unit's state and its (sharded) flat parameter; with a
    ``device_mesh`` sliced from a larger mesh, its DTensor parameters compose
    with tensor parallelism (fsdp._dtensor_extensions)."""
    strategy = resolve_strategy(args.sharding_strategy, groups.shard.size())
    rank = groups.shard.rank()
    check_single_device(managed_params(managed_modules(managed, ignored), ignored), args.device_id)
    device_id = resolve_device(args.device_id, rank)
    default_type = device_id.type if device_id is not None else _default_device_type()
    materialize(managed, ignored, args.param_init_fn, device_id or _current_device(default_type))
    modules = managed_modules(managed, ignored)
    if device_id is not None:
        move_to(modules, device_id, ignored)
    params = managed_params(modules, ignored)
    extension = DTensorExtensions.for_mesh(device_mesh)
    check_dtensor_params(managed, params, extension)
    buffers = managed_buffers(modules)
    device = compute_device(params, device_id, rank)
    if device_id is None and params and params[0].device.type == "cpu" and device.type != "cpu":
        _warn_cpu_init()
    check_scalar_params(managed, params)
    if args.sync_module_states:
        sync_module_states(managed, params, groups, device)
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
    handle = (
        _build_handle(params, managed, device, strategy, config, groups, extension)
        if params
        else None
    )
    return FSDPState(owner, config, groups, device, handle, buffers, ignored, device_mesh)


def _build_handle(
    params: list[nn.Parameter],
    managed: nn.Module,
    device: torch.device,
    strategy: ShardingStrategy,
    config: UnitConfig,
    groups: ProcessGroups,
    extension: DTensorExtensions | None,
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
        fsdp_extension=extension,
        use_unsafe_setattr=config.env.use_unsafe_setattr,
        replicate_group=groups.replicate,
        skip_writeback_check=config.env.skip_writeback_check,
    )
    handle.shard_in_place()
    if config.cpu_offload.offload_params and handle.flat_param.device.type != "cpu":
        handle.move_shard_to(torch.device("cpu"))
    return handle
