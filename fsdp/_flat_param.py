"""The flat parameter: a module's parameters in one 1-D tensor, sharded across ranks.

[Note: Flat parameter layout]
The parameters a unit manages are laid out in module traversal order in one
1-D tensor. A parameter shared by several modules (tied weights) is stored once;
its other names are aliases. With ``use_orig_params=True`` every parameter
starts at an offset aligned to 16 bytes of the forward/backward dtype (the
parameter mixed-precision dtype when one is set), padding with zeros between
parameters, so that original parameters can be exposed as aligned views, and
the flat parameter itself ends with zeros up to a multiple of the world size
(as torch's: its unsharded numel then includes that padding, and
``_numels_with_padding`` / ``_is_padding_mask`` list the parameter and padding
segments). Without ``use_orig_params`` the flat parameter holds the parameters
only. Either way the all-gather buffer is padded to a multiple of the world
size and rank ``r`` keeps elements ``[r*S, (r+1)*S)`` with ``S = padded /
world_size`` (``torch.chunk``'s split). Padding stays zero: no gradient ever
lands there.

[Note: Storage that comes and goes]
Between uses a rank holds only its shard (``_local_shard``). Unsharding fills a
persistent padded buffer (``_full_param_padded``) whose *storage* is resized to
full size and back to 0; the tensor object stays. Views created in forward from
that buffer therefore become valid again when backward re-fills the storage,
which is what lets autograd use forward's views after a reshard.

[Note: What the handle does and does not do]
The handle owns the layout, the buffers, the views the module sees, the
writeback of user changes and the gradient bookkeeping. It issues no
collective: the runtime asks it for the all-gather input and output
(``pre_unshard`` / ``unsharded_buffer``), runs the collective through
``fsdp._comm``, then calls ``post_unshard``.

[Note: Original parameters (use_orig_params=True)]
Between iterations each original ``nn.Parameter`` is a 1-D view of its part of
the local shard (empty on ranks that hold none of it), so optimizers step on the
shard in place; its ``.grad`` is the matching view of the sharded gradient.
During forward and backward the module sees plain ``Tensor`` views of the
unsharded flat parameter (autograd must reach the flat parameter); in forward
they are also listed in ``_parameters`` so ``named_parameters()`` keeps the
original names. Before every unshard, changes the user made (``.data``
assignment, a new Parameter, a new ``.grad``) are written back into the flat
parameter. Strategies that do not reshard after forward keep forward's views
until backward; changing a parameter in between is an error.

[Note: Gradients across synced and no_sync backwards]
Between iterations a flat parameter's gradient is one of two things. After a
synced backward it is the reduced shard (on the CPU when offloading), which the
optimizer steps on. After a ``no_sync()`` backward it is the unsharded, unreduced
local sum, which the next backward keeps accumulating into; a reduced shard
from before the window is then set aside (``_saved_grad_shard``) and added to
the result of the next synced reduction. So any order of synced and ``no_sync``
microbatches sums like DDP. Clearing the gradient inside a window (``.grad =
None``, ``zero_grad(set_to_none=True)``) clears the shard set aside too. A unit
that no gradient reached in a backward gets back what was set aside.

[Note: The post-backward hook's node]
Assigning ``flat_param.data`` a tensor of another device or dtype (unsharding
with CPU offload or parameter mixed precision) makes autograd start a new
``AccumulateGrad`` node for the flat parameter. With several forwards before
one backward, each forward's views then feed their own node, and each node
accumulates into the same ``.grad``. A hook on the tensor
(``register_post_accumulate_grad_hook``) would fire at the first node to finish,
resharding while an earlier forward's backward still needs the unsharded data.
The hook therefore goes on the node of the first forward of the iteration: its
backward runs last. If that forward's graph is never backpropagated, the
runtime's end-of-backward callback runs the post-backward step instead.
"""

from __future__ import annotations

import enum
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from fsdp._common import HandleTrainingState
from fsdp._placeholder import ShardedParamPlaceholder

_ALIGNMENT_BYTES = 16


class HandleShardingStrategy(enum.Enum):
    FULL_SHARD = enum.auto()
    SHARD_GRAD_OP = enum.auto()
    NO_SHARD = enum.auto()
    HYBRID_SHARD = enum.auto()
    _HYBRID_SHARD_ZERO2 = enum.auto()

    def is_sharded(self) -> bool:
        return self is not HandleShardingStrategy.NO_SHARD

    def reshards_after_forward(self) -> bool:
        return self in (HandleShardingStrategy.FULL_SHARD, HandleShardingStrategy.HYBRID_SHARD)


class ShardState(enum.Enum):
    """What ``flat_param.data`` is right now."""

    SHARDED = enum.auto()  # the local shard (full precision, maybe on the CPU)
    UNSHARDED = enum.auto()  # the unsharded, unpadded flat parameter on the device

    def is_unsharded(self) -> bool:
        return self is ShardState.UNSHARDED


class ParamInfo(NamedTuple):
    param_name: str
    module: nn.Module
    module_name: str


class SharedParamInfo(NamedTuple):
    param_name: str
    module: nn.Module
    module_name: str
    prim_param_name: str
    prim_module: nn.Module
    prim_module_name: str


class _ShardParamInfo(NamedTuple):
    """Where one original parameter lies in this rank's shard (indices inclusive)."""

    in_shard: bool
    offset_in_shard: int | None
    numel_in_shard: int | None
    intra_param_start_idx: int | None
    intra_param_end_idx: int | None


class SummonedGrad(NamedTuple):
    """The gathered gradient inside ``summon_full_params(with_grads=True)``:
    None when no rank has a gradient."""

    unsharded: Tensor | None


class FlatParamShardMetadata(NamedTuple):
    param_names: tuple[str, ...]
    param_shapes: tuple[torch.Size, ...]
    param_numels: tuple[int, ...]
    param_offsets: tuple[tuple[int, int], ...]


class FlatParameter(nn.Parameter):
    """The flat parameter of one FSDP unit.

    Between uses ``data`` is this rank's shard (``_local_shard``); during
    forward and backward it is the unsharded, unpadded flat parameter.
    """

    _is_sharded: bool
    _local_shard: Tensor
    _full_param_padded: Tensor
    _full_prec_full_param_padded: Tensor
    _mp_shard: Tensor  # only set when parameter mixed precision is used
    _cpu_grad: Tensor  # only set when parameters are offloaded
    _shard_param_infos: tuple[_ShardParamInfo, ...]
    _numels_with_padding: tuple[int, ...]
    _is_padding_mask: list[bool]
    _padded_unsharded_size: torch.Size
    _unpadded_unsharded_size: torch.Size
    _sharded_size: torch.Size

    def __new__(cls, data: Tensor, requires_grad: bool = True) -> FlatParameter:
        return torch.Tensor._make_subclass(cls, data, requires_grad)  # type: ignore[return-value]


def free_storage(tensor: Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def alloc_storage(tensor: Tensor) -> None:
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


def storage_freed(tensor: Tensor) -> bool:
    return tensor.untyped_storage().size() == 0


def _same_storage(a: Tensor, b: Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _aligned_numel(dtype: torch.dtype) -> int:
    return max(1, _ALIGNMENT_BYTES // torch.empty((), dtype=dtype).element_size())


def _assign_grad(tensor: Tensor, grad: Tensor | None) -> None:
    """Sets ``tensor.grad``, also when the gradient's dtype, shape or device
    differs (low-precision gradients; an unsharded gradient on the device for a
    parameter offloaded to the CPU under ``no_sync``): ``.grad`` only accepts a
    matching tensor, ``.grad.data`` anything."""
    if grad is None or (
        grad.dtype == tensor.dtype and grad.shape == tensor.shape and grad.device == tensor.device
    ):
        tensor.grad = grad
        return
    tensor.grad = None
    tensor.grad = torch.empty_like(tensor)
    tensor.grad.data = grad


class _Layout(NamedTuple):
    """Result of flattening: metadata in flat-parameter order."""

    param_infos: tuple[ParamInfo, ...]
    shared_param_infos: tuple[SharedParamInfo, ...]
    params: tuple[nn.Parameter, ...]
    fqns: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    numels: tuple[int, ...]
    offsets: tuple[int, ...]  # start of each parameter in the flat parameter
    total_numel: int  # with padding inside the flat parameter (see the layout note)
    numels_with_padding: tuple[int, ...]  # parameters and padding segments, in order
    is_padding_mask: tuple[bool, ...]


def _layout(
    params: Sequence[nn.Parameter], module: nn.Module, align_to: int | None, world_size: int
) -> _Layout:
    """See [Note: Flat parameter layout]."""
    infos, shared = _param_infos(params, module)
    ordered = tuple(getattr(i.module, i.param_name) for i in infos)
    offsets, segments, total = [], [], 0
    for param in ordered:
        if align_to is not None and total % align_to:
            segments.append((align_to - total % align_to, True))
            total += segments[-1][0]
        offsets.append(total)
        segments.append((param.numel(), False))
        total += param.numel()
    if align_to is not None and total % world_size:
        segments.append((world_size - total % world_size, True))
        total += segments[-1][0]
    return _Layout(
        param_infos=tuple(infos),
        shared_param_infos=tuple(shared),
        params=ordered,
        fqns=tuple(f"{i.module_name}.{i.param_name}".lstrip(".") for i in infos),
        shapes=tuple(p.shape for p in ordered),
        numels=tuple(p.numel() for p in ordered),
        offsets=tuple(offsets),
        total_numel=total,
        numels_with_padding=tuple(n for n, _ in segments),
        is_padding_mask=tuple(pad for _, pad in segments),
    )


def _param_infos(
    params: Sequence[nn.Parameter], module: nn.Module
) -> tuple[list[ParamInfo], list[SharedParamInfo]]:
    """Each parameter once, in module order; later names of a shared one as aliases."""
    wanted = set(params)
    infos: list[ParamInfo] = []
    shared: list[SharedParamInfo] = []
    seen: dict[nn.Parameter, ParamInfo] = {}
    for module_name, submodule in module.named_modules(remove_duplicate=False):
        for name, param in submodule.named_parameters(recurse=False, remove_duplicate=False):
            if param not in wanted:
                continue
            if param in seen:
                shared.append(SharedParamInfo(name, submodule, module_name, *seen[param]))
                continue
            seen[param] = ParamInfo(name, submodule, module_name)
            infos.append(seen[param])
    return infos, shared


def _check_uniform(params: Sequence[nn.Parameter], use_orig_params: bool) -> None:
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise ValueError(
            f"Must flatten tensors with uniform dtype but got {sorted(map(str, dtypes))}"
        )
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ValueError(f"Must flatten tensors on the same device but got {devices}")
    if not use_orig_params and len({p.requires_grad for p in params}) != 1:
        raise ValueError(
            "Must flatten tensors with uniform `requires_grad` when `use_orig_params=False`"
        )


class FlatParamHandle:
    """Owns one flat parameter: layout, shards, unsharded buffers, views, gradients."""

    flat_param: FlatParameter
    process_group: Any
    rank: int
    world_size: int
    device: torch.device
    _fully_sharded_module: nn.Module
    _sharding_strategy: HandleShardingStrategy
    _offload_params: bool
    _use_orig_params: bool
    _keep_low_precision_grads: bool
    _mp_param_dtype: torch.dtype | None
    _mp_reduce_dtype: torch.dtype | None
    _orig_param_dtype: torch.dtype
    _layout: _Layout
    _params: list[nn.Parameter]  # the original parameters (use_orig_params)
    _tensors: list[Tensor | None]  # forward's unsharded views, reused in backward
    _placeholders: list[ShardedParamPlaceholder]  # use_orig_params=False, between uses
    _grad_none: list[bool]  # the user set this original gradient to None
    _shard_state: ShardState
    _training_state: HandleTrainingState
    _force_full_precision: bool
    _skipped_use_sharded_views: bool
    _forward_views_home: Tensor | None  # what forward's kept views point into
    _saved_grad_shard: Tensor | None  # a gradient from an earlier backward
    _reduced_grad: Tensor | None  # this backward's reduced (sharded) gradient
    _summoned_grad: SummonedGrad | None  # inside summon_full_params(with_grads=True)
    _needs_pre_backward_unshard: bool
    _ran_pre_backward_hook: bool
    _post_backward_called: bool
    _prefetched: bool
    _post_backward_hook: tuple[Any, RemovableHandle] | None

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        fully_sharded_module: nn.Module,
        device: torch.device,
        sharding_strategy: HandleShardingStrategy,
        offload_params: bool,
        mp_param_dtype: torch.dtype | None,
        mp_reduce_dtype: torch.dtype | None,
        keep_low_precision_grads: bool,
        process_group: Any,
        use_orig_params: bool,
        *,
        fsdp_extension: object | None = None,
    ) -> None:
        params = list(params)
        if not params:
            raise ValueError(
                f"Cannot construct a {type(self).__name__} with an empty parameter list"
            )
        if fsdp_extension is not None:
            raise NotImplementedError("FSDP extensions (tensor parallel layouts) are not supported")
        _check_uniform(params, use_orig_params)
        self.process_group = process_group
        self.rank = process_group.rank()
        self.world_size = process_group.size()
        self.device = device
        self._fully_sharded_module = fully_sharded_module
        self._sharding_strategy = sharding_strategy
        self._offload_params = offload_params
        self._use_orig_params = use_orig_params
        self._keep_low_precision_grads = keep_low_precision_grads
        self._mp_param_dtype = mp_param_dtype
        self._mp_reduce_dtype = mp_reduce_dtype
        self._orig_param_dtype = params[0].dtype
        align = _aligned_numel(mp_param_dtype or params[0].dtype) if use_orig_params else None
        self._layout = _layout(params, fully_sharded_module, align, self.world_size)
        self._params = list(self._layout.params)
        self._tensors = [None] * len(self._params)
        self._placeholders = [
            ShardedParamPlaceholder.like(p, fqn) for p, fqn in zip(self._params, self._layout.fqns)
        ]
        self._grad_none = [False] * len(self._params)
        self._shard_state = ShardState.UNSHARDED
        self._training_state = HandleTrainingState.IDLE
        self._force_full_precision = False
        self._skipped_use_sharded_views = False
        self._forward_views_home = None
        self._saved_grad_shard = None
        self._reduced_grad = None
        self._summoned_grad = None
        self._needs_pre_backward_unshard = False
        self._ran_pre_backward_hook = False
        self._post_backward_called = False
        self._prefetched = False
        self._post_backward_hook = None
        self.flat_param = self._flatten()

    # -- construction -----------------------------------------------------------

    def _flatten(self) -> FlatParameter:
        layout = self._layout
        first = layout.params[0]
        with torch.no_grad():
            flat = torch.zeros(layout.total_numel, dtype=first.dtype, device=first.device)
            for param, offset in zip(layout.params, layout.offsets):
                flat[offset : offset + param.numel()].copy_(param.detach().reshape(-1))
        flat_param = FlatParameter(flat, requires_grad=any(p.requires_grad for p in layout.params))
        flat_param._is_sharded = False
        flat_param._local_shard = flat_param.data
        flat_param._unpadded_unsharded_size = flat.size()
        flat_param._numels_with_padding = layout.numels_with_padding
        flat_param._is_padding_mask = list(layout.is_padding_mask)
        flat_param._shard_param_infos = self._get_shard_metadata(0, layout.total_numel - 1)
        return flat_param

    @property
    def uses_sharded_strategy(self) -> bool:
        return self._sharding_strategy.is_sharded()

    @property
    def unpadded_numel(self) -> int:
        return self._layout.total_numel

    @property
    def padded_numel(self) -> int:
        if not self.uses_sharded_strategy:
            return self.unpadded_numel
        return math.ceil(self.unpadded_numel / self.world_size) * self.world_size

    @property
    def shard_numel(self) -> int:
        return (
            self.padded_numel // self.world_size
            if self.uses_sharded_strategy
            else self.unpadded_numel
        )

    @property
    def fqns(self) -> tuple[str, ...]:
        return self._layout.fqns

    @property
    def uses_param_mixed_precision(self) -> bool:
        return self._mp_param_dtype is not None and self._mp_param_dtype != self._orig_param_dtype

    def _low_precision_now(self) -> bool:
        return self.uses_param_mixed_precision and not self._force_full_precision

    def compute_dtype(self) -> torch.dtype:
        """The dtype of the unsharded parameter in the current mode."""
        assert self._mp_param_dtype is not None or not self._low_precision_now()
        return self._mp_param_dtype if self._low_precision_now() else self._orig_param_dtype  # type: ignore[return-value]

    def reduce_dtype(self) -> torch.dtype:
        """Gradients are reduced in ``reduce_dtype``, else ``param_dtype``, else
        the parameter's own dtype; in forced full precision always the latter."""
        if self._force_full_precision:
            return self._orig_param_dtype
        return self._mp_reduce_dtype or self._mp_param_dtype or self._orig_param_dtype

    def grad_dtype(self) -> torch.dtype:
        """The dtype gradients have when the optimizer sees them."""
        if self._keep_low_precision_grads and self._mp_param_dtype is not None:
            return self._mp_param_dtype
        return self._orig_param_dtype

    def shard(self) -> None:
        """Replaces the flat parameter's data by this rank's padded shard.

        With ``use_orig_params=False`` the original names then hold placeholders
        until forward points them at real data (see [Note: Placeholders for
        sharded parameters])."""
        flat_param = self.flat_param
        if self.uses_sharded_strategy:
            start = self.rank * self.shard_numel
            end = start + self.shard_numel - 1
            with torch.no_grad():
                shard = torch.zeros(
                    self.shard_numel, dtype=flat_param.dtype, device=flat_param.device
                )
                real = flat_param.data[start : min(end + 1, self.unpadded_numel)]
                shard[: real.numel()].copy_(real)
            flat_param.data = shard
            flat_param._shard_param_infos = self._get_shard_metadata(start, end)
        flat_param._is_sharded = self.uses_sharded_strategy
        flat_param._sharded_size = flat_param.size()
        flat_param._padded_unsharded_size = torch.Size([self.padded_numel])
        flat_param._local_shard = flat_param.data
        self._shard_state = ShardState.SHARDED
        if self._use_orig_params:
            self._use_sharded_views()
        else:
            self._show_resharded_params()

    def move_shard_to(self, device: torch.device) -> None:
        """Moves the local shard (parameter offloading keeps it on the CPU)."""
        flat_param = self.flat_param
        flat_param.data = flat_param.data.to(device)
        flat_param._local_shard = flat_param.data
        if self._use_orig_params:
            self._use_sharded_views()

    def rebind_local_shard(self) -> None:
        """After ``module.to(...)`` moved or cast the flat parameter."""
        if self.is_unsharded():
            return
        flat_param = self.flat_param
        flat_param._local_shard = flat_param.data
        self._orig_param_dtype = flat_param.dtype
        if not self._use_orig_params:
            self._placeholders = [
                ShardedParamPlaceholder(shape, flat_param.dtype, flat_param.device, fqn)
                for shape, fqn in zip(self._layout.shapes, self._layout.fqns)
            ]
            self._show_resharded_params()

    def deregister_orig_params(self) -> None:
        """Removes the original parameters from their modules (``_apply``)."""
        self._release_orig_params()

    def register_orig_params(self) -> None:
        """Puts the original parameters back, as views of the current flat parameter."""
        self._use_sharded_views()

    def _release_orig_params(self) -> None:
        """``use_orig_params=False``: the module keeps no original parameter."""
        for info in (*self._layout.param_infos, *self._layout.shared_param_infos):
            info.module._parameters.pop(info.param_name, None)
            info.module.__dict__.pop(info.param_name, None)

    def _get_shard_metadata(self, start: int, end: int) -> tuple[_ShardParamInfo, ...]:
        """Where each parameter lies in the flat range ``[start, end]`` (inclusive)."""
        infos = []
        for offset, numel in zip(self._layout.offsets, self._layout.numels):
            last = offset + numel - 1
            if numel == 0 or last < start or offset > end:
                infos.append(_ShardParamInfo(False, None, None, None, None))
                continue
            intra_start = max(start, offset) - offset
            intra_end = min(end, last) - offset
            infos.append(
                _ShardParamInfo(
                    True,
                    max(offset, start) - start,
                    intra_end - intra_start + 1,
                    intra_start,
                    intra_end,
                )
            )
        return tuple(infos)

    def shard_metadata(self) -> FlatParamShardMetadata:
        names, shapes, numels, offsets = [], [], [], []
        for i, info in enumerate(self.flat_param._shard_param_infos):
            if not info.in_shard:
                continue
            assert info.intra_param_start_idx is not None and info.intra_param_end_idx is not None
            names.append(self._layout.fqns[i])
            shapes.append(self._layout.shapes[i])
            numels.append(self._layout.numels[i])
            offsets.append((info.intra_param_start_idx, info.intra_param_end_idx))
        return FlatParamShardMetadata(tuple(names), tuple(shapes), tuple(numels), tuple(offsets))

    # -- lazy initialisation ----------------------------------------------------

    def init_flat_param_attributes(self) -> None:
        """At the root's first forward (the user may have moved or cast the
        module since construction): binds the local shard, allocates buffers."""
        flat_param = self.flat_param
        flat_param._local_shard = flat_param.data
        self._orig_param_dtype = flat_param.dtype
        # Changes the user made to original parameters before the first forward
        # (or summon) are kept: views are re-pointed below.
        self.writeback_orig_params(skip_check=False)
        if self._offload_params:
            if self.device.type != "cpu":
                flat_param._local_shard = flat_param._local_shard.pin_memory()
                flat_param.data = flat_param._local_shard
            flat_param._cpu_grad = torch.zeros_like(
                flat_param._local_shard, dtype=self.grad_dtype()
            )
            if self.device.type != "cpu":
                flat_param._cpu_grad = flat_param._cpu_grad.pin_memory()
        if self.uses_param_mixed_precision:
            flat_param._mp_shard = torch.empty(
                self.shard_numel, dtype=self._mp_param_dtype, device=self.device
            )
            free_storage(flat_param._mp_shard)
        if self.uses_sharded_strategy:
            flat_param._full_param_padded = self._empty_padded(
                self._mp_param_dtype or self._orig_param_dtype
            )
            if self.uses_param_mixed_precision:
                flat_param._full_prec_full_param_padded = self._empty_padded(self._orig_param_dtype)
        if self._use_orig_params:
            self._use_sharded_views()

    def _empty_padded(self, dtype: torch.dtype) -> Tensor:
        buffer = torch.empty(self.padded_numel, dtype=dtype, device=self.device)
        free_storage(buffer)
        return buffer

    # -- unshard / reshard --------------------------------------------------------

    def is_unsharded(self) -> bool:
        return self._shard_state.is_unsharded()

    def _current_buffer(self) -> Tensor | None:
        """The persistent buffer that holds the unsharded data in the current
        precision, or None when there is none (``NO_SHARD`` in full precision)."""
        flat_param = self.flat_param
        if self.uses_sharded_strategy:
            if self.uses_param_mixed_precision and not self._low_precision_now():
                return flat_param._full_prec_full_param_padded
            return flat_param._full_param_padded
        if self._low_precision_now():
            return flat_param._mp_shard
        return None

    def ready_unsharded(self) -> Tensor | None:
        """The unsharded data if it is available without communication or
        copying (a buffer kept since forward, or ``NO_SHARD``'s own shard), else None."""
        buffer = self._current_buffer()
        if buffer is not None:
            return None if storage_freed(buffer) else buffer
        local = self.flat_param._local_shard
        return local if local.device == self.device else None

    def pre_unshard(self) -> Tensor:
        """The all-gather input (sharded strategies) or the unsharded parameter
        (``NO_SHARD``): the local shard, cast to the compute dtype and moved to
        the device as needed."""
        local = self.flat_param._local_shard
        if self._low_precision_now():
            mp_shard = self.flat_param._mp_shard
            alloc_storage(mp_shard)
            with torch.no_grad():
                mp_shard.copy_(local, non_blocking=True)
            return mp_shard
        if local.device != self.device:
            return local.to(self.device, non_blocking=True)
        return local

    def unsharded_buffer(self) -> Tensor:
        """The padded unsharded buffer for the current precision, with storage."""
        buffer = self._current_buffer()
        assert buffer is not None and self.uses_sharded_strategy
        alloc_storage(buffer)
        return buffer

    def post_unshard(self, unsharded: Tensor) -> None:
        """Points the flat parameter at the unsharded data: the filled padded
        buffer (sharded strategies) or ``pre_unshard``'s result (``NO_SHARD``)."""
        flat_param = self.flat_param
        if self.uses_sharded_strategy:
            flat_param.data = unsharded[: self.unpadded_numel]
            if self._low_precision_now():
                free_storage(flat_param._mp_shard)
        else:
            flat_param.data = unsharded
        self._shard_state = ShardState.UNSHARDED

    def reshard(self, free_unsharded: bool, use_sharded_views: bool = True) -> None:
        """Points the flat parameter back at the local shard. ``free_unsharded``
        frees the unsharded storage (the runtime made sure no pending kernel
        reads it); otherwise it is kept for the next unshard. Without
        ``use_sharded_views`` the original parameters keep forward's views."""
        flat_param = self.flat_param
        forward_data = flat_param.data
        flat_param.data = flat_param._local_shard
        self._shard_state = ShardState.SHARDED
        if free_unsharded:
            self.free_unsharded()
        elif self._low_precision_now() and not self.uses_sharded_strategy:
            free_storage(flat_param._mp_shard)  # derived data, rebuilt without communication
        if not self._use_orig_params:
            if free_unsharded or not self.uses_sharded_strategy:
                self._show_resharded_params()
            return
        if use_sharded_views:
            self._use_sharded_views()
        else:
            self._skipped_use_sharded_views = True
            self._forward_views_home = forward_data

    def unsharded_buffers(self) -> list[Tensor]:
        names = ("_full_param_padded", "_full_prec_full_param_padded", "_mp_shard")
        return [
            t
            for n in names
            if (t := getattr(self.flat_param, n, None)) is not None and not storage_freed(t)
        ]

    def buffers_freed_by_reshard(self, free_unsharded: bool) -> list[Tensor]:
        """What ``reshard(free_unsharded)`` releases (for the stream bookkeeping),
        including a temporary device copy that forward or backward computed with."""
        freed = self.unsharded_buffers() if free_unsharded else []
        mp_shard = getattr(self.flat_param, "_mp_shard", None)
        if not free_unsharded and not self.uses_sharded_strategy and self._low_precision_now():
            freed += [mp_shard] if mp_shard is not None and not storage_freed(mp_shard) else []
        if self.is_unsharded():
            freed.append(self.flat_param.data)
        return [t for t in freed if t.device == self.device]  # not a CPU copy

    def free_unsharded(self) -> None:
        for buffer in self.unsharded_buffers():
            free_storage(buffer)

    def set_force_full_precision(self, enabled: bool) -> None:
        self._force_full_precision = enabled

    # -- views the module sees -------------------------------------------------------

    def _get_unflat_views(self, tensor: Tensor | None = None) -> list[Tensor]:
        flat = self.flat_param if tensor is None else tensor
        layout = self._layout
        return [
            flat[offset : offset + numel].view(shape)
            for offset, numel, shape in zip(layout.offsets, layout.numels, layout.shapes)
        ]

    def _use_unsharded_views(self, as_params: bool) -> None:
        """Sets the original parameter names to views into the unsharded flat
        parameter: ``nn.Parameter`` s when ``as_params`` (summon_full_params,
        state dicts), plain ``Tensor`` views otherwise (forward and backward,
        so that autograd reaches the flat parameter)."""
        views = self._get_unflat_views()
        for i, (view, info) in enumerate(zip(views, self._layout.param_infos)):
            if as_params:
                self._set_param_view(i, info, view)
            else:
                self._set_tensor_view(i, info, view)
        self._alias_shared_params()

    def _set_param_view(self, i: int, info: ParamInfo, view: Tensor) -> None:
        if self._use_orig_params:
            param = self._params[i]
            param.data = view
        else:
            param = nn.Parameter(view, requires_grad=self.flat_param.requires_grad)
        _set_param(info.module, info.param_name, param)

    def _set_tensor_view(self, i: int, info: ParamInfo, view: Tensor) -> None:
        tensor = view
        if self._use_orig_params:
            saved = self._tensors[i]
            if self._training_state is HandleTrainingState.FORWARD:
                self._tensors[i] = view
            elif self._training_state is HandleTrainingState.BACKWARD_PRE and saved is not None:
                saved.data = view  # keeps forward's autograd graph pointing here
                tensor = saved
        if self._use_orig_params:
            # Stays listed (in place, so the order of ``named_parameters()`` is
            # kept): forward code may look its parameters up by name.
            info.module._parameters[info.param_name] = tensor  # type: ignore[assignment]
            object.__setattr__(info.module, info.param_name, tensor)
        else:
            _set_tensor(info.module, info.param_name, tensor)

    def _alias_shared_params(self) -> None:
        for info in self._layout.shared_param_infos:
            prim = getattr(info.prim_module, info.prim_param_name)
            if isinstance(prim, nn.Parameter):
                _set_param(info.module, info.param_name, prim)
            else:
                _set_tensor(info.module, info.param_name, prim)

    def _show_resharded_params(self) -> None:
        """``use_orig_params=False`` between uses: ``NO_SHARD`` shows views of its
        full-precision flat parameter (it is never freed); sharded strategies show
        placeholders (see [Note: Placeholders for sharded parameters])."""
        if not self.uses_sharded_strategy:
            self._use_unsharded_views(as_params=False)
            return
        for info, placeholder in zip(self._layout.param_infos, self._placeholders):
            _set_tensor(info.module, info.param_name, placeholder)
        self._alias_shared_params()

    def _use_sharded_views(self) -> None:
        """``use_orig_params=True``: each original parameter becomes the view of
        its part of the local shard (``NO_SHARD``: of the whole parameter)."""
        self._skipped_use_sharded_views = False
        self._forward_views_home = None
        if not self.uses_sharded_strategy:
            self._use_unsharded_views(as_params=True)
            return
        flat_param = self.flat_param
        for param, info, shard_info in zip(
            self._params, self._layout.param_infos, flat_param._shard_param_infos
        ):
            if shard_info.in_shard:
                start, numel = shard_info.offset_in_shard, shard_info.numel_in_shard
                assert start is not None and numel is not None
                param.data = flat_param[start : start + numel]
            else:
                param.data = torch.empty(0, dtype=flat_param.dtype, device=flat_param.device)
            _set_param(info.module, info.param_name, param)
        self._alias_shared_params()

    def _grad_view(self, i: int, grad: Tensor) -> Tensor | None:
        shard_info = self.flat_param._shard_param_infos[i]
        if not self.uses_sharded_strategy:
            offset, numel = self._layout.offsets[i], self._layout.numels[i]
            return grad[offset : offset + numel].view(self._layout.shapes[i])
        if not shard_info.in_shard:
            return None
        start, numel = shard_info.offset_in_shard, shard_info.numel_in_shard
        assert start is not None and numel is not None
        return grad[start : start + numel]

    def _use_sharded_grad_views(self) -> None:
        """Each original parameter's gradient becomes the view of its part of the
        sharded gradient, except where the user set it to None since the last
        backward (another optimizer's ``zero_grad(set_to_none=True)``)."""
        grad = self.flat_param.grad
        for i, param in enumerate(self._params):
            exposed = grad is not None and param.requires_grad and not self._grad_none[i]
            _assign_grad(param, self._grad_view(i, grad) if exposed else None)

    def sharded_flat_grad(self) -> Tensor | None:
        """The sharded gradient, or None (none yet, or an unsharded one under no_sync)."""
        return self._sharded_flat_grad()

    def use_unsharded_grad(self, unsharded: Tensor | None) -> None:
        """Exposes ``unsharded`` (an unsharded flat gradient, or None when no rank
        has one) on the original parameters, which are unsharded views now."""
        self._summoned_grad = SummonedGrad(unsharded)
        views = self._get_unflat_views(unsharded) if unsharded is not None else None
        for i, param in enumerate(self._params):
            exposed = views is not None and param.requires_grad
            _assign_grad(param, views[i] if exposed else None)  # type: ignore[index]

    def drop_unsharded_grad(self, writeback: bool) -> None:
        """Back to the sharded gradient views after with_grads; ``writeback``
        copies this rank's part of the (possibly edited) gathered gradient into
        the sharded gradient first."""
        summoned, self._summoned_grad = self._summoned_grad, None
        if summoned is None:
            return
        sharded = self._sharded_flat_grad()
        if writeback and summoned.unsharded is not None and sharded is not None:
            part = self._own_part(summoned.unsharded)
            if not _same_storage(part, sharded):
                with torch.no_grad():
                    sharded[: part.numel()].copy_(part)
        self._use_sharded_grad_views()

    def _own_part(self, unsharded: Tensor) -> Tensor:
        """This rank's elements of an unsharded flat tensor (padding excluded)."""
        if not self.uses_sharded_strategy:
            return unsharded
        start = self.rank * self.shard_numel
        return unsharded[start : min(start + self.shard_numel, self.unpadded_numel)]

    def low_precision_unsharded(self) -> Tensor | None:
        """The low-precision unsharded copy when forward kept one, else None."""
        if not self.uses_param_mixed_precision:
            return None
        flat_param = self.flat_param
        buffer = (
            flat_param._full_param_padded if self.uses_sharded_strategy else flat_param._mp_shard
        )
        return None if storage_freed(buffer) else buffer

    def _use_unsharded_grad_views(self) -> None:
        """Under ``no_sync`` the accumulated gradient is unsharded: the original
        parameters (sharded between iterations) get unsharded gradient views."""
        grad = self.flat_param.grad
        if grad is None or grad.numel() != self.unpadded_numel:
            return
        for param, view in zip(self._params, self._get_unflat_views(grad)):
            _assign_grad(param, view if param.requires_grad else None)

    # -- writeback (use_orig_params) ------------------------------------------------

    def writeback_orig_params(self, skip_check: bool) -> None:
        """Copies user changes of original parameters (``.data`` or a new
        Parameter) and of their gradients into the flat parameter. An unsharded
        copy kept since forward is stale afterwards and is freed."""
        if not self._use_orig_params:
            return
        self._reset_grad_if_all_none()
        if skip_check:
            return
        flat_param = self.flat_param
        wrote = False
        for i, (info, shard_info) in enumerate(
            zip(self._layout.param_infos, flat_param._shard_param_infos)
        ):
            if not shard_info.in_shard or not hasattr(info.module, info.param_name):
                continue
            wrote |= self._writeback_param(i, info, shard_info)
            if not self._skipped_use_sharded_views:
                wrote |= self._writeback_grad(i)
        if wrote and not self.is_unsharded():
            self.free_unsharded()
            self._use_sharded_views()
            self._use_sharded_grad_views()

    def _writeback_param(self, i: int, info: ParamInfo, shard_info: _ShardParamInfo) -> bool:
        current = getattr(info.module, info.param_name)
        if self._skipped_use_sharded_views:
            expected, home = self._tensors[i], self._forward_views_home
        else:
            expected, home = self._params[i], self.flat_param
        changed_variable = current is not expected
        if not changed_variable and home is not None and _same_storage(current, home):
            return False
        if self._skipped_use_sharded_views:
            raise AssertionError(
                "FSDP does not support changing the parameters between forward and backward "
                f"for {self._sharding_strategy}"
            )
        if changed_variable:
            self._params[i] = current
        start, numel = self._param_range(i, shard_info)
        source = current if self.uses_sharded_strategy else current.reshape(-1)
        _check_writeback_shape(source, torch.Size([numel]), is_param=True)
        with torch.no_grad():
            self.flat_param._local_shard[start : start + numel].copy_(source.reshape(-1))
        return True

    def _param_range(self, i: int, shard_info: _ShardParamInfo) -> tuple[int, int]:
        if not self.uses_sharded_strategy:
            return self._layout.offsets[i], self._layout.numels[i]
        assert shard_info.offset_in_shard is not None and shard_info.numel_in_shard is not None
        return shard_info.offset_in_shard, shard_info.numel_in_shard

    def _writeback_grad(self, i: int) -> bool:
        param = self._params[i]
        flat_grad = self.flat_param.grad
        if (
            flat_grad is not None
            and param.grad is not None
            and _same_storage(param.grad, flat_grad)
        ):
            return False
        if flat_grad is not None and flat_grad.shape != self.flat_param._local_shard.shape:
            return False  # an unsharded gradient accumulating under no_sync
        start, numel = self._param_range(i, self.flat_param._shard_param_infos[i])
        if param.grad is None:
            if flat_grad is None or not param.requires_grad or self._grad_none[i]:
                return False
            flat_grad[start : start + numel].zero_()  # the user dropped this gradient
            self._grad_none[i] = True
            return True
        self._grad_none[i] = False
        source = param.grad if self.uses_sharded_strategy else param.grad.reshape(-1)
        _check_writeback_shape(source, torch.Size([numel]), is_param=False)
        if flat_grad is None:
            flat_grad = torch.zeros_like(self.flat_param._local_shard, dtype=param.grad.dtype)
            _assign_grad(self.flat_param, flat_grad)
        with torch.no_grad():
            flat_grad[start : start + numel].copy_(param.grad.reshape(-1))
        return True

    def _sharded_flat_grad(self) -> Tensor | None:
        grad = self.flat_param.grad
        if grad is not None and grad.shape == self.flat_param._local_shard.shape:
            return grad
        return None

    def _reset_grad_if_all_none(self) -> None:
        """``zero_grad(set_to_none=True)`` on the original parameters resets the
        flat gradient too (and a shard set aside inside a no_sync window)."""
        if self.flat_param.grad is None or self.is_unsharded():
            return
        if all(p.grad is None for p in self._params if p.requires_grad):
            self.flat_param.grad = None
            self._saved_grad_shard = None

    def writeback_unsharded(self) -> None:
        """After summon_full_params(writeback=True) or loading a state dict:
        copies this rank's part of the unsharded flat parameter into the shard."""
        flat_param = self.flat_param
        if _same_storage(flat_param.data, flat_param._local_shard):
            return
        part = self._own_part(flat_param.data)
        with torch.no_grad():
            flat_param._local_shard[: part.numel()].copy_(part)

    # -- gradients --------------------------------------------------------------------

    def prepare_gradient_for_backward(self) -> None:
        """A gradient that autograd cannot accumulate into (sharded, on the CPU,
        another dtype) is set aside; it is added after the reduction. An
        unsharded gradient (``no_sync``) stays, so autograd adds to it. See
        [Note: Gradients across synced and no_sync backwards]."""
        flat_param = self.flat_param
        grad = flat_param.grad
        if grad is None:
            # The user cleared the gradients inside a no_sync window: the shard
            # set aside before it is cleared too.
            self._saved_grad_shard = None
            return
        data = flat_param.data
        if grad.shape == data.shape and grad.dtype == data.dtype and grad.device == data.device:
            return
        assert self._saved_grad_shard is None, "two gradients set aside"
        self._saved_grad_shard = grad.detach()
        flat_param.grad = None

    def take_unsharded_grad(self) -> Tensor | None:
        """Removes the gradient autograd accumulated, for reduction."""
        grad = self.flat_param.grad
        self.flat_param.grad = None
        return grad

    def set_reduced_grad(self, reduced: Tensor) -> None:
        """Takes this backward's reduced gradient (shard-sized, on the device,
        in the reduce dtype), adds what was set aside and casts for the optimizer."""
        saved, self._saved_grad_shard = self._saved_grad_shard, None
        if saved is not None:
            reduced = reduced.to(saved.dtype) + saved.to(reduced.device, non_blocking=True)
        self._reduced_grad = reduced.to(self.grad_dtype())

    def prepare_gradient_for_optim(self, synced: bool) -> None:
        """Exposes the sharded gradient as ``flat_param.grad`` (the CPU copy when
        offloading) and, with ``use_orig_params``, as the original parameters'
        gradients. Without gradient sync (``no_sync``) the unsharded, unreduced
        gradient stays exposed and a shard set aside before stays aside."""
        flat_param = self.flat_param
        grad, self._reduced_grad = self._reduced_grad, None
        if grad is not None:
            self._grad_none = [False] * len(self._params)
            self._saved_grad_shard = None
        elif synced or flat_param.grad is None:
            # No gradient reached this unit in this backward: what was set
            # aside is the gradient again.
            grad, self._saved_grad_shard = self._saved_grad_shard, None
        if grad is not None:
            if self._offload_params and grad.device.type != "cpu":
                flat_param._cpu_grad.copy_(grad)
                grad = flat_param._cpu_grad
            _assign_grad(flat_param, grad)
        if not self._use_orig_params:
            return
        if self._sharded_flat_grad() is not None or flat_param.grad is None:
            self._use_sharded_grad_views()
        else:
            self._use_unsharded_grad_views()

    def reset_iteration(self) -> None:
        self.remove_post_backward_hook()
        self._training_state = HandleTrainingState.IDLE
        self._ran_pre_backward_hook = False
        self._post_backward_called = False
        self._needs_pre_backward_unshard = False
        self._prefetched = False
        self._tensors = [None] * len(self._params)

    # -- accessors --------------------------------------------------------------------

    def param_infos(self) -> tuple[ParamInfo, ...]:
        return self._layout.param_infos

    def shared_param_infos(self) -> tuple[SharedParamInfo, ...]:
        return self._layout.shared_param_infos

    def orig_params(self) -> list[nn.Parameter]:
        return self._params

    def register_post_backward_hook(self, hook: Callable[[], None]) -> bool:
        """Hooks the ``AccumulateGrad`` node that views made from the flat
                parameter now feed, once per iteration; returns whether this call
                registered it. See [Note: Gradients across synced and no_sync backwards]
        Between iterations a flat parameter's gradient is one of two things. After a
        synced backward it is the reduced shard (on the CPU when offloading), which the
        optimizer steps on. After a ``no_sync()`` backward it is the unsharded, unreduced
        local sum, which the next backward keeps accumulating into; a reduced shard
        from before the window is then set aside (``_saved_grad_shard``) and added to
        the result of the next synced reduction. So any order of synced and ``no_sync``
        microbatches sums like DDP. Clearing the gradient inside a window (``.grad =
        None``, ``zero_grad(set_to_none=True)``) clears the shard set aside too. A unit
        that no gradient reached in a backward gets back what was set aside.

        [Note: The post-backward hook's node]."""
        if self._post_backward_hook is not None or not self.flat_param.requires_grad:
            return False
        grad_fn = self.flat_param.expand_as(self.flat_param).grad_fn
        assert grad_fn is not None, "the post-backward hook needs autograd enabled"
        node = grad_fn.next_functions[0][0]
        self._post_backward_hook = (node, node.register_hook(lambda *_: hook()))
        return True

    def remove_post_backward_hook(self) -> None:
        if self._post_backward_hook is not None:
            self._post_backward_hook[1].remove()
            self._post_backward_hook = None


def _check_writeback_shape(tensor: Tensor, expected: torch.Size, is_param: bool) -> None:
    if tensor.shape != expected:
        what = "parameter" if is_param else "gradient"
        raise RuntimeError(
            f"Cannot writeback when the {what} shape changes\nExpects {expected} but got {tensor.shape}"
        )


def _set_param(module: nn.Module, name: str, param: nn.Parameter) -> None:
    module._parameters[name] = param
    # The instance dict wins over nn.Module.__getattr__ (and subclass
    # __setattr__ overrides are bypassed).
    object.__setattr__(module, name, param)


def _set_tensor(module: nn.Module, name: str, tensor: Tensor) -> None:
    module._parameters.pop(name, None)
    object.__setattr__(module, name, tensor)


def warn_world_size_one(strategy: object) -> None:
    warnings.warn(
        f"FSDP is switching to use `NO_SHARD` instead of {strategy} since the world size is 1.",
        stacklevel=4,
    )
