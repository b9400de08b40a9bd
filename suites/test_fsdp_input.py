"""Container inputs of a wrapped module (port of upstream ``test_fsdp_input.py``).

FSDP moves and casts forward inputs that are nested in lists and dicts; the
wrapped module must still get the container type it expects and, when nothing
needs moving or casting, the caller's very objects (a module may mutate them).
Upstream instantiates the class for accelerator device types only; here the
test's device is the rank's (CPU ranks on a CPU run), with one rank as upstream.

[Note: torch's FSDP rebuilds container inputs]
Torch's FSDP moves forward inputs with ``torch.distributed.utils._recursive_to``,
which in torch up to 2.13 rebuilds every list, tuple and dict even when no
tensor moves, so the module mutates a copy. Upstream's newest
``test_input_identity_preserved`` comes with the fix (pytorch#171617, for
issue #157832), which the installed torch does not have:
``--fsdp-impl torch`` asserts that the caller's container is left unchanged,
so a torch with the fix makes the test fail and gets noticed.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdptest import FSDPTest
from fsdptest.api import ADAPTER, FSDP

INPUT_CLASSES = pytest.mark.parametrize("input_cls", [dict, list], ids=["dict", "list"])


class Model(nn.Module):
    """Reads its input from a one-element list or from a dict's ``"in"``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, input: list[torch.Tensor] | dict[str, torch.Tensor]) -> torch.Tensor:
        if isinstance(input, list):
            x = input[0]
        else:
            if not isinstance(input, dict):
                raise AssertionError(f"Expected dict, got {type(input)}: {input}")
            x = input["in"]
        return self.layer(x)


class MutatingModel(nn.Module):
    """Adds an entry to its list or dict input before reading it."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, input: list[torch.Tensor] | dict[str, torch.Tensor]) -> torch.Tensor:
        device = self.layer.weight.device
        if isinstance(input, list):
            input.append(torch.randn(4, 4, device=device))
            x = input[0]
        else:
            input["added"] = torch.randn(4, 4, device=device)
            x = input["in"]
        return self.layer(x)


def _wrap(input_cls: type, tensor: torch.Tensor) -> list[torch.Tensor] | dict[str, torch.Tensor]:
    return [tensor] if input_cls is list else {"in": tensor}


class TestInput(FSDPTest):
    world_size = 1

    @INPUT_CLASSES
    def test_input_type(self, input_cls: type) -> None:
        """A list or dict input reaches the module as a list or dict, for
        several training iterations."""
        model = FSDP(Model().to(self.device), device_id=self.device)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(5):
            in_data = torch.rand(64, 4).to(self.device)
            in_data.requires_grad = True
            out = model(_wrap(input_cls, in_data))
            out.sum().backward()
            optim.step()
            optim.zero_grad()

    @INPUT_CLASSES
    def test_input_identity_preserved(self, input_cls: type) -> None:
        """The module gets the caller's container itself: what it adds is seen
        by the caller."""
        model = FSDP(MutatingModel().to(self.device), device_id=self.device)
        in_data = torch.rand(64, 4, device=self.device)
        container = _wrap(input_cls, in_data)
        initial_len = len(container)
        model(container)
        mutated = (
            not ADAPTER.limitations.rebuilds_container_inputs
        )  # see [Note: torch's FSDP rebuilds container inputs]
        if input_cls is list:
            self.assertEqual(len(container), initial_len + (1 if mutated else 0))
        else:
            self.assertEqual("added" in container, mutated)
