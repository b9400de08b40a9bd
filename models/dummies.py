"""Stand-ins for a data-parallel wrapper and for a process group."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class DummyDDP(nn.Module):
    """A reference wrapper that only forwards: for models that reduce their own
    gradients in ``run_backward`` (``MixtureOfExperts``), where DDP's all-reduce
    would be wrong for the rank-local expert parameters."""

    module: nn.Module

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class _CompletedWork:
    """What a collective of ``DummyProcessGroup`` returns: already finished."""

    def wait(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[int]:
        future: torch.futures.Future[int] = torch.futures.Future()
        future.set_result(1)
        return future


class DummyProcessGroup:
    """A process group that only knows its rank and size, for wrapping without ranks
    (``FSDP(module, process_group=DummyProcessGroup(rank=0, size=1))``).

    Its ``allreduce`` completes at once without touching the tensors.
    """

    _rank: int
    _size: int

    def __init__(self, rank: int, size: int) -> None:
        self._rank = rank
        self._size = size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def allreduce(self, *args: Any, **kwargs: Any) -> _CompletedWork:
        return _CompletedWork()
