"""The post-backward hook of one FSDP unit: registered once per iteration,
removed at its end.

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

[Note: Post-backward hooks hold their unit weakly]
An autograd node keeps its hooks in C++, where the garbage collector cannot
see them, and the AccumulateGrad node keeps the flat parameter. A hook that
held the unit's state strongly would make state -> handle -> node -> hook ->
state a cycle the collector cannot break: after a forward that raised (no
backward removes the hook) the unit, its process groups and its memory would
live as long as the process. The ``PostBackwardHook`` holds the hook (a cycle
the collector sees); the node only a weak reference to it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

__all__ = ["PostBackwardHook"]


class PostBackwardHook:
    """The unit's hook on its ``AccumulateGrad`` node, or, for a flat parameter
    that needs no gradient, on its forward inputs' gradients (reshard only)."""

    __slots__ = ("_flat_param", "_registered")

    _flat_param: Tensor
    # (the AccumulateGrad node or None, its hook's handle, the hook: see _weakly)
    _registered: tuple[Any, RemovableHandle, Callable[[], None]] | None

    def __init__(self, flat_param: Tensor) -> None:
        self._flat_param = flat_param
        self._registered = None

    def is_registered(self) -> bool:
        return self._registered is not None

    def register(self, hook: Callable[[], None]) -> bool:
        """Hooks the ``AccumulateGrad`` node that views made from the flat
        parameter now feed, once per iteration; returns whether this call
        registered it. See [Note: The post-backward hook's node]."""
        flat_param = self._flat_param
        if self._registered is not None or not flat_param.requires_grad:
            return False
        grad_fn = flat_param.expand_as(flat_param).grad_fn
        assert grad_fn is not None, "the post-backward hook needs autograd enabled"
        node = grad_fn.next_functions[0][0]
        self._registered = (node, node.register_hook(_weakly(hook)), hook)
        return True

    def reshard_only(self) -> bool:
        """The flat parameter needs no gradient: only ``register_reshard_only`` applies."""
        return not self._flat_param.requires_grad

    def register_reshard_only(self, inputs: list[Tensor], hook: Callable[[], None]) -> bool:
        """For a flat parameter that needs no gradient: ``hook`` runs once the
        gradients of ``inputs`` are computed, once per iteration; returns
        whether this call registered it."""
        if self._registered is not None:
            return False
        handle = torch.autograd.graph.register_multi_grad_hook(inputs, _weakly(hook))
        self._registered = (None, handle, hook)
        return True

    def remove(self) -> None:
        if self._registered is not None:
            self._registered[1].remove()
            self._registered = None


def _weakly(hook: Callable[[], None]) -> Callable[..., None]:
    """``hook`` called through a weak reference (see [Note: Post-backward hooks
    hold their unit weakly])."""
    ref = weakref.ref(hook)

    def call(*_: object) -> None:
        alive = ref()
        if alive is not None:
            alive()

    return call
