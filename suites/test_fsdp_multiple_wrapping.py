"""Wrapping a module twice (port of upstream ``test_fsdp_multiple_wrapping.py``).

A root FSDP over a module whose only parameters are already in a nested FSDP
unit trains; wrapping the same inner module again in a new root afterwards
gives a root that computes the same output. Upstream runs on accelerators
only; here the ranks' device stands in (CPU ranks on a CPU run).
"""

from __future__ import annotations

import torch
from torch import nn

from fsdptest import FSDPTest
from fsdptest.api import FSDP


class InnerModel(nn.Module):
    """One ``Linear(5, 5)`` in its own FSDP unit, built on the CPU with the
    device type (no index) as ``device_id``."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.layers = nn.Sequential(FSDP(nn.Linear(5, 5), device_id=device.type))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class TestMultipleWrapping(FSDPTest):
    def test_multiple_wrapping(self) -> None:
        """A second root over the trained inner module computes the first's output."""
        inner_model = InnerModel(self.device)
        model = FSDP(inner_model).to(self.device)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            input = torch.rand((1, 5), dtype=torch.float).to(self.device)
            input.requires_grad = True
            output = model(input)
            output.sum().backward()
            optim.step()
            optim.zero_grad()
        input = torch.rand((1, 5), dtype=torch.float).to(self.device)
        output = model(input)
        # Wrap the same inner module again: the new root takes over.
        rewrapped_model = FSDP(inner_model).to(self.device)
        rewrapped_output = rewrapped_model(input)
        self.assertEqual(output, rewrapped_output)
