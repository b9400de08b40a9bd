"""Fixtures of the single-process tests of fsdp's parts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def fake_group() -> Iterator[object]:
    """The default group as rank 0 of two on torch's ``fake`` backend: collectives
    return without communicating, so gathered values are meaningless while
    shapes, lifecycles and views are real."""
    if dist.is_initialized():
        pytest.skip("a default process group exists in this process already")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD_SIZE)
    try:
        yield dist.distributed_c10d._get_default_group()
    finally:
        dist.destroy_process_group()
