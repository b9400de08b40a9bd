"""How a test model is built: whether FSDP wraps it, and when it moves to the test's device."""

from __future__ import annotations

import enum

from torch import nn

from harness import current_device


class FSDPInitMode(enum.Enum):
    """``NO_FSDP``: no module is wrapped (the reference). ``RECURSIVE``: the model's
    ``init`` wraps its FSDP units, with or without a top-level wrapper (see each model)."""

    NO_FSDP = enum.auto()
    RECURSIVE = enum.auto()


class DeviceInitMode(enum.Enum):
    """When the model moves to the test's device (``cuda:<rank>``, or the CPU on a CPU run).

    ``BEFORE``: before FSDP wraps it. ``AFTER``: after wrapping. ``NEVER``: it stays
    on the CPU (FSDP offloading or a CPU run moves what needs moving).
    """

    BEFORE = enum.auto()
    AFTER = enum.auto()
    NEVER = enum.auto()

    def is_before(self) -> bool:
        return self is DeviceInitMode.BEFORE

    def is_after(self) -> bool:
        return self is DeviceInitMode.AFTER


def to_device_if(module: nn.Module, move: bool) -> nn.Module:
    """``module`` on the test's device when ``move``, else unchanged (in place, like ``.to``)."""
    return module.to(current_device()) if move else module
