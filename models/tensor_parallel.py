"""Small models of upstream's tensor-parallel tests (``common_dtensor``'s), which
upstream's FSDP files compose with FSDP: an MLP whose two linears are the
natural colwise / rowwise pair, a stack of them, and an RMS norm written in
Python (its weight may become a DTensor)."""

from __future__ import annotations

import torch
from torch import nn

from harness.seeding import manual_seed

_MLP_SEED = 5


class MLPModule(nn.Module):
    """``net1: Linear(10, 16)``, ReLU, ``net2: Linear(16, 10)`` on ``device``,
    drawn after seeding the default generator with 5 (every rank draws the same)."""

    net1: nn.Linear
    relu: nn.ReLU
    net2: nn.Linear

    def __init__(self, device: torch.device | str | None, bias: bool = True) -> None:
        super().__init__()
        manual_seed(_MLP_SEED)
        self.net1 = nn.Linear(10, 16, bias=bias, device=device)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(16, 10, bias=bias, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))

    def reset_parameters(self) -> None:
        self.net1.reset_parameters()
        self.net2.reset_parameters()


class MLPStacked(nn.Module):
    """``n_layers`` ``MLPModule`` s in ``layers``, applied in turn."""

    layers: nn.ModuleList

    def __init__(self, device: torch.device | str | None, n_layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList([MLPModule(device) for _ in range(n_layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class RMSNormPython(nn.Module):
    """``x / sqrt(mean(x ** 2, last dim) + eps) * weight``, ``weight`` ones of ``dim``."""

    eps: float
    weight: nn.Parameter

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed * self.weight
