"""The ``upstream`` package's pytest plugin: the ranks restore its modules after
every test, and upstream's single-process tests follow ``--map-cuda-to-cpu``.

Registered as a ``pytest11`` entry point, so an installed checkout loads it in
every session; ``-p upstream.plugin`` loads it explicitly.

[Note: Single-process tests on a machine without CUDA]
Upstream's ``TestCase`` tests (``upstream.common_utils.TestCase``) run in the
pytest process, not in ranks, and name CUDA devices as the multi-process ones do
(``torch.rand(3).to("cuda")`` in test_utils.py's ``test_apply_to_tensors``).
Upstream skips them on a machine without GPUs (``skip_if_lt_x_gpu(1)``); here,
as for the ranks, a CPU run runs them, and with ``--map-cuda-to-cpu`` (or its ini
value or marker) the test's ``setUp``, body and ``tearDown`` run under the
ranks' CUDA-to-CPU mapping (``harness._rank.cuda_mapping``) with the CPU as the
device, when the pytest process has no CUDA.
"""

from __future__ import annotations

import sys
from collections.abc import Generator

import pytest


@pytest.hookimpl(optionalhook=True)  # the runner's hook: absent under -p no:harness.plugin
def pytest_harness_isolated_modules(config: pytest.Config) -> list[str]:
    return ["upstream"]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    """Runs an upstream single-process test under the CUDA-to-CPU mapping when it
    asks for one (see [Note: Single-process tests on a machine without CUDA])."""
    if not _maps_single_process_test(item):
        return (yield)
    import torch

    from harness._rank.cuda_mapping import mapped

    with mapped(True, torch.device("cpu")):
        return (yield)


def _maps_single_process_test(item: pytest.Item) -> bool:
    """Imports nothing heavy for other tests: an upstream ``TestCase`` exists only
    once its module was imported (a project that never uses ``upstream`` keeps
    torch unimported)."""
    common_utils = sys.modules.get("upstream.common_utils")
    cls = getattr(item, "cls", None)
    if common_utils is None or not isinstance(cls, type):
        return False
    if not issubclass(cls, common_utils.TestCase):
        return False
    if not item.config.pluginmanager.has_plugin("harness.plugin"):  # its options
        return False
    import torch

    from harness.plugin import maps_cuda_to_cpu

    return not torch.cuda.is_available() and maps_cuda_to_cpu(item)
