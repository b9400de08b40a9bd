"""Seeding the random number generators a test's ranks use.

[Note: A cheaper manual_seed]
``torch.manual_seed`` seeds every backend torch knows, and for the XPU and MTIA
backends, which are never initialised on our machines, it queues the seeding
together with a formatted stack of the caller (``traceback.format_stack``) each
time: 0.67 ms a call on the 2-core CPU machine, against 0.005 ms for seeding the
CPU generator. The models and the test layer seed at every model construction
and input batch (about 150 times per test of ``suites/test_core.py``), so that
was about 100 ms of every such test. ``manual_seed`` here seeds what a test can
draw from here: the CPU generator and, where CUDA is available, every CUDA
device's (queued by torch until CUDA initialises, as ``torch.manual_seed`` does).
"""

from __future__ import annotations

import torch


def manual_seed(seed: int) -> None:
    """``torch.manual_seed(seed)`` for the CPU and CUDA generators."""
    seed = int(seed)
    torch.random.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
