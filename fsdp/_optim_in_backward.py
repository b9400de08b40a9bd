"""Optimizers that step inside the backward, one original parameter at a time.

``torch.distributed.optim._apply_optimizer_in_backward`` marks parameters with
``_in_backward_optimizers``; an FSDP unit steps them right after its gradient
is reduced (``use_orig_params=True`` only), as torch's does.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

_MARK = "_in_backward_optimizers"


def marked_for_backward(flat_param: nn.Parameter, params: Sequence[nn.Parameter]) -> bool:
    """Whether any of the unit's original parameters has optimizers in backward
    (the flat parameter itself may not: torch's error for use_orig_params=False)."""
    if hasattr(flat_param, _MARK):
        raise RuntimeError("FSDP optimizer in backward only supported with use_orig_params=True!")
    return any(hasattr(p, _MARK) for p in params)


def step_in_backward(params: Sequence[nn.Parameter]) -> None:
    """Each marked parameter with a gradient on this rank's shard: its optimizers
    step and free the gradient."""
    for param in params:
        if param.grad is None:
            continue  # not on this rank's shard
        for optim in getattr(param, _MARK, ()):
            optim.step()
            optim.zero_grad(set_to_none=True)
