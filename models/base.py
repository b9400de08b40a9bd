"""The interface every parity test model implements."""

from __future__ import annotations

import abc
from typing import Any, Protocol

import torch
from torch import nn


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
