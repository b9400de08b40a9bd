"""Which device and backend the ranks of a test get, decided in the pytest process.

[Note: GPUs under pytest-xdist]
With G visible GPUs (an outer ``CUDA_VISIBLE_DEVICES`` is respected) and N xdist
workers, worker i owns the disjoint slice ``gpus[i*G//N : (i+1)*G//N]``. The
slice is written into ``CUDA_VISIBLE_DEVICES`` of the rank processes before
they start, so CUDA initialises with only the slice visible: two workers can
never share a GPU, and no worker silently lands on GPU 0. The pytest process
itself never initialises CUDA (it only counts devices), so it holds no GPU
memory. A test needing more GPUs than its worker's slice runs on CPU under
``--device auto`` and is skipped, naming the slice, under ``--device cuda``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from harness._types import Placement


def visible_gpus() -> tuple[str, ...]:
    """The GPUs this pytest process may hand out, as CUDA_VISIBLE_DEVICES entries."""
    outer = os.environ.get("CUDA_VISIBLE_DEVICES")
    if outer is not None:
        return tuple(e.strip() for e in outer.split(",") if e.strip() and e.strip() != "-1")
    import torch

    return tuple(str(i) for i in range(torch.cuda.device_count()))


def xdist_worker() -> tuple[int, int] | None:
    """(worker index, worker count) when running under pytest-xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not name or not count:
        return None
    return int(name.removeprefix("gw")), int(count)


def gpu_slice(gpus: tuple[str, ...], worker: tuple[int, int] | None) -> tuple[str, ...]:
    if worker is None:
        return gpus
    index, count = worker
    return gpus[index * len(gpus) // count : (index + 1) * len(gpus) // count]


@dataclass(frozen=True)
class DevicePlan:
    requested: str  # "auto" | "cpu" | "cuda"
    gpus: tuple[str, ...]
    worker: tuple[int, int] | None

    @classmethod
    def detect(cls, requested: str) -> DevicePlan:
        worker = xdist_worker()
        gpus = () if requested == "cpu" else gpu_slice(visible_gpus(), worker)
        return cls(requested, gpus, worker)

    def placement(self, world_size: int) -> Placement | str:
        """A placement for ``world_size`` ranks, or the reason none fits."""
        if self.requested != "cpu" and len(self.gpus) >= world_size:
            return Placement("cuda", "nccl", ",".join(self.gpus[:world_size]))
        if self.requested == "cuda":
            return f"needs {world_size} GPUs but {self._owner()} owns {self._describe_gpus()}"
        return Placement("cpu", "gloo", "")  # CPU ranks must not touch a GPU

    def _owner(self) -> str:
        if self.worker is None:
            return "this pytest process"
        return f"xdist worker gw{self.worker[0]} of {self.worker[1]}"

    def _describe_gpus(self) -> str:
        if not self.gpus:
            return "no GPU"
        return f"GPUs [{', '.join(self.gpus)}]"
