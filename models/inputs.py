"""Models that record the input each submodule's forward receives, to check input casting."""

from __future__ import annotations

import torch
from torch import nn


class SaveForwardInputsModule(nn.Module):
    """A ``Linear(100, 100)`` that stores its input in ``forward_inputs[self]``.

    With ``cast_forward_inputs`` it casts the input to its weight's dtype itself;
    otherwise a dtype mismatch fails in the linear layer.
    """

    l: nn.Linear  # noqa: E741 - the upstream name, which tests reach
    forward_inputs: dict[nn.Module, torch.Tensor]
    cast_forward_inputs: bool

    def __init__(
        self, forward_inputs: dict[nn.Module, torch.Tensor], cast_forward_inputs: bool
    ) -> None:
        super().__init__()
        self.l = nn.Linear(100, 100)
        self.forward_inputs = forward_inputs
        self.cast_forward_inputs = cast_forward_inputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forward_inputs[self] = x
        return self.l(x.to(self.l.weight.dtype) if self.cast_forward_inputs else x)


class SaveForwardInputsModel(nn.Module):
    """Two ``SaveForwardInputsModule`` in sequence (``c1``, then ``c2``) sharing one
    ``forward_inputs`` dict; the model records its own input there too."""

    c1: SaveForwardInputsModule
    c2: SaveForwardInputsModule
    forward_inputs: dict[nn.Module, torch.Tensor]

    def __init__(
        self, forward_inputs: dict[nn.Module, torch.Tensor], cast_forward_inputs: bool
    ) -> None:
        super().__init__()
        self.c1 = SaveForwardInputsModule(forward_inputs, cast_forward_inputs)
        self.c2 = SaveForwardInputsModule(forward_inputs, cast_forward_inputs)
        self.forward_inputs = forward_inputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forward_inputs[self] = x
        return self.c2(self.c1(x))
