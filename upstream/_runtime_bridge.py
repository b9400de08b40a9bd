"""Upstream's patches of torch's FSDP runtime functions reach the FSDP under test.

[Note: Upstream's patches of torch's runtime functions]
Upstream's FSDP1 tests patch torch's private runtime functions by their dotted
name and count or wrap the calls, calling the original they read off the same
module before::

    orig = torch.distributed.fsdp._runtime_utils._post_backward_reshard
    with mock.patch("torch.distributed.fsdp._runtime_utils._post_backward_reshard", counting):
        ...  # counting(*args, **kwargs) counts, then calls orig(*args, **kwargs)

Only the imports of a ported file change, so the name stays torch's. Under
``--fsdp-impl torch`` it is torch's function and nothing is needed. For another
implementation with seams (``fsdptest.api.SEAMS``: ours), ``runtime_seams_bridged``
makes each of torch's names in ``fsdptest.adapters.TORCH_SEAMS`` hold, for the
block, the implementation's function of the same role, and makes the
implementation call that function through torch's name, looked up at each call.
A patch of torch's name then wraps the implementation's function, and the
original the test read is the implementation's. Both sides are put back when the
block ends (and the rank's isolation restores them after every test in any case).

Arguments pass through unchanged: a replacement that only counts or forwards
works on every implementation, one that reads its arguments sees the
implementation's (ours: ``FSDPState`` and ``FlatParamHandle`` where torch passes its
state and handle). Torch's own FSDP1 cannot run in the block (its runtime
functions are the implementation's), so upstream's ``FSDPTest`` opens it around
each test only when the implementation under test is not torch's (a seam whose
name is torch's is left alone).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import pkgutil
from collections.abc import Callable, Iterator
from typing import Any

from fsdptest import api
from fsdptest.adapters import TORCH_SEAMS, Seams


@contextlib.contextmanager
def runtime_seams_bridged() -> Iterator[None]:
    """Torch's runtime function names lead to the implementation's functions in
    the block (see the module note); a no-op for torch's FSDP or an
    implementation without seams."""
    seams = getattr(api, "SEAMS", None)
    if not isinstance(seams, Seams):
        yield
        return
    with contextlib.ExitStack() as stack:
        for field in dataclasses.fields(Seams):
            torch_name = getattr(TORCH_SEAMS, field.name)
            implementation_name = getattr(seams, field.name)
            if torch_name != implementation_name:
                stack.enter_context(_bridged(torch_name, implementation_name))
        yield


@contextlib.contextmanager
def _bridged(torch_name: str, implementation_name: str) -> Iterator[None]:
    """``torch_name`` holds the implementation's function, which the implementation
    calls through ``torch_name`` (read at each call), for the block."""
    torch_module_name, torch_attr = torch_name.rsplit(".", 1)
    torch_module = importlib.import_module(torch_module_name)
    owner_name, attr = implementation_name.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_name)
    torch_original = getattr(torch_module, torch_attr)
    held = inspect.getattr_static(owner, attr)  # as stored: a method is a plain function

    def through_torch_name(*args: Any, **kwargs: Any) -> Any:
        function: Callable[..., Any] = getattr(torch_module, torch_attr)
        return function(*args, **kwargs)

    setattr(torch_module, torch_attr, held)
    setattr(owner, attr, through_torch_name)
    try:
        yield
    finally:
        setattr(owner, attr, held)
        setattr(torch_module, torch_attr, torch_original)


__all__ = ["runtime_seams_bridged"]
