"""In-process tests of the harness's pure pieces: assertions, ids, subtest
selection, device placement."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import time
from collections.abc import Iterator

import pytest
import torch

from harness._controller import dispatch as _dispatch
from harness._controller.devices import DevicePlan
from harness._protocol import RunTest
from harness._types import Attempt, Placement, PoolKey
from harness.assertions import Assertions, assert_equal
from harness.parametrize import parametrize, subtest_name, value_id
from harness.subtests import combinations, matches, parse_filter, render_config


class Mode(enum.Enum):
    BEFORE = 1
    AFTER = 2


def test_assert_equal_follows_assert_close_for_tensors():
    assert_equal(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0 + 1e-7]))
    with pytest.raises(AssertionError, match="Tensors are not equal"):
        assert_equal(torch.tensor([1.0]), torch.tensor([1.1]))
    with pytest.raises(AssertionError, match="dtype"):
        assert_equal(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))
    assert_equal(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64), exact_dtype=False)


def test_assert_equal_compares_sequences_elementwise():
    assert_equal((7, 3), [7, 3])
    assert_equal(torch.Size([5, 7]), (5, 7))
    assert_equal([torch.ones(2), (1, 2)], (torch.ones(2), [1, 2]))
    with pytest.raises(AssertionError, match=r"at \[1\]"):
        assert_equal([1, 2], [1, 3])
    with pytest.raises(AssertionError, match="different lengths"):
        assert_equal([1], [1, 2])


def test_assert_not_equal_and_messages():
    checks = Assertions()
    checks.assertNotEqual(torch.ones(2), torch.zeros(2))
    with pytest.raises(AssertionError, match="extra context"):
        checks.assertNotEqual(torch.ones(2), torch.ones(2), msg="extra context")
    with pytest.raises(AssertionError, match="why it matters"):
        checks.assertEqual(1, 2, msg="why it matters")
    checks.assertEqual(torch.float16, torch.float16)
    with checks.assertRaisesRegex(ValueError, "bad"):
        raise ValueError("bad input")
    with checks.assertWarnsRegex(UserWarning, "careful"):
        import warnings

        warnings.warn("careful now", stacklevel=1)


def test_seed_style_ids():
    mapping = {"a": "x", "b": "y"}
    assert subtest_name(mapping, "a", None, "b") == "x-none-y"
    assert value_id(torch.float32) == "float32"
    assert value_id(Mode.AFTER) == "AFTER"
    mark = parametrize("m,flag", [(Mode.BEFORE, True), (Mode.AFTER, False)])
    assert mark.kwargs["ids"] == ["BEFORE-True", "AFTER-False"]
    mark = parametrize("a,b", [("a", "b")], lambda *v: subtest_name(mapping, *v))
    assert mark.kwargs["ids"] == ["x-y"]
    assert mark.args[0] == ["a", "b"]
    single = parametrize("nested", [True, False])
    assert single.args == ("nested", [True, False])
    assert single.kwargs["ids"] == ["True", "False"]


def test_subtest_rendering_round_trips_through_the_filter():
    config = {"mode": [Mode.BEFORE, Mode.AFTER], "n": [1, 2], "cls": [torch.optim.Adam, None]}
    combos = list(combinations(config))
    assert len(combos) == 8 and [c.index for c in combos] == list(range(8))
    rendered = combos[5].render()
    assert rendered == "mode=AFTER, n=1, cls=None"
    wanted = parse_filter(rendered)
    selected = [c for c in combos if matches(c.kwargs, wanted)]
    assert selected == [combos[5]]
    assert render_config({"cls": torch.optim.Adam}) == "cls=Adam"
    assert matches({"mode": Mode.AFTER}, parse_filter("mode=Mode.AFTER"))
    assert not matches({"mode": Mode.AFTER}, parse_filter("other=1"))
    with pytest.raises(pytest.UsageError, match="key=value pairs.*'justakey'"):
        parse_filter("justakey")
    with pytest.raises(pytest.UsageError, match="'=1'"):
        parse_filter("a=2, =1")


class _Opaque:
    """Its repr carries a memory address, different in every process."""


def _scale(x: float, factor: float = 1.0) -> float:
    return x * factor


@dataclasses.dataclass(frozen=True)
class _MixedLike:
    """A config object whose repr has commas (like ``MixedPrecision(...)``)."""

    bits: int
    other: int | None


def test_filter_parses_nested_commas_and_ignores_addresses():
    """A report's configuration, pasted back into --subtest, selects exactly it:
    also reprs with commas, partials, and objects printed with a memory address."""
    opaque = _Opaque()
    config = {
        "mp": [_MixedLike(16, None), _MixedLike(32, 64)],
        "fn": [functools.partial(_scale, factor=2.0), _scale],
        "obj": [opaque],
    }
    combos = list(combinations(config))
    rendered = combos[1].render()
    assert (
        rendered
        == "mp=_MixedLike(bits=16, other=None), fn=_scale, obj=<tests.harness.test_harness_units._Opaque object>"
    )
    assert "0x" not in rendered
    for combo in combos:
        wanted = parse_filter(combo.render())
        assert [c for c in combos if matches(c.kwargs, wanted)] == [combo], combo.render()
    assert (
        combos[0]
        .render()
        .startswith("mp=_MixedLike(bits=16, other=None), fn=partial(_scale, factor=2.0)")
    )
    assert parse_filter('k="a,b", j=(1, 2)') == (("k", '"a,b"'), ("j", "(1, 2)"))


def test_placement_under_each_device_option():
    two = DevicePlan("auto", ("2", "3"))
    assert two.placement(2) == ("cuda", "nccl", None, 2, "")  # GPUs leased per test
    assert two.placement(1) == ("cuda", "nccl", None, 1, "")
    fallback = two.placement(4)
    assert fallback == ("cpu", "gloo", "", 0, "needs 4 GPUs, 2 visible")
    strict = DevicePlan("cuda", ("2",))
    assert strict.placement(2) == "needs 2 GPUs but only 1 GPUs are visible [2]"
    assert strict.placement(1) == ("cuda", "nccl", None, 1, "")
    assert DevicePlan("cpu", ()).placement(2) == ("cpu", "gloo", "", 0, "")
    assert DevicePlan("auto", ()).placement(2) == ("cpu", "gloo", "", 0, "")  # no GPU: no fallback
    fake = DevicePlan("auto", ("a", "b"), fake=True)
    assert fake.placement(2) == ("cpu", "gloo", "", 2, "")  # leased, computed on CPU
    assert fake.placement(3).fallback == "needs 3 GPUs, 2 visible"
    strict_fake = DevicePlan("cuda", ("a", "b"), fake=True)
    assert strict_fake.placement(3) == "needs 3 GPUs but only 2 fake GPUs are visible [a, b]"


class _SlowStartManager:
    """Stands in for the pool manager: every pool takes ``start_s`` to start,
    and the deadline each attempt is given is recorded as time left."""

    def __init__(self, start_s: float, restarts: int = 0) -> None:
        self.start_s = start_s
        self.restarts = restarts
        self.tests_run = 0
        self.time_left: list[float] = []

    def acquire(self, request: _dispatch.TestRequest) -> _SlowStartManager:
        time.sleep(self.start_s)
        return self

    def release(self, pool: object, request: _dispatch.TestRequest) -> None:
        pass

    @contextlib.contextmanager
    def leased(self, request: _dispatch.TestRequest) -> Iterator[_dispatch.TestRequest]:
        yield request

    def execute(self, message: RunTest, deadline: float, grace_s: float) -> Attempt:
        self.time_left.append(deadline - time.monotonic())
        restart = 0 if len(self.time_left) <= self.restarts else None
        return Attempt(ranks={}, restart_after=restart)


def _request(timeout_s: float, wall_limit_s: float | None) -> _dispatch.TestRequest:
    message = RunTest("t", "m", "m.py", "C", "test", {}, 0, (), False, (), -1)
    return _dispatch.TestRequest(
        key=PoolKey(2, "cpu"),
        placement=Placement("cpu", "gloo", None),
        message=message,
        fresh_pool=False,
        timeout_s=timeout_s,
        grace_s=1.0,
        wall_limit_s=wall_limit_s,
    )


def test_pool_start_does_not_count_against_the_test_deadline():
    manager = _SlowStartManager(start_s=0.4, restarts=1)
    _dispatch.run(manager, _request(timeout_s=1.0, wall_limit_s=None))  # type: ignore[arg-type]
    first, resumed = manager.time_left
    assert first > 0.9  # the 0.4 s start is not taken from the test's 1 s
    assert 0.8 < resumed <= first  # a resumed attempt gets what the first left


def test_pytest_timeout_limit_runs_from_the_pool_ready():
    # pytest-timeout's timer starts when the pool is ready, so the pool's
    # 0.4 s start is not taken from its 1 s either.
    manager = _SlowStartManager(start_s=0.4)
    request = _request(timeout_s=10.0, wall_limit_s=1.0)
    _dispatch.run(manager, request)  # type: ignore[arg-type]
    assert 0.9 < manager.time_left[0] <= 1.0
    assert request.info().timeout_s == 1.0
