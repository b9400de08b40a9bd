"""The models of FSDP2 programs (rank side): one builder per name of
``fsdptest.fsdp2search.program.NETS``, each seeded, on the rank's device.

[Note: The FSDP2 programs' models]
Each shape changes what ``fully_shard`` does: ``stack`` (upstream's ``MLP`` s of
two hidden widths), ``nested`` (a block sharded with and inside its linear
layers), ``uneven`` (dims of 5 and 3 rows: padded shards, and an empty shard at
world size 4), ``tied`` (the input and output projections share one weight,
which the root manages), ``buffers`` (a buffer added in forward, in the activations' dtype,
which ``fully_shard`` leaves unsharded and uncast). ``DIM`` is the input's width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

DIM = 8
BATCH = 2


class MLP(nn.Module):
    """``in_proj`` (``dim`` to ``multiplier * dim``), ReLU, ``out_proj``, ReLU: the
    shape of upstream's FSDP2 test ``MLP`` (``fsdptest`` does not import the test
    models, which build on it)."""

    def __init__(self, dim: int, dim_multiplier: int = 4) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, dim_multiplier * dim)
        self.out_proj = nn.Linear(dim_multiplier * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.out_proj(torch.relu(self.in_proj(x))))


class Tied(nn.Module):
    """``inp`` and ``out`` share one weight; ``mid`` is an ``MLP`` between them."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM, bias=False)
        self.mid = MLP(DIM, dim_multiplier=2)
        self.out = nn.Linear(DIM, DIM, bias=False)
        self.out.weight = self.inp.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mid(torch.relu(self.inp(x))))


class Shifted(nn.Module):
    """A linear layer and a ReLU, plus a buffer added in the activations' dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.register_buffer("shift", torch.randn(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) + self.shift.to(x.dtype)


def _block() -> nn.Sequential:
    return nn.Sequential(nn.Linear(DIM, 12), nn.ReLU(), nn.Linear(12, DIM))


_BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "stack": lambda: nn.Sequential(MLP(DIM), MLP(DIM, dim_multiplier=3), MLP(DIM)),
    "nested": lambda: nn.Sequential(_block(), _block()),
    "uneven": lambda: nn.Sequential(
        nn.Linear(DIM, 5), nn.ReLU(), nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, DIM)
    ),
    "tied": Tied,
    "buffers": lambda: nn.Sequential(Shifted(), Shifted()),
}


def build(net: str, seed: int, device: torch.device) -> nn.Module:
    """Model ``net`` with parameters drawn from ``seed`` (the same on every rank)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _BUILDERS[net]().to(device)


def batch(rank: int, index: int, device: torch.device) -> torch.Tensor:
    """The ``index`` -th batch of ``rank`` (each rank trains on its own data)."""
    generator = torch.Generator().manual_seed(7919 * index + rank)
    return torch.randn(BATCH, DIM, generator=generator).to(device)
