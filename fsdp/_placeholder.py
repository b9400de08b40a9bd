"""What an original parameter name shows while its data lives only in shards.

[Note: Placeholders for sharded parameters]
With ``use_orig_params=False`` the original parameter names (``linear.weight``)
are plain tensor views of the unsharded flat parameter during forward and
backward. Once that storage is freed, a view of it still reports its shape but
points at memory that is gone: touching it (``module.weight.fill_(1.0)``, an init
function, ``model.apply(fn)`` before it gathered anything) wrote out of bounds
and killed the process. Between uses the names therefore hold a placeholder: a
tensor with the parameter's shape, dtype and device but no storage, whose every
operation raises an error naming the parameter and saying where its data is
available. Metadata (``shape``, ``dtype``, ``requires_grad`` as the flat
parameter's, as torch's views say, ``is None`` checks, ``repr`` of the module)
keeps working.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves


class ShardedParamPlaceholder(Tensor):
    """Stands for the original parameter ``fqn`` while its data is sharded."""

    _fqn: str
    _flat_requires_grad: bool

    @staticmethod
    def __new__(
        cls,
        shape: torch.Size,
        dtype: torch.dtype,
        device: torch.device,
        fqn: str,
        requires_grad: bool = False,
    ) -> ShardedParamPlaceholder:
        placeholder = Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, shape, dtype=dtype, device=device, requires_grad=False
        )
        placeholder._fqn = fqn
        placeholder._flat_requires_grad = requires_grad
        return placeholder

    @property
    def requires_grad(self) -> bool:  # type: ignore[override]
        """The flat parameter's flag, as torch's views report it. Autograd sees
        False: an in-place operation must reach ``__torch_dispatch__`` and its
        error, not autograd's about a leaf that requires grad."""
        return self._flat_requires_grad

    @classmethod
    def like(cls, tensor: Tensor, fqn: str) -> ShardedParamPlaceholder:
        return cls(tensor.shape, tensor.dtype, tensor.device, fqn, tensor.requires_grad)

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        leaves = tree_leaves((args, kwargs or {}))
        fqn = next((a._fqn for a in leaves if isinstance(a, cls)), "a parameter")
        raise RuntimeError(
            f"{fqn} is sharded by FullyShardedDataParallel (use_orig_params=False): its data "
            "exists only during forward and backward, inside FSDP.summon_full_params(), and "
            f"inside FSDP.apply(); outside them it cannot be read or written ({func})"
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (
            f"ShardedParamPlaceholder({self._fqn}, shape={tuple(self.shape)}, "
            f"dtype={self.dtype}, device={self.device})"
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardedParamPlaceholder:
        return ShardedParamPlaceholder.like(self, self._fqn)

    def __reduce_ex__(self, protocol: Any) -> Any:
        args = (self.shape, self.dtype, self.device, self._fqn, self.requires_grad)
        return (ShardedParamPlaceholder, args)
