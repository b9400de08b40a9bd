"""Base classes for distributed tests.

A test class subclasses :class:`DistributedTest` (or :class:`FSDPTest`) and may
declare ``world_size`` as a class attribute or a property; a class that does
not declare one runs with ``--world-size`` ranks (default 2). Each test method
runs on every rank, in its own spawned process, with the default process group
initialised; ``setUp``/``tearDown`` run in every rank around the body.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from harness import _rank
from harness.assertions import Assertions


class DistributedTest(Assertions):
    """A pytest test class whose test methods run on every rank."""

    @property
    def world_size(self) -> int:
        return _rank.current().world_size

    @property
    def rank(self) -> int:
        return _rank.current().rank

    @property
    def device(self) -> torch.device:
        """This rank's device: ``cuda:<rank>`` under NCCL, the CPU under gloo."""
        return _rank.current().device

    @property
    def backend(self) -> str:
        return _rank.current().backend

    @property
    def process_group(self) -> dist.ProcessGroup:
        return dist.distributed_c10d._get_default_group()

    def setUp(self) -> None:  # noqa: N802 - unittest spelling, so seed code ports unchanged
        """Runs in every rank before the test body."""

    def tearDown(self) -> None:  # noqa: N802
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
        _rank.current().run_subtests(subtest_config, test_fn, test_args, dict(test_kwargs))


def declared_world_size(cls: type) -> int | None:
    """The world size a class pins, or None when it leaves it to ``--world-size``."""
    for klass in cls.__mro__:
        if "world_size" in vars(klass):
            if klass is DistributedTest:
                return None
            attr = vars(klass)["world_size"]
            value: Any = attr.fget(cls.__new__(cls)) if isinstance(attr, property) else attr
            return int(value)
    return None


class FSDPTest(DistributedTest):
    """A distributed test with the helpers FSDP's upstream test files use."""

    def _check_cpu_offload(self, fsdp_model: Any, cpu_offload: Any) -> None:
        self.assertEqual(cpu_offload, fsdp_model.cpu_offload)

    def _check_backward_prefetch(self, fsdp_model: Any, backward_prefetch: Any) -> None:
        self.assertEqual(backward_prefetch, fsdp_model.backward_prefetch)

    def _check_forward_prefetch(self, fsdp_model: Any, forward_prefetch: bool) -> None:
        self.assertEqual(forward_prefetch, fsdp_model.forward_prefetch)
