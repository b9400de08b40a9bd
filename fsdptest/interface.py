"""What the parity harness knows of a test model: the interface every parity
test model implements, and the modes it is built in."""

from __future__ import annotations

import abc
import enum
from typing import Any, Protocol

import torch
from torch import nn

from harness import current_device


class FSDPTestModel(nn.Module, abc.ABC):
    """A model the parity harness can train without knowing it.

    The harness reaches it through whatever wraps it (DDP, FSDP, ``DummyDDP``) as
    ``wrapper.module`` and calls, once per step: ``get_input`` (seeded by rank, so
    every construction sees the same data), the wrapper's forward, ``get_loss`` and
    ``run_backward`` (which may do more than ``loss.backward()``, e.g. reduce
    gradients by hand or inject delays).
    """

    @abc.abstractmethod
    def get_input(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """This rank's input for one step, as the positional arguments of forward."""

    @abc.abstractmethod
    def get_loss(self, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        """The scalar loss of ``output`` (``inputs`` as returned by ``get_input``)."""

    @abc.abstractmethod
    def run_backward(self, loss: torch.Tensor) -> None:
        """Runs the backward pass of ``loss``."""

    @staticmethod
    @abc.abstractmethod
    def init(*args: Any, **kwargs: Any) -> nn.Module:
        """Builds the model for an ``FSDPInitMode`` and a ``DeviceInitMode``."""


class ModelFactory(Protocol):
    """What builds a test model: an ``FSDPTestModel`` class, or a class whose static
    ``init`` builds one (``NestedWrappedModuleWithDelay``)."""

    @staticmethod
    def init(*args: Any, **kwargs: Any) -> nn.Module: ...


def unwrap_test_model(module: nn.Module) -> FSDPTestModel:
    """The ``FSDPTestModel`` inside ``module``, looking through the ``.module`` of
    wrappers (DDP, FSDP, ``DummyDDP``); ``module`` itself if it is one."""
    current = module
    while not isinstance(current, FSDPTestModel):
        inner = getattr(current, "module", None)
        if not isinstance(inner, nn.Module):
            raise TypeError(f"{type(module).__name__} wraps no FSDPTestModel")
        current = inner
    return current


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
