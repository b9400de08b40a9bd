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
    where = f" at {path}" if path else ""
    pair = _tensor_pair(actual, expected)
    if pair is not None:
        try:
            torch.testing.assert_close(
                pair[0],
                pair[1],
                rtol=rtol,
                atol=atol,
                equal_nan=True,
                check_dtype=exact_dtype,
                check_device=exact_device,
            )
            return
        except AssertionError as exc:
            problem = str(exc)
        _fail(f"Tensors are not equal{where}: {problem}", msg)
        return
    if isinstance(actual, Mapping) and isinstance(expected, Mapping):
        if set(actual) != set(expected):
            _fail(
                f"Mappings have different keys{where}: {sorted(map(str, actual))} vs "
                f"{sorted(map(str, expected))}",
                msg,
            )
        for key in actual:
            assert_equal(
                actual[key],
                expected[key],
                msg,
                rtol=rtol,
                atol=atol,
                exact_dtype=exact_dtype,
                exact_device=exact_device,
                path=f"{path}[{key!r}]",
            )
        return
    if _is_sequence(actual) and _is_sequence(expected):
        a, e = list(actual), list(expected)  # type: ignore[call-overload]
        if len(a) != len(e):
            _fail(f"Sequences have different lengths{where}: {len(a)} vs {len(e)}", msg)
        for i, (x, y) in enumerate(zip(a, e)):
            assert_equal(
                x,
                y,
                msg,
                rtol=rtol,
                atol=atol,
                exact_dtype=exact_dtype,
                exact_device=exact_device,
                path=f"{path}[{i}]",
            )
        return
    if (
        _is_number(actual)
        and _is_number(expected)
        and (isinstance(actual, float) or isinstance(expected, float))
    ):
        tol_r = 1.3e-6 if rtol is None else rtol
        tol_a = 1e-5 if atol is None else atol
        if not math.isclose(actual, expected, rel_tol=tol_r, abs_tol=tol_a):  # type: ignore[arg-type]
            _fail(f"Numbers are not close{where}: {actual!r} vs {expected!r}", msg)
        return
    if actual != expected:
        _fail(f"Values are not equal{where}: {actual!r} != {expected!r}", msg)


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
