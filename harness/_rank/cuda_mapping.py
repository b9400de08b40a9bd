"""``--map-cuda-to-cpu``: the CUDA devices a test names resolve to its CPU rank's device.

[Note: Mapping CUDA to a CPU rank]
Tests written for GPUs name their device in code: ``tensor.cuda()``,
``module.cuda()``, ``torch.zeros(..., device="cuda")``, ``x.to("cuda:1")``. On a
CPU rank these fail (``Torch not compiled with CUDA enabled`` on a CPU build of
torch). With the opt-in, a CPU rank runs the test's ``setUp``, body and
``tearDown`` under a torch function mode that rewrites every CUDA device a torch
function receives to the rank's device: a ``device=`` keyword (factories,
``new_*``, ``*_like``, layers built with ``device=``), the device argument of
``Tensor.to`` and of ``Module.to``'s argument parser (``_parse_to``, through
which ``Module.to(rank)`` passes), and ``Tensor.cuda`` itself; ``Module.cuda``
reaches those. A CUDA device is a ``torch.device`` or string of type ``cuda``, or
an integer index (torch's spelling of the current accelerator's device).

A mode rather than patched attributes: the device reaches torch through
hundreds of functions, and a mode is one object on a stack. ``mapped`` pops the
stack back to its depth before the test when the test ends, also what the
test itself left pushed, so nothing outlives the test (``isolation`` clears the
stack after every test as well).

Three more things are mapped, each patched for the block and put back after it:
a ``DeviceMesh`` (``init_device_mesh("cuda", ...)`` included) asked for on
``cuda`` is built on the rank's device type; ``torch.cuda.device_count()``
answers the rank pool's world size (a test that
sizes itself by its GPUs, ``world_size = min(4, torch.cuda.device_count())``,
then sees one device per rank, as on the GPU machine it was written for; the
pytest process answers such a class's ``world_size`` the same way:
``harness.testcase.declared_world_size``), and ``DistributedDataParallel`` given
``device_ids``/``output_device`` for a module whose parameters are on the CPU drops
them (torch refuses device ids for CPU modules; on the GPU machine they named the
module's own device, which on a CPU rank is the CPU).

Not mapped: the other ``torch.cuda`` functions (``current_device``, ``set_device``,
``synchronize``, streams, events), a CUDA device handed to code that is not a
torch function (``FSDP(device_id=torch.device("cuda"))``), and comparisons with a
CUDA device.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel
from torch.overrides import TorchFunctionMode

_CUDA_KEYWORDS = ("non_blocking", "memory_format")


def names_cuda(device: object) -> bool:
    """Whether ``device`` (a device argument of a torch function) names a CUDA device."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return isinstance(device, int) and not isinstance(device, bool)


class CudaToRankDevice(TorchFunctionMode):
    """Rewrites the CUDA devices torch functions receive to ``device`` (see the module note)."""

    device: torch.device

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            moves = {k: v for k, v in kwargs.items() if k in _CUDA_KEYWORDS}
            return args[0].to(self.device, **moves)
        if names_cuda(kwargs.get("device")):
            kwargs["device"] = self.device
        if func is torch.Tensor.to and len(args) > 1 and names_cuda(args[1]):
            args = (args[0], self.device, *args[2:])
        if func is torch._C._nn._parse_to and args and names_cuda(args[0]):
            args = (self.device, *args[1:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def mapped(enabled: bool, device: torch.device) -> Iterator[None]:
    """Runs the block under ``CudaToRankDevice(device)`` when ``enabled`` and the
    rank computes on the CPU; afterwards the torch function mode stack is as before."""
    if not enabled or device.type != "cpu":
        yield
        return
    depth = torch._C._len_torch_function_stack()
    CudaToRankDevice(device).__enter__()  # left by popping the stack back to its depth
    try:
        ranks = dist.get_world_size() if dist.is_initialized() else 1
        with gpus_counted_as(ranks), _ddp_without_cpu_device_ids(), _meshes_on(device):
            yield
    finally:
        pop_function_modes(depth)


@contextlib.contextmanager
def gpus_counted_as(count: int) -> Iterator[None]:
    """``torch.cuda.device_count()`` answers ``count`` in the block (see the module note)."""
    original = torch.cuda.device_count
    torch.cuda.device_count = lambda: count
    try:
        yield
    finally:
        torch.cuda.device_count = original


@contextlib.contextmanager
def _meshes_on(device: torch.device) -> Iterator[None]:
    """A ``DeviceMesh`` asked for on ``cuda`` is built on ``device``'s type in the block."""
    original = DeviceMesh.__init__

    @functools.wraps(original)
    def init(self: DeviceMesh, device_type: str, *args: Any, **kwargs: Any) -> None:
        original(self, device.type if names_cuda(device_type) else device_type, *args, **kwargs)

    DeviceMesh.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh.__init__ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _ddp_without_cpu_device_ids() -> Iterator[None]:
    """DDP drops ``device_ids``/``output_device`` for a CPU module in the block."""
    original = DistributedDataParallel.__init__

    @functools.wraps(original)
    def init(
        self: DistributedDataParallel, module: torch.nn.Module, *args: Any, **kwargs: Any
    ) -> None:
        if all(p.device.type == "cpu" for p in module.parameters()):
            args = (None, None, *args[2:])[: len(args)]
            kwargs.update({k: None for k in ("device_ids", "output_device") if k in kwargs})
        original(self, module, *args, **kwargs)

    DistributedDataParallel.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        DistributedDataParallel.__init__ = original  # type: ignore[method-assign]


def pop_function_modes(depth: int = 0) -> int:
    """Pops torch function modes until ``depth`` remain; returns how many were popped."""
    popped = 0
    while torch._C._len_torch_function_stack() > depth:
        torch._C._pop_torch_function_stack()
        popped += 1
    return popped
