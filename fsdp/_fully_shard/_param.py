"""One parameter under ``fully_shard``: its sharded DTensor, its unsharded
tensor, and the moves between them.

[Note: A parameter's tensors]
- The *sharded parameter* is a ``DTensor`` on the group's mesh, ``Shard(d)``
  (``d`` = 0 unless ``shard_placement_fn`` says otherwise; ``(Replicate(),
  Shard(d))`` on an HSDP mesh). It is what the module holds outside forward and
  backward, what the optimizer steps and what state dicts save.
- Its local tensor is a view of ``sharded_data``, a 1-D buffer padded to the
  size of rank 0's chunk: ``torch.chunk`` gives the first ranks
  ``ceil(n / world)`` rows and the last ones fewer (perhaps none), so every
  rank's buffer has the same size and the all-gather needs no padding step.
  The padding stays zero. A shard dimension other than 0 must divide evenly.
- The *unsharded parameter* is a plain ``nn.Parameter`` of the original size,
  a view of ``unsharded_data``: that parameter's part of an all-gather output
  (every rank's padded chunk, in rank order), which it keeps across
  iterations. Freeing and reallocating it resizes its storage, so the tensor
  objects autograd saved for backward stay valid (torch's design, see
  ``storage.resize_``).
- After a forward with ``reshard_after_forward=k`` the module holds a
  *post-forward parameter*: the rank's ``1/k`` part of the unsharded data on the
  post-forward mesh (fsdp._fully_shard._mesh), which backward all-gathers from.

[Note: Tensor parallel parameters]
A parameter that is already a ``DTensor`` (tensor or expert parallelism over a
model-parallel mesh) is sharded through its local tensor, as a plain one is.
Its sharded form is a DTensor on the data-parallel dimensions followed by the
model-parallel ones, with ``Shard(d)`` (``_StridedShard`` where the model
parallelism also splits dimension ``d``, so the global layout stays right)
before its own placements; its unsharded form is the DTensor it was, and its
gradient is brought to its own placements (a partial sum reduced over the
model-parallel mesh) before the data-parallel reduction. Torch's rule, as the
state dicts and checkpoints of a 2-D model depend on it.

[Note: Re-reading the sharded parameter]
``nn.Module._apply`` (``to_empty``, ``.to(dtype)``) and
``load_state_dict(assign=True)`` give the sharded DTensor a new local tensor,
unpadded. ``reset_sharded_param`` then pads it again and points the DTensor's
local tensor (its ``_local_tensor``, as torch's FSDP does) at the padded
buffer, so that what the optimizer updates is what the next all-gather sends.

[Note: DTensors without the autograd wrapper]
``DTensor.from_local`` goes through an autograd function (0.4 ms per call on
the CPU); the gradient shards of every step would pay that per parameter. The
sharded parameter and gradient DTensors are made with the ``DTensor``
constructor from a kept ``DTensorSpec`` instead (as torch's FSDP does), outside
autograd: ``as_dtensor``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils.weak import WeakIdKeyDictionary

from fsdp._fully_shard._api import MixedPrecisionPolicy
from fsdp._fully_shard._extensions import ExtensionGather, has_extension
from fsdp._fully_shard._mesh import MeshInfo, spmd_mesh
from fsdp._storage import alloc_storage, free_storage

__all__ = ["ParamLocation", "ShardedParam", "as_dtensor", "orig_uid"]


_UIDS = itertools.count()
# Original parameters, by identity, to the uid of their first sharding: a parameter
# tied across two ``fully_shard`` calls is sharded twice under one uid (weak, so
# no parameter is kept alive by it).
_ORIG_UIDS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensors by identity, not ==


def orig_uid(param: Tensor) -> int:
    uid = _ORIG_UIDS.get(param)
    if uid is None:
        uid = _ORIG_UIDS[param] = next(_UIDS)
    return uid


def as_dtensor(local: Tensor, spec: DTensorSpec) -> DTensor:
    """See [Note: DTensors without the autograd wrapper]."""
    return DTensor(local, spec, requires_grad=False)  # type: ignore[call-arg]


def _contiguous_stride(size: torch.Size) -> tuple[int, ...]:
    return torch.empty(size, device="meta").stride()


def _chunk_size(size: torch.Size, world: int, rank: int, dim: int) -> torch.Size:
    """The size of rank ``rank``'s ``torch.chunk`` of a tensor of ``size`` (0 rows
    past the last chunk, other dimensions kept)."""
    per = -(-size[dim] // world)
    rows = max(0, min(per, size[dim] - per * rank))
    return torch.Size([*size[:dim], rows, *size[dim + 1 :]])


def _same_memory(data: Tensor, local: Tensor) -> bool:
    """Whether ``local`` is a view of the padded shard ``data`` (a tensor
    subclass's by its inner tensors, which alone have storage)."""
    if is_traceable_wrapper_subclass(data) and is_traceable_wrapper_subclass(local):
        names, _ = data.__tensor_flatten__()  # type: ignore[attr-defined]
        return all(
            hasattr(local, n) and _same_memory(getattr(data, n), getattr(local, n)) for n in names
        )
    if is_traceable_wrapper_subclass(data) or is_traceable_wrapper_subclass(local):
        return False
    ptr = data.untyped_storage().data_ptr()
    return ptr > 0 and ptr == local.untyped_storage().data_ptr()


@dataclass
class ParamLocation:
    """Where the module tree holds a parameter: ``module.name``, and the other
    places a shared module or a tied parameter puts the same tensor."""

    module: nn.Module
    name: str
    shared: list[tuple[nn.Module, str]] = field(default_factory=list)

    def set(self, param: nn.Parameter) -> None:
        _set_param(self.module, self.name, param)
        for module, name in self.shared:
            _set_param(module, name, param)

    def get(self) -> nn.Parameter:
        return getattr(self.module, self.name)


def _set_param(module: nn.Module, name: str, param: nn.Parameter) -> None:
    # Straight into ``_parameters`` where the module keeps ``nn.Module``'s
    # ``__setattr__`` (its checks cost microseconds per parameter and hook).
    if type(module).__setattr__ is nn.Module.__setattr__:
        module._parameters[name] = param
    else:
        setattr(module, name, param)


class ShardedParam:
    """One parameter: its sharded, unsharded and post-forward tensors (see
    [Note: A parameter's tensors])."""

    location: ParamLocation
    mesh_info: MeshInfo
    post_forward_info: MeshInfo | None
    device: torch.device
    offload: bool
    pin_memory: bool
    shard_dim: int
    orig_size: torch.Size
    orig_stride: tuple[int, ...]
    sharded_size: torch.Size
    sharded_stride: tuple[int, ...]
    padded_sharded_size: torch.Size
    sharded_data: Tensor  # 1-D, padded
    sharded_param: nn.Parameter  # DTensor
    spec: DTensorSpec
    tp_spec: DTensorSpec | None  # a tensor-parallel parameter's own spec (its unsharded form)
    post_forward_size: torch.Size | None
    post_forward_data: Tensor | None  # 1-D, while resharded to the post-forward mesh
    unsharded_data: Tensor | None  # 1-D all-gather output, from the first unshard on
    unsharded_param: nn.Parameter | None
    accumulated_grad: Tensor | None  # reduce-dtype gradient kept without sync
    orig_dtype: torch.dtype
    param_dtype: torch.dtype | None  # None: all-gathered as it is
    reduce_dtype: torch.dtype | None  # None: reduced in the gradient's dtype
    fqn: str
    orig_uid: int  # shared by the shardings of one tied parameter
    mp_policy: MixedPrecisionPolicy
    extension: ExtensionGather | None  # from the first all-gather through an extension
    extended: bool  # the last all-gather's inputs came from the extension

    def __init__(
        self,
        param: nn.Parameter,
        location: ParamLocation,
        mesh_info: MeshInfo,
        post_forward_info: MeshInfo | None,
        device: torch.device,
        shard_dim: int,
        offload: bool,
        pin_memory: bool,
    ) -> None:
        self.location = location
        self.mesh_info = mesh_info
        self.post_forward_info = post_forward_info
        self.device = device
        self.offload = offload
        self.pin_memory = pin_memory and offload and device.type != "cpu"
        self.shard_dim = shard_dim
        self.unsharded_data = None
        self.unsharded_param = None
        self.post_forward_data = None
        self.accumulated_grad = None
        self.param_dtype = None
        self.reduce_dtype = None
        self.orig_dtype = param.dtype
        self.fqn = location.name
        self.orig_uid = orig_uid(param)
        self.mp_policy = MixedPrecisionPolicy()
        self.extension, self.extended = None, False
        self._shard(param)
        self.post_forward_size = self._post_forward_size()

    # ------------------------------------------------------------ construction

    @torch.no_grad()
    def _shard(self, param: nn.Parameter) -> None:
        if not param.is_contiguous():
            raise NotImplementedError(
                "FSDP does not support non-contiguous parameters yet: "
                f"{param.shape=} {param.stride()=}"
            )
        self.tp_spec = param._spec if isinstance(param, DTensor) else None  # type: ignore[attr-defined]
        data: Tensor = param._local_tensor if isinstance(param, DTensor) else param  # type: ignore[attr-defined]
        info, dim = self.mesh_info, self.shard_dim
        size = data.size()
        if dim >= data.ndim:
            raise AssertionError(
                f"Shard dim {dim} is invalid for {data.ndim}D tensor: {param.shape}"
            )
        if dim > 0 and size[dim] % info.shard_size != 0:
            raise NotImplementedError(
                f"FSDP does not support uneven sharding on dim {dim}: "
                f"{size} (world size: {info.shard_size})"
            )
        self.orig_size, self.orig_stride = size, _contiguous_stride(size)
        self.sharded_size = _chunk_size(size, info.shard_size, info.shard_rank, dim)
        self.sharded_stride = _contiguous_stride(self.sharded_size)
        self.padded_sharded_size = _chunk_size(size, info.shard_size, 0, dim)
        rows = self.sharded_size[dim]
        padded = data.new_zeros(self.padded_sharded_size)
        if rows > 0:
            start = self.padded_sharded_size[dim] * info.shard_rank
            padded.narrow(dim, 0, rows).copy_(data.detach().narrow(dim, start, rows))
        padded = self._placed(padded)
        self.sharded_data = padded.view(-1)
        self.spec = self._sharded_spec(param)
        local = padded.narrow(dim, 0, rows)
        self.sharded_param = nn.Parameter(as_dtensor(local, self.spec), param.requires_grad)
        self.location.set(self.sharded_param)

    def _sharded_spec(self, param: nn.Parameter) -> DTensorSpec:
        """``Shard(d)`` on the mesh (after ``Replicate()`` on an HSDP mesh); a
        tensor-parallel parameter's mesh and placements follow (see [Note: Tensor
        parallel parameters])."""
        info, dim = self.mesh_info, self.shard_dim
        tp = self.tp_spec
        data_parallel: Placement = Shard(dim)
        if tp is not None and tp.num_shards_map[dim] > 1:
            data_parallel = _StridedShard(dim, split_factor=tp.num_shards_map[dim])
        placements: tuple[Placement, ...] = (data_parallel,)
        if info.is_hsdp:
            placements = (Replicate(), data_parallel)
        if tp is None:
            meta = TensorMeta(param.size(), param.stride(), param.dtype)
            return DTensorSpec(info.mesh, placements, tensor_meta=meta)
        if len(tp.placements) > 2:
            raise NotImplementedError(
                f"FSDP only supports 1D TP/EP or 2D EP+TP, not {tp.placements}"
            )
        mesh = spmd_mesh(info.mesh, tp.mesh)
        return DTensorSpec(mesh, (*placements, *tp.placements), tensor_meta=tp.tensor_meta)

    def _placed(self, padded: Tensor) -> Tensor:
        if not self.offload or padded.is_meta:
            return padded
        padded = padded.cpu()
        return padded.pin_memory() if self.pin_memory else padded

    def _post_forward_size(self) -> torch.Size | None:
        info = self.post_forward_info
        if info is None or info is self.mesh_info:
            return None
        return _chunk_size(self.orig_size, info.shard_size, info.shard_rank, 0)

    def init_dtypes(self, mp_policy: MixedPrecisionPolicy) -> None:
        """The dtypes to all-gather and reduce in (``None``: no cast needed),
        read when the tree is first run (the user may cast parameters before)."""
        self.orig_dtype = self.sharded_param.dtype
        self.mp_policy = mp_policy
        param_dtype, reduce_dtype = mp_policy.param_dtype, mp_policy.reduce_dtype
        if reduce_dtype == param_dtype:
            reduce_dtype = None
        if param_dtype == self.orig_dtype or not self.orig_dtype.is_floating_point:
            param_dtype = None
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype

    @torch.no_grad()
    def reset_sharded_param(self) -> None:
        """See [Note: Tensor parallel parameters]
        A parameter that is already a ``DTensor`` (tensor or expert parallelism over a
        model-parallel mesh) is sharded through its local tensor, as a plain one is.
        Its sharded form is a DTensor on the data-parallel dimensions followed by the
        model-parallel ones, with ``Shard(d)`` (``_StridedShard`` where the model
        parallelism also splits dimension ``d``, so the global layout stays right)
        before its own placements; its unsharded form is the DTensor it was, and its
        gradient is brought to its own placements (a partial sum reduced over the
        model-parallel mesh) before the data-parallel reduction. Torch's rule, as the
        state dicts and checkpoints of a 2-D model depend on it.

        [Note: Re-reading the sharded parameter]."""
        param = self.location.get()
        self.sharded_param = param
        local: Tensor = param._local_tensor  # type: ignore[attr-defined]
        if local.is_meta:
            return
        data = self.sharded_data
        same = _same_memory(data, local)
        padded, changed = local, False
        if local.size() != self.padded_sharded_size and not same:
            if self.shard_dim != 0:
                raise AssertionError(
                    f"Shard({self.shard_dim}) requires even sharding: {local.size()=}"
                )
            padded = local.new_zeros(self.padded_sharded_size)
            padded[: local.size(0)].copy_(local)
            changed = True
        if self.pin_memory and not padded.is_pinned():
            padded, changed = padded.cpu().pin_memory(), True
        if not same:
            self.sharded_data = padded.view(-1)
        if changed:
            rows = self.sharded_size[self.shard_dim]
            param._local_tensor = padded.narrow(self.shard_dim, 0, rows)  # type: ignore[attr-defined]
        self.spec = param._spec  # type: ignore[attr-defined]

    # ------------------------------------------------------------ all-gather

    def gather_inputs(self) -> list[tuple[Tensor, torch.dtype]]:
        """What this rank sends, each with the dtype it is sent in: the padded shard
        (see ``all_gather_input``), or the inputs of the local tensor's all-gather
        extension ([Note: All-gather extensions] in fsdp._fully_shard._extensions)."""
        local: Tensor = self.sharded_param._local_tensor  # type: ignore[attr-defined]
        self.extended = has_extension(local)
        if not self.extended:
            return [(self.all_gather_input(), self.gather_dtype)]
        if self.post_forward_data is not None:
            raise NotImplementedError("all-gather extensions from the post-forward mesh")
        if self.offload:
            local = local.to(self.device, non_blocking=True)
        if self.extension is None:
            mesh = self.mesh_info.mesh
            if mesh.ndim > 1:  # the shard dimension of an HSDP mesh
                mesh = mesh[mesh.mesh_dim_names[-1]]  # type: ignore[index]
            self.extension = ExtensionGather(mesh)
        inputs = self.extension.inputs(
            local,
            self.location.module,
            self.mp_policy,
            (self.orig_size, self.orig_stride),
            self.padded_sharded_size,
        )
        return [(t, t.dtype) for t in inputs]

    def finish_extension(self) -> None:
        """After an all-gather through the extension: its unsharded tensor becomes
        the unsharded parameter, or (later all-gathers) refills it."""
        assert self.extension is not None
        local: Tensor = self.sharded_param._local_tensor  # type: ignore[attr-defined]
        dtype = self.param_dtype or self.orig_dtype
        unsharded = self.extension.post(local, dtype, self.unsharded_param)
        if unsharded is not None:
            self._init_unsharded_param(unsharded)

    def all_gather_input(self) -> Tensor:
        """What this rank sends: the padded shard (or post-forward shard), on the
        device, in ``param_dtype`` (the cast is the copy into the send buffer)."""
        if self.post_forward_data is not None:
            return self.post_forward_data
        data = self.sharded_data
        if self.offload:
            data = data.to(self.device, non_blocking=True)
        return data

    @property
    def gather_dtype(self) -> torch.dtype:
        return self.param_dtype or self.orig_dtype

    def alloc_unsharded(self, numel: int) -> Tensor:
        """The unsharded data, allocated (its first use creates it and the unsharded
        parameter)."""
        data = self.unsharded_data
        if data is None:
            data = torch.empty(numel, dtype=self.gather_dtype, device=self.device)
            self.unsharded_data = data
            self._init_unsharded_param(data)
        else:
            alloc_storage(data)
        return data

    def _init_unsharded_param(self, data: Tensor) -> None:
        view: Tensor = torch.as_strided(data, self.orig_size, self.orig_stride, 0)
        tp = self.tp_spec
        if tp is not None:  # the tensor-parallel DTensor it was, in the all-gather dtype
            meta = tp.tensor_meta
            if meta is not None and meta.dtype != data.dtype:
                tp = replace(tp, tensor_meta=TensorMeta(meta.shape, meta.stride, data.dtype))
            view = as_dtensor(view, tp)
        self.unsharded_param = nn.Parameter(view, self.sharded_param.requires_grad)

    # ------------------------------------------------------------ moves

    def to_sharded(self) -> None:
        self.location.set(self.sharded_param)
        self.post_forward_data = None
        if self.unsharded_data is not None:
            free_storage(self.unsharded_data)
        if self.extension is not None:
            self.extension.free()

    def to_unsharded(self) -> None:
        unsharded = self.unsharded_param
        assert unsharded is not None, "unsharded before any all-gather"
        if unsharded.requires_grad != self.sharded_param.requires_grad:
            unsharded.requires_grad_(self.sharded_param.requires_grad)
        self.location.set(unsharded)
        self.post_forward_data = None

    def to_sharded_post_forward(self) -> None:
        if self.tp_spec is not None:
            raise NotImplementedError(
                "Resharding to smaller mesh is not supported for DTensor parameters yet"
            )
        if self.extended:
            raise NotImplementedError(
                "Resharding to smaller mesh is not supported with all-gather extensions"
            )
        info, data = self.post_forward_info, self.unsharded_data
        assert info is not None and data is not None and self.post_forward_size is not None
        numel = data.numel() // info.shard_size
        self.post_forward_data = data.narrow(0, numel * info.shard_rank, numel).clone()
        local = torch.as_strided(
            self.post_forward_data,
            self.post_forward_size,
            _contiguous_stride(self.post_forward_size),
        )
        spec = DTensorSpec(info.mesh, (Replicate(), Shard(0)), tensor_meta=self.spec.tensor_meta)
        param = nn.Parameter(as_dtensor(local, spec), self.sharded_param.requires_grad)
        self.location.set(param)
        free_storage(data)

    # ------------------------------------------------------------ gradients

    def take_unsharded_grad(self) -> Tensor | None:
        """The gradient to reduce (the accumulated one when gradient sync was off),
        taken from the unsharded parameter; None when it got none."""
        grad = self.accumulated_grad
        if grad is not None:
            self.accumulated_grad = None
            return self._local_grad(grad)
        unsharded = self.unsharded_param
        if unsharded is None or unsharded.grad is None:
            return None
        grad = unsharded.grad
        unsharded.grad = None
        return self._local_grad(grad)

    def _local_grad(self, grad: Tensor) -> Tensor:
        """A tensor-parallel gradient in the parameter's own placements (a partial
        sum is reduced over the model-parallel mesh first), as its local tensor."""
        if not isinstance(grad, DTensor):
            return grad
        assert self.tp_spec is not None
        if grad.placements != self.tp_spec.placements:
            grad = grad.redistribute(placements=self.tp_spec.placements)
        local: Tensor = grad._local_tensor  # type: ignore[attr-defined]
        return local

    def accumulate_unsharded_grad(self) -> None:
        """Adds this backward's gradient to the one kept from earlier backwards
        without gradient sync (in the reduce dtype)."""
        unsharded = self.unsharded_param
        if self.accumulated_grad is None or unsharded is None or unsharded.grad is None:
            return
        self.accumulated_grad += unsharded.grad
        unsharded.grad = None

    def keep_grad_in_reduce_dtype(self) -> None:
        """Without gradient sync: keep the unsharded gradient in ``reduce_dtype``
        (an upcast kept apart from the parameter)."""
        unsharded = self.unsharded_param
        if self.reduce_dtype is None or unsharded is None or unsharded.grad is None:
            return
        if unsharded.grad.dtype == self.reduce_dtype:
            return
        self.accumulated_grad = unsharded.grad.to(self.reduce_dtype)
        unsharded.grad = None

    def zero_unsharded_grad(self) -> Tensor:
        assert self.unsharded_param is not None
        return self._local_grad(torch.zeros_like(self.unsharded_param))

    def set_sharded_grad(self, shard: Tensor) -> None:
        """Adds the reduced gradient shard to the sharded parameter's gradient, or
        makes it the gradient, then runs the parameter's post-accumulate hooks."""
        param = self.sharded_param
        if param.grad is not None:
            param.grad._local_tensor += shard  # type: ignore[attr-defined]
        else:
            param.grad = as_dtensor(shard, self.spec)
        hooks = getattr(param, "_post_accumulate_grad_hooks", None) or {}
        for hook in hooks.values():
            hook(param)

    @property
    def _param_fqn(self) -> str:
        """torch's name for ``fqn`` (upstream's tests read it)."""
        return self.fqn

    def __repr__(self) -> str:
        return f"ShardedParam(fqn={self.fqn}, orig_size={self.orig_size})"
