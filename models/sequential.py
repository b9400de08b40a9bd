"""A nested ``nn.Sequential`` of ``Linear(5, 5)`` layers and the wrappings expected of it."""

from __future__ import annotations

import torch
from torch import nn

from fsdptest.api import FSDP
from harness.assertions import Assertions


class NestedSequentialModel:
    """``Sequential(Linear(5, 5), Linear(5, 5), Sequential(Linear(5, 5), Linear(5, 5)))``.

    Each linear has 30 parameters, so a size-based policy with ``min_num_params=40``
    wraps only the inner ``Sequential`` (60) besides the root.
    """

    @staticmethod
    def get_model(device: torch.device | None = None) -> nn.Sequential:
        """The model, on ``device`` if given, else where it was built (the CPU)."""
        model = nn.Sequential(
            nn.Linear(5, 5),
            nn.Linear(5, 5),
            nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5)),
        )
        return model if device is None else model.to(device)

    @staticmethod
    def verify_model_all_wrapped(case: Assertions, model: nn.Module) -> None:
        """Every module is an FSDP unit (``always_wrap_policy``)."""
        case.assertIsInstance(model, FSDP)
        inner = model.module
        case.assertIsInstance(inner[0], FSDP)
        case.assertIsInstance(inner[1], FSDP)
        case.assertIsInstance(inner[2], FSDP)
        case.assertIsInstance(inner[2].module[0], FSDP)
        case.assertIsInstance(inner[2].module[1], FSDP)

    @staticmethod
    def verify_model(case: Assertions, model: nn.Module) -> None:
        """Only the root and the inner ``Sequential`` are FSDP units (size-based policy)."""
        case.assertIsInstance(model, FSDP)
        inner = model.module
        case.assertIsInstance(inner[0], nn.Linear)
        case.assertIsInstance(inner[1], nn.Linear)
        case.assertIsInstance(inner[2], FSDP)
        case.assertIsInstance(inner[2].module[0], nn.Linear)
        case.assertIsInstance(inner[2].module[1], nn.Linear)
