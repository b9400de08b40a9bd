"""``torch.testing._internal.common_distributed`` for this harness:
``skip_if_lt_x_gpu``, ``TEST_SKIPS``, ``MultiProcessTestCase`` and ``run_subtests``.

[Note: What skip_if_lt_x_gpu(n) means here]
Upstream skips a test unless its machine has ``n`` accelerators, because it runs
one rank per GPU. Here the decorator says the test needs ``n`` ranks: it marks
the test ``min_world_size(n)``, so a class that does not pin ``world_size`` runs
it with ``max(--world-size, n)`` ranks (upstream's ``FSDPTest`` had one rank per
GPU, at least ``n`` where the test ran); a class that pins one keeps it, as
upstream's did. A CPU run always has the ranks (they are processes), so the test
runs; when the ranks run on CUDA each sees the GPUs of its pool, and the test is
skipped with upstream's message when those are fewer than ``n`` (under
``--device auto`` a test needing more ranks than there are GPUs runs on CPU
ranks).
"""

from __future__ import annotations

import functools
import os
import tempfile
import unittest
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist

from harness import DistributedTest, current_device, current_device_type

TestFn = Callable[..., Any]


class TestSkip(NamedTuple):
    """A skip reason of upstream's multi-process tests: the exit code a rank used
    for it there, and its message (the reason reported here)."""

    exit_code: int
    message: str


TEST_SKIPS: dict[str, TestSkip] = {
    "backend_unavailable": TestSkip(72, "Skipped because distributed backend is not available."),
    "small_worldsize": TestSkip(73, "Skipped due to small world size."),
    "odd_worldsize": TestSkip(87, "Skipped due to odd world size."),
    "no_cuda": TestSkip(74, "CUDA is not available."),
    "multi-gpu-1": TestSkip(75, "Need at least 1 CUDA device"),
    "multi-gpu-2": TestSkip(77, "Need at least 2 CUDA devices"),
    "multi-gpu-3": TestSkip(80, "Need at least 3 CUDA devices"),
    "multi-gpu-4": TestSkip(81, "Need at least 4 CUDA devices"),
    "multi-gpu-5": TestSkip(82, "Need at least 5 CUDA devices"),
    "multi-gpu-6": TestSkip(83, "Need at least 6 CUDA devices"),
    "multi-gpu-7": TestSkip(84, "Need at least 7 CUDA devices"),
    "multi-gpu-8": TestSkip(85, "Need at least 8 CUDA devices"),
    "nccl": TestSkip(76, "c10d not compiled with NCCL support"),
    "skipIfRocm": TestSkip(78, "Test skipped for ROCm"),
    "no_peer_access": TestSkip(79, "Test skipped because no GPU peer access"),
    "generic": TestSkip(
        86, "Test skipped at subprocess level, look at subprocess log for skip reason"
    ),
    "importerror": TestSkip(88, "Test skipped due to missing import"),
    "no_accelerator": TestSkip(89, "accelerator is not available."),
}


def gpu_shortfall(needed: int) -> str | None:
    """Why a test needing ``needed`` ranks cannot run here, or None (see [Note:
    What skip_if_lt_x_gpu(n) means here])."""
    if current_device_type() != "cuda" or torch.cuda.device_count() >= needed:
        return None
    skip = TEST_SKIPS.get(f"multi-gpu-{needed}")
    return skip.message if skip is not None else f"Need at least {needed} CUDA devices"


def skip_if_lt_x_gpu(x: int, *, allow_cpu: bool = False) -> Callable[[TestFn], TestFn]:
    """The test needs ``x`` ranks, and is skipped when they run on fewer than
    ``x`` GPUs (see [Note: What skip_if_lt_x_gpu(n) means here]); ``allow_cpu``
    changes nothing, as CPU runs always run the test."""

    def decorator(func: TestFn) -> TestFn:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            reason = gpu_shortfall(x)
            if reason is not None:
                raise unittest.SkipTest(reason)
            return func(*args, **kwargs)

        marked: TestFn = pytest.mark.min_world_size(x)(wrapper)
        return marked

    return decorator


def _agreed_temp_path() -> str:
    """A fresh path in the temporary directory, the same on every rank: its random
    part is rank 0's, broadcast over the default group (as bytes, not as a pickled
    object, which would need numpy)."""
    token = torch.frombuffer(bytearray(uuid.uuid4().bytes), dtype=torch.uint8)
    token = token.to(current_device())
    dist.broadcast(token, src=0)
    return os.path.join(
        tempfile.gettempdir(), f"upstream_rendezvous_{bytes(token.cpu().tolist()).hex()}"
    )


class MultiProcessTestCase(DistributedTest):
    """The attributes upstream's multi-process tests read, on a ``DistributedTest``.

    Upstream spawns one process per rank for every test and initialises the
    process group itself; here the ranks are pooled processes whose default group
    is up before the test starts. ``world_size`` is ``--world-size`` unless the
    class sets it (upstream's default was 4, or the number of GPUs).
    """

    MAIN_PROCESS_RANK = -1
    TEST_ERROR_EXIT_CODE = 10

    skip_return_code_checks: list[int]
    _file_name: str | None = None

    def setUp(self) -> None:
        super().setUp()
        self.skip_return_code_checks = []

    @property
    def destroy_pg_upon_exit(self) -> bool:
        """Upstream's switch for destroying the group after the test; the harness
        always destroys the groups a test created and keeps the default one."""
        return True

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    @property
    def file_name(self) -> str:
        """A path for a ``FileStore`` rendezvous (``file://`` + this), the same on every
        rank. Agreeing on it is a broadcast over the default group, on first use:
        every rank must read it (upstream's tests do, passing it to
        ``init_process_group``). c10d removes the file when its last client closes."""
        if self._file_name is None:
            self._file_name = _agreed_temp_path()
        return self._file_name


class MultiProcContinuousTest(MultiProcessTestCase):
    """Upstream's variant that reuses its worker processes across tests; every
    distributed test here runs in reused rank pools, so it is ``MultiProcessTestCase``."""


def run_subtests(
    cls_inst: DistributedTest,
    subtest_config: Mapping[str, Sequence[object]],
    test_fn: TestFn,
    *test_args: object,
    **test_kwargs: object,
) -> None:
    """Upstream's free-function form of ``cls_inst.run_subtests(...)``."""
    cls_inst.run_subtests(subtest_config, test_fn, *test_args, **test_kwargs)
