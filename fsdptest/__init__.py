"""The FSDP test layer above the generic runner: the FSDP implementation under
test (``fsdptest.api``), ``FSDPTest``, parity against DDP, and the interface of
the models the suites train."""

from fsdptest.testcase import FSDPTest

__all__ = ["FSDPTest"]
