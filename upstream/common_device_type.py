"""``torch.testing._internal.common_device_type`` for this harness:
``instantiate_device_type_tests`` and ``get_devtype``.

[Note: "cuda" is the test's device]
Upstream instantiates a generic test class once per device type available to
the process (``TestApply`` -> ``TestApplyCUDA`` with ``test_x_cuda``). Here the
ranks run on CUDA or on the CPU as the run decides (``--device``, the GPUs a
worker owns), which is known only inside the ranks. So the ``cuda``
instantiation stands for the test's device: it keeps upstream's names, its
tests' ``device`` argument is the rank's device (``"cuda:<rank>"`` or
``"cpu"``; upstream passed ``"cuda:0"`` on every rank) and ``self.device_type``
is that device's type (``"cpu"`` on a CPU run). The ``cpu`` instantiation
(``TestXCPU``, ``test_x_cpu``) always computes on the CPU. ``hpu``, ``xpu``,
``mps`` and ``lazy`` are never available here, as on a machine without them.
``only_for``/``except_for`` select among ``cpu`` and ``cuda`` as upstream's do;
FSDP files pass ``only_for=("cuda", "hpu", "xpu")`` and get the ``cuda`` class.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import torch

from harness import current_device, current_device_type
from upstream.common_utils import decorated, expand, make_test_method


def get_devtype() -> torch.device:
    """The test's device type, as a device without index: ``cuda`` or ``cpu``
    (the rank's inside a test; at import in the pytest process, ``cuda`` when CUDA
    is available). Upstream returns its process's accelerator type."""
    return torch.device(current_device_type())


class _CPUTestBase:
    """What the ``cpu`` instantiation adds: the CPU is the test's device."""

    @property
    def device_type(self) -> str:
        return "cpu"

    def _device_argument(self) -> str:
        return "cpu"


class _CUDATestBase:
    """What the ``cuda`` instantiation adds: the test's device, wherever the ranks run."""

    @property
    def device_type(self) -> str:
        return current_device_type()

    def _device_argument(self) -> str:
        return str(current_device())


_BASES: dict[str, type] = {"cpu": _CPUTestBase, "cuda": _CUDATestBase}


def _as_tuple(names: str | Sequence[str] | None) -> tuple[str, ...]:
    if names is None:
        return ()
    return (names,) if isinstance(names, str) else tuple(names)


def _device_types(except_for: tuple[str, ...], only_for: tuple[str, ...]) -> list[str]:
    both = set(except_for) & set(only_for)
    if both:
        raise AssertionError(f"device ({both}) appeared in both except_for and only_for")
    return [
        device_type
        for device_type in _BASES
        if device_type not in except_for and (not only_for or device_type in only_for)
    ]


def _device_argument_of(test: Callable[..., Any]) -> Callable[[Any], str] | None:
    """How to fill the test's ``device`` parameter, if it has one."""
    if "device" not in inspect.signature(test).parameters:
        return None
    return lambda test_case: test_case._device_argument()


def instantiate_device_type_tests(
    generic_test_class: type,
    scope: MutableMapping[str, Any],
    except_for: str | Sequence[str] | None = None,
    only_for: str | Sequence[str] | None = None,
    include_lazy: bool = False,
    allow_mps: bool = False,
    allow_xpu: bool = False,
) -> None:
    """Replaces ``generic_test_class`` in ``scope`` by one class per device type
    (see [Note: "cuda" is the test's device]): ``<Generic><DEVICE>`` with the tests
    ``<test>[_<case suffix>]_<device>``, ``@parametrize`` cases expanded.
    ``include_lazy``, ``allow_mps`` and ``allow_xpu`` add devices this harness
    never has, so they change nothing."""
    del scope[generic_test_class.__name__]
    tests = {name: fn for name, fn in vars(generic_test_class).items() if name.startswith("test")}
    for device_type in _device_types(_as_tuple(except_for), _as_tuple(only_for)):
        class_name = generic_test_class.__name__ + device_type.upper()
        device_class = type(
            class_name,
            (_BASES[device_type], generic_test_class),
            {"__module__": generic_test_class.__module__, "__qualname__": class_name},
        )
        for name, fn in tests.items():
            for case in expand(fn, generic_test_class, device_class):
                test = decorated(case)
                suffix = f"_{case.suffix}" if case.suffix else ""
                make_test_method(
                    device_class,
                    f"{name}{suffix}_{device_type}",
                    test,
                    case.kwargs,
                    _device_argument_of(test),
                )
        scope[class_name] = device_class
    for name in tests:
        delattr(generic_test_class, name)
