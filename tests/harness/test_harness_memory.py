"""``harness.memory.MemoryMeter`` counts the bytes a rank's tensors hold."""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness import DistributedTest
from harness.memory import MemoryMeter

KIB = 1024


class TestMemoryMeter(DistributedTest):
    world_size = 2

    def test_marks_count_allocations_frees_and_collective_outputs(self) -> None:
        """Bytes allocated since the meter started and still held, at each mark:
        a tensor, a collective's output (its copies on the helper thread not
        counted), and both freed."""
        meter = MemoryMeter(self.device)
        with meter.measuring():
            meter.mark("start")
            local = torch.ones(64 * KIB, device=self.device)  # 256 KiB
            meter.mark("local")
            gathered = torch.empty(2 * local.numel(), device=self.device)  # 512 KiB
            dist.all_gather_into_tensor(gathered, local)
            dist.all_reduce(local)
            meter.mark("gathered")
            del local, gathered
            meter.mark("freed")
        held = meter.held()
        self.assertEqual(list(held), ["start", "local", "gathered", "freed"])
        base = held["start"]
        self.assertEqual(held["local"] - base, 256 * KIB)
        self.assertEqual(held["gathered"] - base, 768 * KIB)
        self.assertEqual(held["freed"] - base, 0)

    def test_frees_of_tensors_older_than_the_meter_are_not_counted(self) -> None:
        """A tensor allocated before ``measuring()`` and freed inside it (a cache a
        library drops, a collective's tensors NCCL lets go late) lowers no mark:
        marks count what was allocated since the meter started ([Note: Frees of
        older blocks while measuring]; on CPU the profiler ignores such frees)."""
        older = [torch.ones(16 * KIB, device=self.device) for _ in range(3)]  # 3 x 64 KiB
        small = torch.ones(41, device=self.device)  # 164 bytes: below a CUDA block's 512
        meter = MemoryMeter(self.device)
        with meter.measuring():
            meter.mark("start")
            new = torch.ones(64 * KIB, device=self.device)  # 256 KiB
            meter.mark("new")
            del older[1:], small
            meter.mark("older freed")
            reused = torch.ones(16 * KIB, device=self.device)  # may take a freed block
            meter.mark("reused")
            del older, new
            meter.mark("all freed")
        del reused
        held = meter.held()
        base = held["start"]
        self.assertEqual(held["new"] - base, 256 * KIB)
        self.assertEqual(held["older freed"] - base, 256 * KIB)
        self.assertEqual(held["reused"] - base, 320 * KIB)
        self.assertEqual(held["all freed"] - base, 64 * KIB)

    def test_collectives_still_compute(self) -> None:
        """Run on copies, the collectives write their results into the caller's
        tensors, also for the list forms and asynchronous calls."""
        meter = MemoryMeter(self.device)
        with meter.measuring():
            x = torch.full((4,), float(self.rank + 1), device=self.device)
            outs = [torch.empty_like(x) for _ in range(2)]
            dist.all_gather(outs, x)
            work = dist.all_reduce(x, async_op=True)
            work.wait()
        self.assertEqual(outs[0], torch.full((4,), 1.0, device=self.device))
        self.assertEqual(outs[1], torch.full((4,), 2.0, device=self.device))
        self.assertEqual(x, torch.full((4,), 3.0, device=self.device))
