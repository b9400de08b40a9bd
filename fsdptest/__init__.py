"""The FSDP test layer above the generic runner: the FSDP implementation under
test (``fsdptest.api``), ``FSDPTest``, parity against DDP, and the interface of
the models the suites train.

``FSDPTest`` is imported on first use: pytest loads this package's plugin (which
imports the package) before ``--fsdp-impl`` is known, and ``FSDPTest`` imports the
facade, which picks the implementation when it is first imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsdptest.testcase import FSDPTest

__all__ = ["FSDPTest"]


def __getattr__(name: str) -> Any:
    if name == "FSDPTest":
        from fsdptest.testcase import FSDPTest

        return FSDPTest
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
