"""Where each original parameter lies in a flat parameter, and in this rank's shard.

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

[Note: Views from one split]
The original parameters' views of an unsharded flat parameter come from one
``torch.split`` into the layout's segments (parameters and padding), then one
``view`` per parameter. Autograd then has one ``SplitWithSizesBackward`` node
per flat parameter, which writes the whole flat gradient at once. Views made by
slicing each parameter out separately would give each its own ``SliceBackward``
node, each materialising a gradient as large as the flat parameter, summed by
one addition per parameter.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

_ALIGNMENT_BYTES = 16


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


class ShardParamInfo(NamedTuple):
    """Where one original parameter lies in this rank's shard (indices inclusive)."""

    in_shard: bool
    offset_in_shard: int | None
    numel_in_shard: int | None
    intra_param_start_idx: int | None
    intra_param_end_idx: int | None


class FlatParamShardMetadata(NamedTuple):
    param_names: tuple[str, ...]
    param_shapes: tuple[torch.Size, ...]
    param_numels: tuple[int, ...]
    param_offsets: tuple[tuple[int, int], ...]


def aligned_numel(dtype: torch.dtype) -> int:
    return max(1, _ALIGNMENT_BYTES // torch.empty((), dtype=dtype).element_size())


@dataclass(frozen=True)
class FlatParamLayout:
    """The unsharded flat parameter: its segments, in order (see [Note: Flat parameter layout])."""

    param_infos: tuple[ParamInfo, ...]
    shared_param_infos: tuple[SharedParamInfo, ...]
    fqns: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    numels: tuple[int, ...]
    offsets: tuple[int, ...]  # start of each parameter in the flat parameter
    total_numel: int  # with the padding inside the flat parameter
    numels_with_padding: tuple[int, ...]  # parameters and padding segments, in order
    is_padding_mask: tuple[bool, ...]

    @classmethod
    def of(
        cls,
        params: Sequence[nn.Parameter],
        module: nn.Module,
        align_to: int | None,
        world_size: int,
    ) -> tuple[FlatParamLayout, tuple[nn.Parameter, ...]]:
        """The layout of ``params`` under ``module``, and the parameters in flat order."""
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
        layout = cls(
            param_infos=tuple(infos),
            shared_param_infos=tuple(shared),
            fqns=tuple(f"{i.module_name}.{i.param_name}".lstrip(".") for i in infos),
            shapes=tuple(p.shape for p in ordered),
            numels=tuple(p.numel() for p in ordered),
            offsets=tuple(offsets),
            total_numel=total,
            numels_with_padding=tuple(n for n, _ in segments),
            is_padding_mask=tuple(pad for _, pad in segments),
        )
        return layout, ordered

    def flatten(self, params: Sequence[nn.Parameter]) -> Tensor:
        """A new flat tensor holding ``params`` (in flat order), padding zeroed."""
        first = params[0]
        flat = torch.zeros(self.total_numel, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for param, offset in zip(params, self.offsets):
                flat[offset : offset + param.numel()].copy_(param.detach().reshape(-1))
        return flat

    def views(self, flat: Tensor) -> list[Tensor]:
        """Each parameter's view of an unsharded flat tensor (see [Note: Views
        from one split])."""
        segments = flat.split_with_sizes(self.numels_with_padding)  # torch.split, less Python
        return [segments[j].view(shape) for j, shape in self._view_plan]

    @functools.cached_property
    def _view_plan(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """Each parameter's segment index and its shape as a plain tuple, which
        ``Tensor.view`` parses faster than a ``torch.Size`` (about a microsecond
        on every view of every unshard)."""
        segments = [j for j, pad in enumerate(self.is_padding_mask) if not pad]
        return tuple(zip(segments, self.view_shapes))

    @functools.cached_property
    def view_shapes(self) -> tuple[tuple[int, ...], ...]:
        """``shapes`` as plain tuples (see ``_view_plan``)."""
        return tuple(tuple(shape) for shape in self.shapes)

    @property
    def num_params(self) -> int:
        return len(self.param_infos)


@dataclass(frozen=True)
class ShardLayout:
    """This rank's part of a flat parameter: ``[start, start + shard_numel)`` of the
    flat parameter padded to ``padded_numel`` (everything for ``NO_SHARD``)."""

    layout: FlatParamLayout
    rank: int
    sharded: bool
    padded_numel: int
    shard_numel: int
    param_infos: tuple[ShardParamInfo, ...]

    @classmethod
    def of(cls, layout: FlatParamLayout, rank: int, world_size: int, sharded: bool) -> ShardLayout:
        total = layout.total_numel
        if not sharded:
            return cls(layout, rank, False, total, total, shard_param_infos(layout, 0, total - 1))
        padded = math.ceil(total / world_size) * world_size
        shard_numel = padded // world_size
        start = rank * shard_numel
        infos = shard_param_infos(layout, start, start + shard_numel - 1)
        return cls(layout, rank, True, padded, shard_numel, infos)

    @property
    def start(self) -> int:
        return self.rank * self.shard_numel if self.sharded else 0

    def own_part(self, unsharded: Tensor) -> Tensor:
        """This rank's elements of an unsharded flat tensor (padding excluded)."""
        if not self.sharded:
            return unsharded
        stop = min(self.start + self.shard_numel, self.layout.total_numel)
        return unsharded[self.start : stop]

    def local_shard_of(self, unsharded: Tensor) -> Tensor:
        """A new tensor: this rank's part of ``unsharded``, padded with zeros."""
        if not self.sharded:
            return unsharded
        shard = torch.zeros(self.shard_numel, dtype=unsharded.dtype, device=unsharded.device)
        part = self.own_part(unsharded)
        with torch.no_grad():
            shard[: part.numel()].copy_(part)
        return shard

    def param_range(self, i: int) -> tuple[int, int] | None:
        """(offset, numel) of parameter ``i`` in the local shard, None if absent."""
        if not self.sharded:
            return self.layout.offsets[i], self.layout.numels[i]
        info = self.param_infos[i]
        if not info.in_shard:
            return None
        assert info.offset_in_shard is not None and info.numel_in_shard is not None
        return info.offset_in_shard, info.numel_in_shard

    def part_of(self, i: int, local: Tensor) -> Tensor | None:
        """Parameter ``i``'s part of a shard-sized tensor: 1-D for sharded
        strategies, in the parameter's shape for ``NO_SHARD``; None if absent."""
        found = self.param_range(i)
        if found is None:
            return None
        start, numel = found
        piece = local[start : start + numel]
        return piece if self.sharded else piece.view(self.layout.view_shapes[i])

    def metadata(self) -> FlatParamShardMetadata:
        return shard_metadata(self.layout, self.param_infos)


def shard_metadata(
    layout: FlatParamLayout, infos: Sequence[ShardParamInfo]
) -> FlatParamShardMetadata:
    """The parameters (names, shapes, numels, inclusive element ranges) in a shard."""
    names, shapes, numels, offsets = [], [], [], []
    for i, info in enumerate(infos):
        if not info.in_shard:
            continue
        assert info.intra_param_start_idx is not None and info.intra_param_end_idx is not None
        names.append(layout.fqns[i])
        shapes.append(layout.shapes[i])
        numels.append(layout.numels[i])
        offsets.append((info.intra_param_start_idx, info.intra_param_end_idx))
    return FlatParamShardMetadata(tuple(names), tuple(shapes), tuple(numels), tuple(offsets))


def shard_param_infos(layout: FlatParamLayout, start: int, end: int) -> tuple[ShardParamInfo, ...]:
    """Where each parameter lies in the flat range ``[start, end]`` (inclusive)."""
    infos = []
    for offset, numel in zip(layout.offsets, layout.numels):
        last = offset + numel - 1
        if numel == 0 or last < start or offset > end:
            infos.append(ShardParamInfo(False, None, None, None, None))
            continue
        intra_start = max(start, offset) - offset
        intra_end = min(end, last) - offset
        infos.append(
            ShardParamInfo(
                True,
                max(offset, start) - start,
                intra_end - intra_start + 1,
                intra_start,
                intra_end,
            )
        )
    return tuple(infos)


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


def check_flattenable(params: Sequence[nn.Parameter], use_orig_params: bool) -> None:
    """Torch's checks (and messages) of the parameters one flat parameter holds."""
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
