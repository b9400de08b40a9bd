"""The memory behind a flat parameter: this rank's shard, and the unsharded copy
that comes and goes.

[Note: Storage that comes and goes]
Between uses a rank holds only its shard (``_local_shard``, on the CPU when
parameters are offloaded). Unsharding fills a persistent padded buffer
(``_full_param_padded``, or ``_full_prec_full_param_padded`` for a
full-precision unshard under parameter mixed precision) whose *storage* is
resized to full size and back to 0; the tensor object stays. Views created in
forward from that buffer therefore become valid again when backward re-fills
the storage, which is what lets autograd use forward's views after a reshard.
Under parameter mixed precision the shard is first cast into ``_mp_shard``
(for ``NO_SHARD`` that cast is the unsharded parameter itself). An offloaded
shard is always copied for unsharding, also when the compute device is the CPU,
and ``summon_full_params(offload_to_cpu=True)`` always exposes a copy: what
``writeback`` decides must not depend on where the computation runs. The storage
issues no collective: the runtime asks it for the all-gather input and output,
runs the collective through ``fsdp._comm``, then hands the result back.

[Note: The storage's states]
``SHARDED``: ``flat_param.data`` is the local shard. ``UNSHARDED``: it is the
unsharded, unpadded flat parameter on the compute device. An unsharded buffer
may stay allocated while ``SHARDED`` (kept since forward, or filled by a
prefetch): ``ready_unsharded`` finds it, and the next unshard needs no
communication. Transitions are checked.

[Note: A full-precision unshard drops the low-precision copy]
A unit whose forward kept its unsharded parameter (the root, ``SHARD_GRAD_OP``)
holds it in the parameter dtype. An unshard in full precision (an eval forward
under ``FSDP_USE_FULL_PREC_IN_EVAL``, a summon) frees that copy, as torch's FSDP
does: the full-precision parameters it shows may be edited, and the next
low-precision forward or backward must gather them again rather than compute
with the old copy. The full-precision copy is freed at the next reshard (torch's
FSDP keeps it where forward kept the unit unsharded, and computes the next eval
with it after an optimizer step: ``KnownDefects.keeps_full_precision_eval_copy``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from fsdp._dtensor_extensions import local_of
from fsdp._layout import FlatParamLayout, ParamInfo, ShardLayout, ShardParamInfo, SharedParamInfo


class FlatParameter(torch.nn.Parameter):
    """The flat parameter of one FSDP unit.

    Between uses ``data`` is this rank's shard (``_local_shard``); during
    forward and backward it is the unsharded, unpadded flat parameter. The
    attributes are torch's, so that code written against torch's FSDP reads them.
    """

    _is_sharded: bool
    _local_shard: Tensor
    _full_param_padded: Tensor
    _full_prec_full_param_padded: Tensor
    _mp_shard: Tensor  # only set when parameter mixed precision is used
    _cpu_grad: Tensor  # only set when parameters are offloaded
    _shard_param_infos: tuple[ShardParamInfo, ...]
    _numels_with_padding: tuple[int, ...]
    _is_padding_mask: list[bool]
    _padded_unsharded_size: torch.Size
    _unpadded_unsharded_size: torch.Size
    _sharded_size: torch.Size
    # what was flattened (torch's FlatParameter metadata; see describe_params)
    _num_params: int
    _param_infos: tuple[ParamInfo, ...]
    _shared_param_infos: tuple[SharedParamInfo, ...]
    _fqns: tuple[str, ...]
    _shapes: tuple[torch.Size, ...]
    _strides: tuple[tuple[int, ...], ...]
    _contiguities: tuple[bool, ...]
    _numels: tuple[int, ...]
    _modules: set[nn.Module]
    _params: list[nn.Parameter] | None  # the original parameters (use_orig_params only)
    _shared_params: list[nn.Parameter] | None  # their shared aliases (use_orig_params only)

    def __new__(cls, data: Tensor, requires_grad: bool = True) -> FlatParameter:
        return torch.Tensor._make_subclass(cls, data, requires_grad)  # type: ignore[return-value]

    def describe_params(
        self,
        layout: FlatParamLayout,
        ordered: Sequence[nn.Parameter],
        orig_params: list[nn.Parameter] | None,
    ) -> None:
        """torch's metadata of what this flat parameter holds: the parameters'
        infos, names, shapes, strides and numels, the modules they live in, and,
        under ``use_orig_params``, the original parameter variables. ``orig_params``
        is the list the unit keeps (a writeback that replaces a variable replaces it
        there, so ``_params`` stays current); ``None`` without ``use_orig_params``,
        as torch's ``_params`` and ``_shared_params``."""
        self._num_params = len(layout.param_infos)
        self._param_infos = layout.param_infos
        self._shared_param_infos = layout.shared_param_infos
        self._fqns = layout.fqns
        self._shapes = layout.shapes
        self._strides = tuple(tuple(p.stride()) for p in ordered)
        self._contiguities = tuple(p.is_contiguous() for p in ordered)
        self._numels = layout.numels
        self._modules = {i.module for i in layout.param_infos} | {
            i.module for i in layout.shared_param_infos
        }
        self._params = orig_params
        self._shared_params = None
        if orig_params is not None:  # a shared parameter is its first occurrence's variable
            index = {(id(i.module), i.param_name): k for k, i in enumerate(layout.param_infos)}
            self._shared_params = [
                ordered[index[(id(i.prim_module), i.prim_param_name)]]
                for i in layout.shared_param_infos
            ]


class ShardState(enum.Enum):
    """What ``flat_param.data`` is right now (see [Note: The storage's states])."""

    SHARDED = enum.auto()
    UNSHARDED = enum.auto()

    def is_unsharded(self) -> bool:
        return self is ShardState.UNSHARDED


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


def same_storage(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` share memory (a DTensor's: its local tensor's)."""
    a, b = local_of(a), local_of(b)
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class FlatParamStorage:
    """The shard and unsharded buffers of one flat parameter, and which one
    ``flat_param.data`` is (see the module notes)."""

    flat_param: FlatParameter
    shard: ShardLayout
    device: torch.device
    offload_params: bool
    param_dtype: torch.dtype | None  # MixedPrecision.param_dtype
    force_full_precision: bool
    state: ShardState
    _buffers: tuple[Tensor, ...]  # the unsharded and low-precision buffers, from init_buffers
    _unpadded: dict[int, tuple[Tensor, Tensor]]  # id(padded buffer) -> (it, its unpadded view)

    def __init__(
        self,
        flat_param: FlatParameter,
        shard: ShardLayout,
        device: torch.device,
        offload_params: bool,
        param_dtype: torch.dtype | None,
    ) -> None:
        self.flat_param = flat_param
        self.shard = shard
        self.device = device
        self.offload_params = offload_params
        self.param_dtype = param_dtype
        self.force_full_precision = False
        self.state = ShardState.UNSHARDED  # until shard_in_place
        self._buffers = ()
        self._unpadded = {}
        self._describe_shard()

    # -- precision ------------------------------------------------------------------

    @property
    def orig_dtype(self) -> torch.dtype:
        """The full-precision dtype: the shard's (``module.half()`` changes it)."""
        return self.flat_param._local_shard.dtype

    @property
    def uses_param_mixed_precision(self) -> bool:
        return self.param_dtype is not None and self.param_dtype != self.orig_dtype

    def low_precision_now(self) -> bool:
        return self.uses_param_mixed_precision and not self.force_full_precision

    # -- construction and moves ---------------------------------------------------------

    def _describe_shard(self) -> None:
        """torch's shape attributes of the flat parameter."""
        flat_param = self.flat_param
        flat_param._local_shard = flat_param.data
        flat_param._unpadded_unsharded_size = torch.Size([self.shard.layout.total_numel])
        flat_param._numels_with_padding = self.shard.layout.numels_with_padding
        flat_param._is_padding_mask = list(self.shard.layout.is_padding_mask)
        flat_param._shard_param_infos = self.shard.param_infos
        flat_param._padded_unsharded_size = torch.Size([self.shard.padded_numel])
        flat_param._sharded_size = torch.Size([self.shard.shard_numel])
        flat_param._is_sharded = self.shard.sharded

    def shard_in_place(self) -> None:
        """Replaces the (unsharded) flat parameter's data by this rank's padded shard."""
        assert self.state.is_unsharded(), self.state
        self.flat_param.data = self.shard.local_shard_of(self.flat_param.data)
        self.flat_param._local_shard = self.flat_param.data
        self.state = ShardState.SHARDED

    def move_shard_to(self, device: torch.device) -> None:
        """Moves the local shard (parameter offloading keeps it on the CPU)."""
        assert not self.state.is_unsharded(), self.state
        self.flat_param.data = self.flat_param.data.to(device)
        self.flat_param._local_shard = self.flat_param.data

    def rebind_local_shard(self) -> None:
        """After ``module.to(...)`` moved or cast the flat parameter's data."""
        if not self.state.is_unsharded():
            self.flat_param._local_shard = self.flat_param.data

    def check_device(self) -> None:
        """Torch's checks and messages at lazy initialisation: the module was not
        moved away from where construction put the shard."""
        device = self.flat_param.device
        if self.offload_params and device.type != "cpu":
            raise RuntimeError(
                "An FSDP-managed module with parameter CPU offloading enabled has parameters on "
                f"{device}. Make sure to not move the module from CPU when offloading parameters."
            )
        if not self.offload_params and device != self.device:
            raise RuntimeError(
                f"An FSDP-managed module unexpectedly has parameters on {device}. Make sure to "
                f"move the module to {self.device} before training."
            )

    def init_buffers(self) -> None:
        """At lazy initialisation (the user may have moved or cast the module since
        construction): pins the offloaded shard, creates the unsharded buffers."""
        flat_param = self.flat_param
        flat_param._local_shard = flat_param.data
        if self.offload_params and self.device.type != "cpu":
            flat_param._local_shard = flat_param._local_shard.pin_memory()
            flat_param.data = flat_param._local_shard
        if self.uses_param_mixed_precision:
            assert self.param_dtype is not None
            flat_param._mp_shard = self._empty(self.shard.shard_numel, self.param_dtype)
        if self.shard.sharded:
            flat_param._full_param_padded = self._empty(
                self.shard.padded_numel, self.param_dtype or self.orig_dtype
            )
            if self.uses_param_mixed_precision:
                flat_param._full_prec_full_param_padded = self._empty(
                    self.shard.padded_numel, self.orig_dtype
                )
        names = ("_full_param_padded", "_full_prec_full_param_padded", "_mp_shard")
        self._buffers = tuple(t for n in names if (t := getattr(flat_param, n, None)) is not None)
        self._unpadded = {}

    def _empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        buffer = torch.empty(numel, dtype=dtype, device=self.device)
        free_storage(buffer)
        return buffer

    # -- unshard ---------------------------------------------------------------------

    def is_unsharded(self) -> bool:
        return self.state.is_unsharded()

    def _current_buffer(self) -> Tensor | None:
        """The persistent buffer that holds the unsharded data in the current
        precision, or None when there is none (``NO_SHARD`` in full precision)."""
        flat_param = self.flat_param
        if self.shard.sharded:
            if self.uses_param_mixed_precision and not self.low_precision_now():
                return flat_param._full_prec_full_param_padded
            return flat_param._full_param_padded
        if self.low_precision_now():
            return flat_param._mp_shard
        return None

    def ready_unsharded(self) -> Tensor | None:
        """The unsharded data if it is available without communication or
        copying (a buffer kept since forward or filled by a prefetch, or
        ``NO_SHARD``'s own shard), else None."""
        buffer = self._current_buffer()
        if buffer is not None:
            return None if storage_freed(buffer) else buffer
        local = self.flat_param._local_shard
        return local if local.device == self.device and not self.offload_params else None

    def unshard_input(self) -> Tensor:
        """The all-gather input (sharded strategies) or the unsharded parameter
        (``NO_SHARD``): the local shard, cast to the compute dtype and moved to
        the device as needed."""
        local = self.flat_param._local_shard
        if self.low_precision_now():
            mp_shard = self.flat_param._mp_shard
            alloc_storage(mp_shard)
            with torch.no_grad():
                mp_shard.copy_(local, non_blocking=True)
            return mp_shard
        if local.device != self.device or self.offload_params:
            # An offloaded shard is copied even when the compute device is the
            # CPU: the unsharded parameter is never the offloaded storage itself.
            return local.to(self.device, non_blocking=True, copy=True)
        return local

    def unsharded_buffer(self) -> Tensor:
        """The padded unsharded buffer for the current precision, with storage."""
        buffer = self._current_buffer()
        assert buffer is not None and self.shard.sharded
        alloc_storage(buffer)
        return buffer

    def finish_unshard(self, unsharded: Tensor) -> None:
        """Points the flat parameter at the unsharded data: the filled padded
        buffer (sharded strategies) or ``unshard_input``'s result (``NO_SHARD``)."""
        flat_param = self.flat_param
        if self.shard.sharded:
            flat_param.data = self._unpadded_view(unsharded)
            if self.low_precision_now():
                free_storage(flat_param._mp_shard)
        else:
            flat_param.data = unsharded
        self.state = ShardState.UNSHARDED

    def _unpadded_view(self, padded: Tensor) -> Tensor:
        """``padded[:unpadded numel]``, made once per persistent buffer: the view
        stays valid while the buffer's storage comes and goes (see [Note:
        Storage that comes and goes])."""
        cached = self._unpadded.get(id(padded))
        if cached is None or cached[0] is not padded:
            cached = (padded, padded[: self.shard.layout.total_numel])
            self._unpadded[id(padded)] = cached
        return cached[1]

    def unsharded_to_cpu(self) -> Tensor:
        """summon_full_params(offload_to_cpu=True): the flat parameter becomes a
        CPU copy of the unsharded data; returns the device data."""
        assert self.is_unsharded(), self.state
        device_data = self.flat_param.data
        self.flat_param.data = device_data.to("cpu", copy=True)  # also when computing on the CPU
        return device_data

    # -- reshard ---------------------------------------------------------------------

    def reshard(self, free_unsharded: bool) -> Tensor:
        """Points the flat parameter back at the local shard; returns the data it
        pointed at. ``free_unsharded`` frees the unsharded storage (the runtime
        made sure no pending kernel reads it); otherwise it is kept for the next
        unshard (a ``NO_SHARD`` low-precision copy is always freed, as torch's
        FSDP does: it is rebuilt without communication)."""
        flat_param = self.flat_param
        previous = flat_param.data
        flat_param.data = flat_param._local_shard
        self.state = ShardState.SHARDED
        if free_unsharded:
            self.free_unsharded()
        elif self.low_precision_now() and not self.shard.sharded:
            free_storage(flat_param._mp_shard)
        return previous

    def unsharded_buffers(self) -> list[Tensor]:
        """The allocated unsharded (and low-precision) buffers."""
        return [t for t in self._buffers if not storage_freed(t)]

    def buffers_freed_by_reshard(self, free_unsharded: bool) -> list[Tensor]:
        """What ``reshard(free_unsharded)`` releases (for the stream bookkeeping),
        including a temporary device copy that forward or backward computed with."""
        freed = self.unsharded_buffers() if free_unsharded else []
        mp_shard = getattr(self.flat_param, "_mp_shard", None)
        if not free_unsharded and not self.shard.sharded and self.low_precision_now():
            freed += [mp_shard] if mp_shard is not None and not storage_freed(mp_shard) else []
        if self.is_unsharded():
            freed.append(self.flat_param.data)
        return [t for t in freed if t.device == self.device]  # not a CPU copy

    def free_unsharded(self) -> None:
        for buffer in self._buffers:
            free_storage(buffer)

    def low_precision_unsharded(self) -> Tensor | None:
        """The low-precision unsharded copy when one is allocated, else None."""
        if not self.uses_param_mixed_precision:
            return None
        flat_param = self.flat_param
        buffer = flat_param._full_param_padded if self.shard.sharded else flat_param._mp_shard
        return None if storage_freed(buffer) else buffer

    # -- writing the shard ----------------------------------------------------------------

    def writeback_unsharded(self) -> None:
        """After summon_full_params(writeback=True) or loading a state dict:
        copies this rank's part of the unsharded flat parameter into the shard."""
        flat_param = self.flat_param
        if same_storage(flat_param.data, flat_param._local_shard):
            return
        part = self.shard.own_part(flat_param.data)
        with torch.no_grad():
            flat_param._local_shard[: part.numel()].copy_(part)

    def load_local_shard(self, tensor: Tensor) -> None:
        """Copies ``tensor`` (a saved local shard) into the local shard."""
        with torch.no_grad():
            self.flat_param._local_shard.copy_(tensor)
