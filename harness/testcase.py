"""Base classes for distributed tests.

A test class subclasses :class:`DistributedTest` and may
declare ``world_size`` as a class attribute or a property; a class that does
not declare one runs with ``--world-size`` ranks (default 2). Each test method
runs on every rank, in its own spawned process, with the default process group
initialised; ``setUp``/``tearDown`` run in every rank around the body.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from harness._rank import context as rank_context
from harness._rank.cuda_mapping import gpus_counted_as
from harness.assertions import Assertions


def current_device() -> torch.device:
    """The device of the rank this code runs in (``cuda:<rank>`` under NCCL, the
    CPU under gloo). Outside a rank: the current CUDA device if any, else the CPU."""
    context = rank_context.current_or_none()
    if context is not None:
        return context.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def current_device_type() -> str:
    """The type of ``current_device()``, without initialising CUDA: outside a rank,
    ``"cuda"`` when CUDA is available, else ``"cpu"`` (module-level code of a test
    file also runs in the pytest process, which never initialises CUDA)."""
    context = rank_context.current_or_none()
    if context is not None:
        return context.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


class DistributedTest(Assertions):
    """A pytest test class whose test methods run on every rank."""

    @property
    def world_size(self) -> int:
        return rank_context.current().world_size

    @property
    def rank(self) -> int:
        return rank_context.current().rank

    @property
    def device(self) -> torch.device:
        """This rank's device: ``cuda:<rank>`` under NCCL, the CPU under gloo."""
        return rank_context.current().device

    @property
    def backend(self) -> str:
        return rank_context.current().backend

    @property
    def process_group(self) -> dist.ProcessGroup:
        return dist.distributed_c10d._get_default_group()

    def setUp(self) -> None:
        """Runs in every rank before the test body."""

    def tearDown(self) -> None:
        """Runs in every rank after the test body, also when it failed."""

    def run_subtests(
        self,
        subtest_config: Mapping[str, Sequence[object]],
        test_fn: Callable[..., object],
        *test_args: object,
        **test_kwargs: object,
    ) -> None:
        """Runs ``test_fn`` for every combination of ``subtest_config``.

        Every combination runs, also after one fails; the report names each
        failing combination with its configuration and every failing rank.
        """
        rank_context.current().run_subtests(subtest_config, test_fn, test_args, dict(test_kwargs))


def declared_world_size(cls: type, gpus_if_none: int | None = None) -> int | None:
    """The world size a class pins, or None when it leaves it to ``--world-size``.

    ``gpus_if_none``: where this process sees no GPU and the test's CUDA devices
    map to CPU ranks (``--map-cuda-to-cpu``), the count ``torch.cuda.device_count()``
    answers while a ``world_size`` property is read (see [Note: Mapping CUDA to a
    CPU rank] in ``harness._rank.cuda_mapping``)."""
    for klass in cls.__mro__:
        if "world_size" in vars(klass):
            if klass is DistributedTest:
                return None
            attr = vars(klass)["world_size"]
            if not isinstance(attr, property):
                return int(attr)
            counting = gpus_if_none is not None and torch.cuda.device_count() == 0
            with gpus_counted_as(gpus_if_none) if counting else contextlib.nullcontext():
                value: Any = attr.fget(cls.__new__(cls))
            return int(value)
    return None
