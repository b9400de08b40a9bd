"""The FSDP test layer's pytest plugin: which FSDP implementation is under test.

It sits on top of the generic runner (``harness.plugin``) and talks to it only
through the runner's hooks: it adds ``--fsdp-impl`` (a built-in name, a registered
entry point or a module path; see ``fsdptest.implementations``), resolves it once
(an unknown name is a usage error listing the known ones), exports it to the
ranks (``FSDP_HARNESS_IMPL``, read by ``fsdptest.api`` when first imported; the
ranks inherit the environment), asks the ranks to restore the FSDP packages
after every test, and skips, before any rank starts, configurations torch's
FSDP cannot run on CPU-only machines.
"""

from __future__ import annotations

import os

import pytest

from fsdptest._constants import IMPL_ENV, TORCH_CPU_OFFLOAD_SKIP
from fsdptest.implementations import (
    ENTRY_POINT_GROUP,
    Implementation,
    UnknownImplementation,
    resolve,
)
from harness._types import Placement

impl_key = pytest.StashKey[Implementation]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fsdp", "FSDP implementation under test (fsdptest)")
    group.addoption(
        "--fsdp-impl",
        default="local",
        metavar="NAME",
        help="FSDP under test: this project's fsdp package (local), torch.distributed.fsdp "
        f"(torch), a name registered in the entry-point group {ENTRY_POINT_GROUP}, or the "
        "path of a module exposing the FSDP1 API (mypkg.fsdp). Default: local.",
    )


@pytest.hookimpl(tryfirst=True)  # before the runner's, which asks for the isolated modules
def pytest_configure(config: pytest.Config) -> None:
    name = config.getoption("fsdp_impl")
    try:
        config.stash[impl_key] = resolve(name)
    except UnknownImplementation as error:
        raise pytest.UsageError(str(error)) from None
    os.environ[IMPL_ENV] = name


def pytest_report_header(config: pytest.Config) -> str:
    impl = config.stash[impl_key]
    return f"fsdp implementation: {impl.describe()} ({impl.origin})"


def pytest_harness_isolated_modules(config: pytest.Config) -> list[str]:
    impl = config.stash[impl_key]
    return ["fsdp", "fsdptest", *([] if impl.is_builtin else [impl.module])]


@pytest.hookimpl(trylast=True)
def pytest_harness_skip_reason(item: pytest.Item, placement: Placement) -> str | None:
    """Torch's FSDP cannot offload parameters on a CPU-only run: such cases are
    skipped here, before any rank starts, when the parametrization says so."""
    if item.config.stash[impl_key].kind != "torch" or placement.device_type != "cpu":
        return None
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec is not None else {}
    for name, value in params.items():
        if getattr(value, "offload_params", False) is True or (
            name == "offload_params" and value is True
        ):
            return TORCH_CPU_OFFLOAD_SKIP
    return None
