"""Which device and backend the ranks of a test get, decided in the pytest process.

[Note: GPUs under pytest-xdist]
Every pytest process of a session (each xdist worker, or the one process without
xdist) may use every visible GPU (an outer ``CUDA_VISIBLE_DEVICES`` is
respected). A test whose k ranks fit on the G GPUs (k <= G) leases k of them for
its run, waiting while other workers hold them (see [Note: Leasing GPUs] in
``harness._controller.leases``), and its ranks start with the lease as their
``CUDA_VISIBLE_DEVICES``, so CUDA initialises with only those GPUs visible, and
none silently lands on GPU 0. A GPU has slots, one per test it may hold at once
(``--gpu-slots``: by default one per pytest -n worker, at most four, see [Note:
Slots by default] in ``harness._controller.options``; 1: no two tests share a
GPU); each test's ranks are on distinct GPUs. On a machine whose tests are small,
the GPUs then serve several tests at a time instead of idling between one test's
kernels (see docs/runs/gpu-runs.md for what it buys). The pytest processes never
initialise CUDA (they only count devices) and hold no GPU memory.

A pool is started on the GPUs of a lease and kept, idle, when the lease ends
(see ``PoolManager``): the next lease of the same GPUs, which the lease pool
prefers, reuses it with its CUDA contexts and communicator. Where other
processes may lease the same GPUs (xdist workers, or sessions sharing a
``--gpu-lease-dir``), a rank frees its cached CUDA memory after every test, so
that an idle pool takes no more of a GPU than its contexts while another
worker's test runs there.

A test that needs more GPUs than there are (k > G: every GPU of the machine,
not only those free now) runs on CPU ranks under ``--device auto``, and says
so: its report carries the reason (``dist_fallback``, shown in ``-v``) and the
session summary's line for its world size counts it ("3-rank tests: 12 on
cpu/gloo (cpu fallback: needs 3 GPUs, 2 visible)"; see [Note: What ran where]
in ``harness._controller.pytest_reports``). Under ``--device cuda`` such a test
errors at setup with the reason: the user asked for GPUs, so CPU ranks would
check something else. No test ever waits for GPUs it could never get, and no
test runs on CPU while enough GPUs exist: it waits for them.

The lease directory belongs to the session: ``<tmp>/harness-gpu-leases-<uid>/<id>``
with xdist's ``testrunuid`` as the id (shared by the workers of a session; the
controller sets it when the user did not), or a fresh id without xdist. Two
pytest sessions on one machine therefore lease independently, each from every
GPU, as sessions did before leasing; ``--gpu-lease-dir DIR`` names a directory
to share instead, and sessions naming the same one never share a GPU (they must
name GPUs alike: ``CUDA_VISIBLE_DEVICES`` entries). A session's own directory is
removed when it ends. A torchrun run leases nothing: torchrun places its ranks
(see ``harness._torchrun``).

The ini value ``harness_fake_gpus`` names GPUs that do not exist, for testing the
leasing on a machine without GPUs: tests lease them, wait for them and get pools
keyed by them exactly as with real GPUs; only the ranks compute on CPU and gloo
(their reports say ``cpu/gloo, fake GPUs g0,g1``). ``--device cuda`` accepts fake
GPUs as GPUs. A rank finds the ids it leased in ``HARNESS_GPUS``, with fake GPUs
and real ones.

The plan is worked out on first use (``harness.plugin.device_plan``), not when
the plugin is configured: counting GPUs imports torch, which a session without
distributed tests never needs (see [Note: A plugin in every session] in
``harness.plugin``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness._types import Placement

LEASED_GPUS_ENV = "HARNESS_GPUS"  # the ids a rank's pool leased, comma separated


def visible_gpus() -> tuple[str, ...]:
    """The GPUs this pytest process may lease, as CUDA_VISIBLE_DEVICES entries."""
    outer = os.environ.get("CUDA_VISIBLE_DEVICES")
    if outer is not None:
        return tuple(e.strip() for e in outer.split(",") if e.strip() and e.strip() != "-1")
    import torch

    return tuple(str(i) for i in range(torch.cuda.device_count()))


def parse_gpu_ids(text: str) -> tuple[str, ...]:
    ids = tuple(e.strip() for e in text.split(",") if e.strip())
    if len(set(ids)) != len(ids):
        raise pytest.UsageError(f"harness_fake_gpus names a GPU twice: {text!r}")
    return ids


@dataclass(frozen=True)
class DevicePlan:
    requested: str  # "auto" | "cpu" | "cuda"
    gpus: tuple[str, ...]  # every GPU the session leases from
    fake: bool = False  # the GPUs are names only; ranks compute on CPU

    @classmethod
    def detect(cls, requested: str, fake_gpus: tuple[str, ...] = ()) -> DevicePlan:
        if requested == "cpu":
            return cls(requested, ())
        if fake_gpus:
            return cls(requested, fake_gpus, fake=True)
        return cls(requested, visible_gpus())

    def placement(self, world_size: int) -> Placement | str:
        """A placement for ``world_size`` ranks, or the reason none fits."""
        if self.requested != "cpu" and len(self.gpus) >= world_size:
            if self.fake:
                return Placement("cpu", "gloo", "", lease=world_size)
            return Placement("cuda", "nccl", None, lease=world_size)
        if self.requested == "cuda":
            return f"needs {world_size} GPUs but {self._describe_gpus()}"
        if not self.gpus:
            return Placement("cpu", "gloo", "")  # CPU ranks must not touch a GPU
        why = f"needs {world_size} GPUs, {len(self.gpus)} visible"
        return Placement("cpu", "gloo", "", fallback=why)

    def _describe_gpus(self) -> str:
        if not self.gpus:
            return "no GPU is visible"
        kind = "fake GPUs" if self.fake else "GPUs"
        return f"only {len(self.gpus)} {kind} are visible [{', '.join(self.gpus)}]"


class LeaseDirectory:
    """Where the session's lease files live, and who removes them (see the note)."""

    def __init__(self, path: Path, owned: bool, given: bool = False) -> None:
        self.path = path
        self.owned = owned  # this process removes the directory at the end
        self.given = given  # named by --gpu-lease-dir: other sessions may share it

    @classmethod
    def for_session(cls, config: pytest.Config, given: Path | None) -> LeaseDirectory:
        if given is not None:
            return cls(given, owned=False, given=True)
        root = Path(tempfile.gettempdir()) / f"harness-gpu-leases-{os.getuid()}"
        workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
        if workerinput is not None:
            return cls(root / str(workerinput["testrunuid"]), owned=False)
        if getattr(config.option, "numprocesses", None):  # the xdist controller
            if not getattr(config.option, "testrunuid", None):
                config.option.testrunuid = uuid.uuid4().hex
            return cls(root / config.option.testrunuid, owned=True)
        return cls(root / uuid.uuid4().hex, owned=True)

    def shared(self, config: pytest.Config) -> bool:
        """Whether other pytest processes may lease these GPUs: the workers of an
        xdist session, or sessions sharing a directory given to them."""
        workerinput: dict[str, Any] = getattr(config, "workerinput", {})
        return self.given or int(workerinput.get("workercount", 1)) > 1

    def remove(self) -> None:
        if self.owned:
            shutil.rmtree(self.path, ignore_errors=True)
