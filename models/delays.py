"""Delays that test models inject to expose missing synchronisation.

[Note: How a delay is made]
On CUDA a delay is a spin kernel (``torch.cuda._sleep``) enqueued on the current
stream: the host does not wait, so work that FSDP issues on other streams races
with it unless FSDP synchronises the streams properly. Its length is given in
cycles, so the cycles per millisecond are measured once per process with CUDA
events. On the CPU nothing runs asynchronously, so a delay is a real
``time.sleep``: it cannot expose a stream race there, but it still checks that
the delayed code path runs and that its results are unchanged.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

from fsdptest.api import current_device

_CALIBRATION_CYCLES = 1_000_000
_CALIBRATION_RUNS = 5


def sleep_ms(ms: float) -> None:
    """Delays the test's device by ``ms`` milliseconds (see [Note: How a delay is made])."""
    if ms <= 0:
        return
    if current_device().type == "cuda":
        torch.cuda._sleep(int(ms * cuda_cycles_per_ms()))
    else:
        time.sleep(ms / 1000)


@functools.cache
def cuda_cycles_per_ms() -> float:
    """Cycles of ``torch.cuda._sleep`` per millisecond on this process's CUDA device:
    the median of a few timed spins, measured on first use."""
    return statistics.median(_time_one_spin() for _ in range(_CALIBRATION_RUNS))


def _time_one_spin() -> float:
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(_CALIBRATION_CYCLES)
    end.record()
    end.synchronize()
    return _CALIBRATION_CYCLES / start.elapsed_time(end)
