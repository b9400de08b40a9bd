"""All-gather extensions: a parameter whose sharded local tensor defines
``fsdp_pre_all_gather`` and ``fsdp_post_all_gather`` (torch's protocol, on a
tensor subclass or monkey-patched onto one local tensor) chooses what is
all-gathered for it and builds its unsharded tensor from what came back.

[Note: All-gather extensions]
- Before each all-gather the group asks the local tensor for its inputs:
  ``fsdp_pre_all_gather(mesh)`` (the old form) or ``fsdp_pre_all_gather(mesh,
  outer_size, outer_stride, module, mp_policy)`` returns ``(inputs, metadata)``.
  ``mesh`` is the 1-D shard mesh (the shard dimension of an HSDP mesh); each
  input must have the padded shard size where the parameter is unevenly
  sharded. The inputs, of any dtypes, share the group's one all-gather buffer
  with the other parameters' shards (``uint8`` where the dtypes differ).
- Each input gets its own output (``world * numel`` elements of its dtype),
  kept across all-gathers: its storage is freed when the parameter reshards and
  allocated again for the next all-gather, so the tensors built on it stay valid.
- The first all-gather calls ``fsdp_post_all_gather(outputs, metadata,
  param_dtype)`` (each output viewed as ``(-1, *input.shape[1:])``), which
  returns the unsharded tensor and the tensors to free with the outputs; the
  unsharded parameter is that tensor at the original size. Later all-gathers
  call it with ``out=`` the unsharded parameter, which it refills in place.
- Resharding to a smaller mesh after forward (an int ``reshard_after_forward``)
  is not supported with an extension, as in torch.
"""

from __future__ import annotations

import inspect
import itertools
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp._fully_shard._api import MixedPrecisionPolicy
from fsdp._storage import alloc_storage, free_storage

__all__ = ["ExtensionGather", "has_extension"]


def has_extension(local: Tensor) -> bool:
    """Whether ``local`` (a sharded parameter's local tensor) defines the protocol."""
    pre = hasattr(local, "fsdp_pre_all_gather")
    if pre != hasattr(local, "fsdp_post_all_gather"):
        raise AssertionError(
            "Both fsdp_pre_all_gather and fsdp_post_all_gather should be defined "
            f"if using all-gather extensions: {local}"
        )
    return pre


class ExtensionGather:
    """One parameter's all-gather through its extension (see [Note: All-gather
    extensions])."""

    outputs: list[Tensor]  # per input, kept across all-gathers
    inner: list[Tensor]  # what fsdp_post_all_gather said to free with the outputs
    sizes: list[torch.Size]  # the last inputs' sizes
    dtypes: list[torch.dtype]  # the last inputs' dtypes
    metadata: Any
    mesh: DeviceMesh  # the 1-D shard mesh the extension is given

    def __init__(self, mesh: DeviceMesh) -> None:
        self.outputs, self.inner, self.sizes, self.dtypes = [], [], [], []
        self.metadata = None
        self.mesh = mesh

    def inputs(
        self,
        local: Tensor,
        module: nn.Module,
        mp_policy: MixedPrecisionPolicy,
        orig: tuple[torch.Size, tuple[int, ...]],
        padded_size: torch.Size,
    ) -> list[Tensor]:
        """The extension's all-gather inputs, flattened."""
        pre, mesh = local.fsdp_pre_all_gather, self.mesh  # type: ignore[attr-defined]
        arity = len(inspect.signature(pre).parameters)
        if arity == 1:
            inputs, self.metadata = pre(mesh)
        elif arity == 5:
            inputs, self.metadata = pre(mesh, orig[0], orig[1], module, mp_policy)
            if local.size() != padded_size and any(t.size() != padded_size for t in inputs):
                raise AssertionError(
                    "When a parameter is unevenly sharded by FSDP "
                    f"(orig size={orig[0]}, FSDP world size={mesh.size()}), "
                    "fsdp_pre_all_gather must return all-gather inputs with the padded "
                    f"sharded size {padded_size} but got {[t.size() for t in inputs]}"
                )
        else:
            raise AssertionError(
                f"Invalid fsdp_pre_all_gather: {inspect.signature(pre)}\n"
                "Expects fsdp_pre_all_gather(self, mesh: DeviceMesh, "
                "outer_size: torch.Size, outer_stride: tuple[int, ...], "
                "module: nn.Module, mp_policy: MixedPrecisionPolicy)"
            )
        self.sizes = [t.size() for t in inputs]
        self.dtypes = [t.dtype for t in inputs]
        return [t.view(-1) for t in inputs]

    def alloc_outputs(self, world: int, device: torch.device) -> list[Tensor]:
        """The outputs of the next all-gather (allocated again after a reshard)."""
        if not self.outputs:
            self.outputs = [
                torch.empty(size.numel() * world, dtype=dtype, device=device)
                for size, dtype in zip(self.sizes, self.dtypes)
            ]
        else:
            for tensor in self.outputs:
                alloc_storage(tensor)
        return self.outputs

    def post(self, local: Tensor, param_dtype: torch.dtype, out: Tensor | None) -> Tensor | None:
        """The unsharded tensor built from the outputs (None when ``out``, the
        unsharded parameter of an earlier all-gather, was refilled instead)."""
        outputs = tuple(t.view(-1, *s[1:]) for t, s in zip(self.outputs, self.sizes))
        post = local.fsdp_post_all_gather  # type: ignore[attr-defined]
        if out is not None:
            for tensor in self.inner:
                alloc_storage(tensor)
            post(outputs, self.metadata, param_dtype, out=out)
            self.metadata = None
            return None
        unsharded, inner = post(outputs, self.metadata, param_dtype)
        self.inner = list(inner)
        self.metadata = None
        return unsharded  # type: ignore[no-any-return]

    def free(self) -> None:
        for tensor in itertools.chain(self.outputs, self.inner):
            free_storage(tensor)
