"""Upstream-style FSDP2 test files (in the style of upstream's
``test/distributed/_composable/fsdp/``; only their imports differ from files
written against ``torch.testing._internal``). They name their device ``cuda``
and size themselves by the GPUs, as upstream's older files do, so on CPU ranks
they run with the CUDA devices mapped to the rank's (``--map-cuda-to-cpu``,
given here for the folder)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = __file__.rsplit("/", 1)[0]
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.map_cuda_to_cpu)
