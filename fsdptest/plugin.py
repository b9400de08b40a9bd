"""The FSDP test layer's pytest plugin: which FSDP implementation is under test.

It sits on top of the generic runner (``harness.plugin``) and talks to it only
through the runner's hooks: it adds ``--fsdp-impl``, exports the choice to the
ranks (``FSDP_HARNESS_IMPL``, read by ``fsdptest.api`` when first imported; the
ranks inherit the environment), asks the ranks to restore the FSDP packages
after every test, and skips, before any rank starts, configurations torch's
FSDP cannot run on CPU-only machines (except in tests marked
``torch_cpu_offload_asserted``, which assert that failure themselves).
"""

from __future__ import annotations

import os

import pytest

from fsdptest._constants import (
    CPU_OFFLOAD_ASSERTED_HELP,
    CPU_OFFLOAD_ASSERTED_MARKER,
    IMPL_ENV,
    TORCH_CPU_OFFLOAD_SKIP,
)
from harness._types import Placement

IMPLEMENTATIONS = ("local", "torch")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fsdp", "FSDP implementation under test (fsdptest)")
    group.addoption(
        "--fsdp-impl",
        choices=IMPLEMENTATIONS,
        default="local",
        help="FSDP under test: this project's fsdp package (local) or "
        "torch.distributed.fsdp (torch). Default: local.",
    )


def pytest_configure(config: pytest.Config) -> None:
    os.environ[IMPL_ENV] = config.getoption("fsdp_impl")
    config.addinivalue_line("markers", CPU_OFFLOAD_ASSERTED_HELP)


def pytest_harness_isolated_modules(config: pytest.Config) -> list[str]:
    return ["fsdp", "fsdptest"]


@pytest.hookimpl(trylast=True)
def pytest_harness_skip_reason(item: pytest.Item, placement: Placement) -> str | None:
    """Torch's FSDP cannot offload parameters on a CPU-only run: such cases are
    skipped here, before any rank starts, when the parametrization says so."""
    if item.config.getoption("fsdp_impl") != "torch" or placement.device_type != "cpu":
        return None
    if item.get_closest_marker(CPU_OFFLOAD_ASSERTED_MARKER) is not None:
        return None
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec is not None else {}
    for name, value in params.items():
        if getattr(value, "offload_params", False) is True or (
            name == "offload_params" and value is True
        ):
            return TORCH_CPU_OFFLOAD_SKIP
    return None
