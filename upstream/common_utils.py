"""``torch.testing._internal.common_utils`` for this harness: parametrization with
upstream's test names, ``subtest``, ``TestCase`` for single-process tests,
``run_tests`` and the flags FSDP test files read.

[Note: Parametrized tests keep upstream's names]
``@parametrize`` only records how to expand a test (as ``fn.parametrize_fn``,
upstream's protocol: it yields ``(test, suffix, kwargs, decorator_fn)`` cases);
``instantiate_parametrized_tests`` (or ``instantiate_device_type_tests``)
replaces the generic test by one method per case, named as upstream names it:
the test's name, ``_``, then per parameter ``<name>_<value>`` for ints, bools,
floats (dots as underscores) and strings, the dtype's name for a dtype, the
device's string for a device, ``<name><index>`` for any other value. A
``name_fn`` or ``subtest(..., name=...)`` replaces a case's suffix; stacked
decorators multiply, the upper decorator's suffix first.

The generated methods take no parameters, so pytest asks for no fixtures and
nothing is pickled to the ranks: every rank rebuilds the same methods when it
imports the test file, and each method calls the test with its case's values.
"""

from __future__ import annotations

import functools
import sys
import unittest
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import pytest
import torch

from harness.assertions import Assertions

TestFn = Callable[..., Any]
Decorator = Callable[[TestFn], TestFn]

# Upstream reads PYTORCH_TEST_WITH_DEV_DBG_ASAN; this harness does not run under
# a dev-debug ASAN build, so files that exit early on it always run here.
TEST_WITH_DEV_DBG_ASAN = False
TEST_WITH_ROCM = torch.version.hip is not None
# Whether this process can use CUDA: in a rank, whether the ranks run on CUDA
# (CPU ranks never see a GPU); in the pytest process, whether there is one.
TEST_CUDA = torch.cuda.is_available()
# The harness runs ranks on CUDA or on the CPU only.
TEST_HPU = False
TEST_XPU = False


class Case(NamedTuple):
    """One case of a parametrized test (a 4-tuple, as upstream's ``parametrize_fn`` yields)."""

    test: TestFn
    suffix: str
    kwargs: dict[str, Any]
    decorator_fn: Callable[[Mapping[str, Any]], list[Decorator]]


ParametrizeFn = Callable[[TestFn, type, "type | None"], Iterator[Case]]


def _no_decorators(_: Mapping[str, Any]) -> list[Decorator]:
    return []


class subtest:
    """One case of ``@parametrize`` with its own ``name`` (the test's suffix) and
    ``decorators`` (applied to that case's test only)."""

    __slots__ = ("arg_values", "decorators", "name")
    arg_values: object
    name: str | None
    decorators: list[Decorator]

    def __init__(
        self,
        arg_values: object,
        name: str | None = None,
        decorators: Sequence[Decorator] | None = None,
    ) -> None:
        self.arg_values = arg_values
        self.name = name
        self.decorators = list(decorators or [])


class parametrize:
    """``@parametrize("a,b", [(1, 2), ...], name_fn=None)``: see [Note: Parametrized
    tests keep upstream's names]. Values may be ``subtest`` instances."""

    arg_names: list[str]
    arg_values: Iterable[Any]
    name_fn: Callable[..., str] | None

    def __init__(
        self,
        arg_str: str,
        arg_values: Iterable[Any],
        name_fn: Callable[..., str] | None = None,
    ) -> None:
        self.arg_names = [name.strip() for name in arg_str.split(",") if name.strip()]
        self.arg_values = arg_values
        self.name_fn = name_fn

    def __call__(self, fn: TestFn) -> TestFn:
        earlier: ParametrizeFn | None = getattr(fn, "parametrize_fn", None)
        vars(fn)["parametrize_fn"] = (
            self.cases if earlier is None else _product(earlier, self.cases)
        )
        return fn

    def cases(self, test: TestFn, generic_cls: type, device_cls: type | None) -> Iterator[Case]:
        if not self.arg_names:
            yield Case(test, "", {}, _no_decorators)
            return
        empty = True
        for index, item in enumerate(self.arg_values):
            empty = False
            yield self._case(test, index, item)
        if empty:
            raise ValueError(f"{test}: @parametrize was given no values")

    def _case(self, test: TestFn, index: int, item: Any) -> Case:
        name: str | None = None
        decorators: list[Decorator] = []
        if isinstance(item, subtest):
            name, decorators, item = item.name, item.decorators, item.arg_values
            test = _own_function(test)  # its decorators must not reach the other cases
        values = list(item) if len(self.arg_names) > 1 else [item]
        if len(values) != len(self.arg_names):
            raise RuntimeError(
                f"Expected # values == # arg names, but got: {len(values)} values and "
                f'{len(self.arg_names)} names for test "{test.__name__}"'
            )
        if name is None:
            name = self.name_fn(*values) if self.name_fn else self._default_name(index, values)
        return Case(test, name, dict(zip(self.arg_names, values)), lambda _: decorators)

    def _default_name(self, index: int, values: Sequence[Any]) -> str:
        return "_".join(
            _value_name(index, arg, value) for arg, value in zip(self.arg_names, values)
        )


def _own_function(test: TestFn) -> TestFn:
    @functools.wraps(test)
    def case_test(*args: Any, **kwargs: Any) -> Any:
        return test(*args, **kwargs)

    return case_test


def _value_name(index: int, arg: str, value: Any) -> str:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, torch.device):
        return str(value)
    if isinstance(value, (int, float, str)):
        return f"{arg}_{str(value).replace('.', '_')}"
    return f"{arg}{index}"


def _product(earlier: ParametrizeFn, later: ParametrizeFn) -> ParametrizeFn:
    """Every case of ``earlier`` (the lower decorator) with every case of ``later``;
    ``later``'s suffix comes first."""

    def product(test: TestFn, generic_cls: type, device_cls: type | None) -> Iterator[Case]:
        for first in earlier(test, generic_cls, device_cls):
            for second in later(first.test, generic_cls, device_cls):
                both = set(first.kwargs) & set(second.kwargs)
                if both:
                    raise RuntimeError(
                        f'Test "{test.__name__}" is parametrized over {sorted(both)} twice'
                    )
                suffix = "_".join(s for s in (second.suffix, first.suffix) if s)

                def decorators(
                    kwargs: Mapping[str, Any], a: Case = first, b: Case = second
                ) -> list[Decorator]:
                    return [*a.decorator_fn(kwargs), *b.decorator_fn(kwargs)]

                yield Case(second.test, suffix, {**first.kwargs, **second.kwargs}, decorators)

    return product


def expand(test: TestFn, generic_cls: type, device_cls: type | None) -> Iterator[Case]:
    """The cases of ``test``: its ``parametrize_fn``'s, or the test itself."""
    parametrize_fn: ParametrizeFn | None = getattr(test, "parametrize_fn", None)
    if parametrize_fn is None:
        yield Case(test, "", {}, _no_decorators)
        return
    yield from parametrize_fn(test, generic_cls, device_cls)


def decorated(case: Case) -> TestFn:
    """The case's test with the case's decorators applied."""
    test = case.test
    for decorator in case.decorator_fn(case.kwargs):
        test = decorator(test)
    return test


def make_test_method(
    cls: type,
    name: str,
    test: TestFn,
    kwargs: Mapping[str, Any],
    device_argument: Callable[[Any], str] | None = None,
) -> None:
    """Adds ``cls.<name>(self)``, which calls ``test(self, **kwargs)`` (plus
    ``device=device_argument(self)`` when given). It is not a ``functools.wraps``
    wrapper: pytest would read the test's own parameters through ``__wrapped__``
    and look for fixtures of those names. pytest marks of the test carry over."""
    if name in vars(cls):
        raise AssertionError(f"Redefinition of test {name}")
    frozen = dict(kwargs)

    def method(self: Any) -> Any:
        call_kwargs = dict(frozen)
        if device_argument is not None:
            call_kwargs["device"] = device_argument(self)
        return test(self, **call_kwargs)

    method.__name__ = name
    method.__qualname__ = f"{cls.__qualname__}.{name}"
    method.__module__ = getattr(test, "__module__", cls.__module__)
    method.__doc__ = test.__doc__
    marks = getattr(test, "pytestmark", None)
    if marks:
        vars(method)["pytestmark"] = list(marks)
    setattr(cls, name, method)


def instantiate_parametrized_tests(generic_cls: type) -> type:
    """Replaces every ``@parametrize``d test of ``generic_cls`` by its cases (see
    [Note: Parametrized tests keep upstream's names]); usable as a class decorator."""
    for name, attr in list(vars(generic_cls).items()):
        if not callable(attr) or not hasattr(attr, "parametrize_fn"):
            continue
        delattr(generic_cls, name)
        for case in attr.parametrize_fn(attr, generic_cls, None):
            make_test_method(generic_cls, f"{name}_{case.suffix}", decorated(case), case.kwargs)
    return generic_cls


def skip_but_pass_in_sandcastle_if(condition: bool, reason: str) -> Decorator:
    """``unittest.skipIf`` (upstream reports such skips as passes only inside Meta's CI)."""
    return unittest.skipIf(condition, reason)


class TestCase(Assertions, unittest.TestCase):
    """Upstream's ``TestCase`` for single-process tests: ``unittest.TestCase`` with the
    harness's tensor-aware ``assertEqual`` (``harness.assertions``). It runs in the
    pytest process, not in ranks."""


def run_tests(argv: Sequence[str] | None = None) -> None:
    """Runs the file executed as ``__main__`` under pytest (upstream's files end with
    ``if __name__ == "__main__": run_tests()``); ``argv[1:]`` (default: the command
    line's) are pytest arguments. Under pytest the file is imported, so this never runs."""
    main_file = getattr(sys.modules["__main__"], "__file__", None)
    if main_file is None:
        raise RuntimeError("run_tests() runs the test file that Python executes as __main__")
    args = list(sys.argv if argv is None else argv)[1:]
    raise SystemExit(pytest.main([main_file, *args]))
