"""Forward all-gathers overlap computation (port of upstream ``test_fsdp_overlap.py``).

A root over four units, each of which spins the GPU for a given number of
cycles in forward (compute) while every all-gather is delayed by a spin
enqueued on the stream it is issued on. Timed with CUDA events over the ten
fastest of twenty iterations: the CPU must run ahead of the GPU (no host
synchronisation in forward or backward), and with world size 2 the all-gathers
(on their own stream) must overlap the compute. These timings need a GPU
(``test_forward_overlap``).

[Note: What runs on the CPU]
Part of what ``test_forward_overlap`` asserts does not depend on timing: a
forward issues an all-gather if and only if the units have parameters and the
world size is above 1 (at world size 1 FSDP does not shard; a unit without
parameters has nothing to gather). ``test_forward_all_gathers`` checks that on
any device, for the same four models, with every all-gather name patched
(torch's FSDP all-gathers CPU tensors with the list form ``all_gather``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from statistics import mean
from typing import Any

import pytest
import torch
from torch import nn

from fsdptest import FSDPTest
from fsdptest.api import FSDP
from harness.collectives import Collective, patch_collective
from models.delays import cuda_cycles_per_ms

NUM_UNITS = 4
TIMED_ITERS = 20
KEPT_SAMPLES = 10
SLEEP_MS = 100


class Layer(nn.Module):
    """Spins the GPU for ``compute_cycles`` in forward (timed with CUDA events),
    and adds an optional one-element parameter so that FSDP has something to
    gather."""

    def __init__(self, compute_cycles: int, has_params: bool) -> None:
        super().__init__()
        self.sleep_cycles = compute_cycles
        self.optional_param = nn.Parameter(torch.rand(1)) if has_params else None
        self.e1: torch.cuda.Event | None = None
        self.e2: torch.cuda.Event | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        timed = x.is_cuda
        if timed:
            self.e1 = torch.cuda.Event(enable_timing=True)
            self.e2 = torch.cuda.Event(enable_timing=True)
            self.e1.record()
            if self.sleep_cycles > 0:
                torch.cuda._sleep(self.sleep_cycles)
        if self.optional_param is not None:
            x = x + self.optional_param  # the parameter takes part in the graph
        if timed:
            assert self.e2 is not None
            self.e2.record()
        return x

    def get_time(self) -> float:
        """Milliseconds between the events of the last forward."""
        assert self.e1 is not None and self.e2 is not None
        return self.e1.elapsed_time(self.e2)


def _create_model(compute_cycles: int, has_params: bool, device: torch.device) -> nn.Module:
    # `limit_all_gathers=False`: the timing relies on the CPU running ahead of the GPU.
    units = [
        FSDP(Layer(compute_cycles, has_params), limit_all_gathers=False) for _ in range(NUM_UNITS)
    ]
    return FSDP(nn.Sequential(*units), limit_all_gathers=False).to(device)


class Min10:
    """Keeps the ten smallest samples: system events only ever make a sample longer."""

    def __init__(self) -> None:
        self.data: list[float] = []

    def add(self, new_data: float) -> None:
        if len(self.data) < KEPT_SAMPLES:
            self.data.append(new_data)
            return
        self.data.sort()
        if new_data < self.data[-1]:
            self.data[-1] = new_data

    def avg(self) -> float:
        return mean(self.data)


def _delaying(cycles: int, on_call: Callable[[], None]) -> Callable[..., Any]:
    """An all-gather handler (``harness.collectives.patch_collective``) that notes
    the call and enqueues a spin of ``cycles`` on the current stream first."""

    def handler(orig: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        on_call()
        if cycles > 0 and torch.cuda.is_available():
            torch.cuda._sleep(cycles)
        return orig(*args, **kwargs)

    return handler


class TestForwardOverlapWorldSizeOne(FSDPTest):
    world_size = 1

    def _expects_all_gather(self, has_params: bool) -> bool:
        return has_params and self.world_size > 1

    def _forward_all_gathers(
        self, model: nn.Module, batch: torch.Tensor, all_gather_cycles: int
    ) -> Any:
        """Runs the forward with delayed all-gathers; checks whether it all-gathered
        (the units have parameters when all-gathers are delayed, as upstream)."""
        calls: list[None] = []
        handler = _delaying(all_gather_cycles, lambda: calls.append(None))
        with patch_collective(Collective.ALL_GATHER, handler):
            out = model(batch)
        self.assertEqual(bool(calls), self._expects_all_gather(all_gather_cycles > 0))
        return out

    def _warm_up(self, model: nn.Module, batch: torch.Tensor) -> None:
        # One iteration first: it runs the first-iteration work (the execution
        # order is recorded, and checked under the DETAIL debug level).
        out = model(batch)
        out.backward()
        model.zero_grad(set_to_none=True)

    def _batch(self) -> torch.Tensor:
        batch = torch.rand(1).to(self.device)
        batch.requires_grad = True  # the forward computes something to differentiate
        return batch

    def _run(self, compute_cycles: int, all_gather_cycles: int) -> dict[str, float]:
        has_params = all_gather_cycles > 0
        model = _create_model(compute_cycles, has_params, self.device)
        batch = self._batch()
        self._warm_up(model, batch)

        cpu_iter, cpu_wait, gpu_compute, gpu_total = Min10(), Min10(), Min10(), Min10()
        for _ in range(TIMED_ITERS):
            e1 = torch.cuda.Event(enable_timing=True)
            e2 = torch.cuda.Event(enable_timing=True)
            cpu_start = time.process_time()
            # e1 and e2 are on the compute stream, which waits for the
            # all-gathers: e2 - e1 includes the all-gather time.
            e1.record()
            out = self._forward_all_gathers(model, batch, all_gather_cycles)
            e2.record()
            out.backward()
            model.zero_grad(set_to_none=True)
            cpu_iter_time = time.process_time() - cpu_start
            out.item()  # waits for the GPU
            cpu_wait_for_gpu_time = time.process_time() - cpu_start - cpu_iter_time
            layers = [m for m in model.modules() if isinstance(m, Layer)]
            cpu_iter.add(cpu_iter_time)
            cpu_wait.add(cpu_wait_for_gpu_time)
            gpu_compute.add(sum(layer.get_time() for layer in layers))
            gpu_total.add(e1.elapsed_time(e2))
        del model
        return {
            "cpu_iter": cpu_iter.avg(),
            "cpu_wait": cpu_wait.avg(),
            "gpu_compute": gpu_compute.avg(),
            "gpu_total": gpu_total.avg(),
        }

    def _assert_all_shorter(self, short: list[float], long: list[float]) -> None:
        # 10x is a safe margin: work on the GPU takes about 100x longer than none.
        for s in short:
            for l_ in long:
                self.assertTrue(s * 10 < l_, msg=f"{s} * 10 is not below {l_}")

    def _dist_train(self) -> None:
        sleep_cycles = int(SLEEP_MS * cuda_cycles_per_ms())
        e1 = self._run(0, 0)  # no compute, no all-gather
        e2 = self._run(0, sleep_cycles)  # no compute, only all-gather
        e3 = self._run(sleep_cycles, 0)  # only compute, no all-gather
        e4 = self._run(sleep_cycles, sleep_cycles)  # both compute and all-gather
        print(f"\nrank{self.rank}:\n  e1: {e1}\n  e2: {e2}\n  e3: {e3}\n  e4: {e4}")

        # The CPU runs ahead of the GPU, so it waits long for the GPU unless the GPU
        # has no real work; a failure here points at a host synchronisation in
        # forward or backward. e4's CPU time may be long: it queues both.
        short = [e1["cpu_iter"], e2["cpu_iter"], e3["cpu_iter"], e1["cpu_wait"]]
        long = [e3["cpu_wait"], e4["cpu_wait"]]
        # At world size 1 there is no all-gather; otherwise it prolongs the wait.
        (short if self.world_size == 1 else long).append(e2["cpu_wait"])
        self._assert_all_shorter(short, long)

        # Without compute and all-gather the GPU time is short.
        short = [e1["gpu_compute"], e1["gpu_total"], e2["gpu_compute"]]
        long = [e3["gpu_compute"], e3["gpu_total"], e4["gpu_compute"], e4["gpu_total"]]
        (short if self.world_size == 1 else long).append(e2["gpu_total"])
        self._assert_all_shorter(short, long)

        # All-gathers overlap compute.
        if self.world_size > 1:
            compute_only = e3["gpu_compute"]
            all_gather_only = e2["gpu_total"]
            both = e4["gpu_total"]
            self.assertTrue(compute_only + all_gather_only > 1.1 * both)

    @pytest.mark.requires_gpu(
        "times GPU spin kernels against all-gathers on CUDA streams with CUDA events"
    )
    def test_forward_overlap(self) -> None:
        """The CPU never waits for the GPU in forward or backward, and forward
        all-gathers overlap compute."""
        self._dist_train()

    def test_forward_all_gathers(self) -> None:
        """A forward all-gathers if and only if the units have parameters and the
        world size is above 1 (see [Note: What runs on the CPU])."""
        # upstream's four runs (compute, all-gather), with spins of one cycle
        for compute_cycles, all_gather_cycles in [(0, 0), (0, 1), (1, 0), (1, 1)]:
            model = _create_model(compute_cycles, all_gather_cycles > 0, self.device)
            batch = self._batch()
            self._warm_up(model, batch)
            for _ in range(2):
                out = self._forward_all_gathers(model, batch, all_gather_cycles)
                out.backward()
                model.zero_grad(set_to_none=True)


class TestForwardOverlapWorldSizeTwo(TestForwardOverlapWorldSizeOne):
    world_size = 2
