"""unittest-style assertions that understand tensors, so seed tests port line for line.

``assertEqual`` follows ``torch.testing.assert_close`` for tensors (dtype-based
default tolerances, dtype checked, device not checked unless asked) and compares
sequences and mappings element by element, so a tuple equals a list with the
same elements and a ``torch.Size`` equals a tuple.
"""

from __future__ import annotations

import math
import unittest
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from harness.expect import assert_expected_inline

_CASE = unittest.TestCase()
_CASE.maxDiff = None


def _is_sequence(x: object) -> bool:
    return isinstance(x, Sequence) and not isinstance(x, (str, bytes, bytearray))


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float, complex)) and not isinstance(x, bool)


def _fail(message: str, msg: str | None) -> None:
    raise AssertionError(f"{message}\n{msg}" if msg else message)


def _tensor_pair(actual: object, expected: object) -> tuple[torch.Tensor, torch.Tensor] | None:
    if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor):
        return actual, expected
    if isinstance(actual, torch.Tensor) and _is_number(expected):
        return actual, torch.full_like(actual, expected)  # type: ignore[arg-type]
    if isinstance(expected, torch.Tensor) and _is_number(actual):
        return torch.full_like(expected, actual), expected  # type: ignore[arg-type]
    return None


@dataclass(frozen=True)
class _Tolerance:
    """How ``assert_equal`` compares leaves (its keyword arguments)."""

    rtol: float | None
    atol: float | None
    exact_dtype: bool
    exact_device: bool


def assert_equal(
    actual: object,
    expected: object,
    msg: str | None = None,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    exact_dtype: bool = True,
    exact_device: bool = False,
    path: str = "",
) -> None:
    _compare(actual, expected, msg, _Tolerance(rtol, atol, exact_dtype, exact_device), path)


def _compare(actual: object, expected: object, msg: str | None, tol: _Tolerance, path: str) -> None:
    where = f" at {path}" if path else ""
    pair = _tensor_pair(actual, expected)
    if pair is not None:
        _compare_tensors(pair, msg, tol, where)
    elif isinstance(actual, Mapping) and isinstance(expected, Mapping):
        _compare_mappings(actual, expected, msg, tol, path)
    elif _is_sequence(actual) and _is_sequence(expected):
        _compare_sequences(list(actual), list(expected), msg, tol, path)  # type: ignore[call-overload]
    elif _is_float_pair(actual, expected):
        tol_r = 1.3e-6 if tol.rtol is None else tol.rtol
        tol_a = 1e-5 if tol.atol is None else tol.atol
        if not math.isclose(actual, expected, rel_tol=tol_r, abs_tol=tol_a):  # type: ignore[arg-type]
            _fail(f"Numbers are not close{where}: {actual!r} vs {expected!r}", msg)
    elif actual != expected:
        _fail(f"Values are not equal{where}: {actual!r} != {expected!r}", msg)


def _compare_tensors(
    pair: tuple[torch.Tensor, torch.Tensor], msg: str | None, tol: _Tolerance, where: str
) -> None:
    try:
        torch.testing.assert_close(
            pair[0],
            pair[1],
            rtol=tol.rtol,
            atol=tol.atol,
            equal_nan=True,
            check_dtype=tol.exact_dtype,
            check_device=tol.exact_device,
        )
        return
    except AssertionError as exc:
        problem = str(exc)
    _fail(f"Tensors are not equal{where}: {problem}", msg)


def _compare_mappings(
    actual: Mapping[Any, Any],
    expected: Mapping[Any, Any],
    msg: str | None,
    tol: _Tolerance,
    path: str,
) -> None:
    if set(actual) != set(expected):
        where = f" at {path}" if path else ""
        _fail(
            f"Mappings have different keys{where}: {sorted(map(str, actual))} vs "
            f"{sorted(map(str, expected))}",
            msg,
        )
    for key in actual:
        _compare(actual[key], expected[key], msg, tol, f"{path}[{key!r}]")


def _compare_sequences(
    actual: list[Any], expected: list[Any], msg: str | None, tol: _Tolerance, path: str
) -> None:
    if len(actual) != len(expected):
        where = f" at {path}" if path else ""
        _fail(f"Sequences have different lengths{where}: {len(actual)} vs {len(expected)}", msg)
    for i, (x, y) in enumerate(zip(actual, expected)):
        _compare(x, y, msg, tol, f"{path}[{i}]")


def _is_float_pair(actual: object, expected: object) -> bool:
    """Two numbers of which at least one is a float (compared with a tolerance)."""
    numbers = _is_number(actual) and _is_number(expected)
    return numbers and (isinstance(actual, float) or isinstance(expected, float))


class Assertions:
    """The assertion helpers of ``unittest.TestCase`` that the seed tests call."""

    def assertEqual(
        self, actual: object, expected: object, msg: str | None = None, **kwargs: Any
    ) -> None:
        assert_equal(actual, expected, msg, **kwargs)

    def assertNotEqual(
        self, actual: object, expected: object, msg: str | None = None, **kwargs: Any
    ) -> None:
        try:
            assert_equal(actual, expected, **kwargs)
        except AssertionError:
            return
        _fail(f"Values are equal: {actual!r}", msg)

    def assertTrue(self, expr: object, msg: str | None = None) -> None:
        _CASE.assertTrue(expr, msg)

    def assertFalse(self, expr: object, msg: str | None = None) -> None:
        _CASE.assertFalse(expr, msg)

    def assertIsNone(self, obj: object, msg: str | None = None) -> None:
        _CASE.assertIsNone(obj, msg)

    def assertIsNotNone(self, obj: object, msg: str | None = None) -> None:
        _CASE.assertIsNotNone(obj, msg)

    def assertIs(self, a: object, b: object, msg: str | None = None) -> None:
        _CASE.assertIs(a, b, msg)

    def assertIsNot(self, a: object, b: object, msg: str | None = None) -> None:
        _CASE.assertIsNot(a, b, msg)

    def assertIsInstance(
        self, obj: object, cls: type | tuple[type, ...], msg: str | None = None
    ) -> None:
        _CASE.assertIsInstance(obj, cls, msg)

    def assertIn(self, member: object, container: Any, msg: str | None = None) -> None:
        _CASE.assertIn(member, container, msg)

    def assertNotIn(self, member: object, container: Any, msg: str | None = None) -> None:
        _CASE.assertNotIn(member, container, msg)

    def assertGreater(self, a: Any, b: Any, msg: str | None = None) -> None:
        _CASE.assertGreater(a, b, msg)

    def assertGreaterEqual(self, a: Any, b: Any, msg: str | None = None) -> None:
        _CASE.assertGreaterEqual(a, b, msg)

    def assertLess(self, a: Any, b: Any, msg: str | None = None) -> None:
        _CASE.assertLess(a, b, msg)

    def assertLessEqual(self, a: Any, b: Any, msg: str | None = None) -> None:
        _CASE.assertLessEqual(a, b, msg)

    def assertRaises(self, exc: type[BaseException], *args: Any, **kwargs: Any) -> Any:
        return _CASE.assertRaises(exc, *args, **kwargs)

    def assertRaisesRegex(
        self, exc: type[BaseException], regex: str, *args: Any, **kwargs: Any
    ) -> Any:
        return _CASE.assertRaisesRegex(exc, regex, *args, **kwargs)

    def assertWarns(self, warning: type[Warning], *args: Any, **kwargs: Any) -> Any:
        return _CASE.assertWarns(warning, *args, **kwargs)

    def assertWarnsRegex(
        self,
        expected_warning: type[Warning],
        expected_regex: str,
        *args: Any,
        **kwargs: Any,
    ) -> AbstractContextManager[Any]:
        return _CASE.assertWarnsRegex(expected_warning, expected_regex, *args, **kwargs)

    def assertExpectedInline(self, actual: str, expect: str, skip: int = 0) -> None:
        """expecttest's: ``expect`` is the caller's string literal, rewritten under
        ``EXPECTTEST_ACCEPT=1`` (by rank 0; see ``harness.expect``)."""
        assert_expected_inline(actual, expect, skip=skip + 1)

    def fail(self, msg: str | None = None) -> None:
        _CASE.fail(msg)

    def skipTest(self, reason: str) -> None:
        raise unittest.SkipTest(reason)
