"""Comparing two implementations' traces of one scenario (rank side).

[Note: Conformance tolerances]
Integers, booleans, strings, dtypes, shapes, devices, kinds, keys, the order
of keys, collectives, warnings and exceptions compare exactly. Floating-point
values (tensors' values, losses, norms) compare with a tolerance, because two
correct implementations need not compute them in the same order: a
reduce-scatter of a padded flat gradient and an all-reduce, a pre- and
post-divide split of the world size, gloo's list and single-tensor forms of a
collective sum three or more addends in different orders, and a flat
parameter's views start at different alignments (CPU kernels may round
differently: the property search saw losses one ulp apart under either
implementation). Those are a few ulps per step; SGD with momentum (and Adam
with a large epsilon, see ``fsdptest.conformance.execute``) carries them over
the few steps of a program without growing them by more than its learning
rate's scale. So full precision compares with ``rtol=1e-5, atol=1e-6`` (ten
times fp32's ulp: a wrong factor, a dropped microbatch or a missing reduction
is off by orders of magnitude more). Where the scenario computes in a low
precision (any ``MixedPrecision`` dtype), a rounding of an operand in that
dtype is relative to the operand, so values compare to
``LOW_PRECISION_ULPS`` machine epsilons of the least precise dtype in use,
relative and absolute (as the property search; 0.125 for bf16), and a tensor's
absolute tolerance scales with its largest magnitude: its elements are sums
of operands about that large (a tied parameter's two gradients, a scaled
loss's), and a sum that cancels keeps their rounding, not its own (the eighth
deep run: a tied bf16 gradient of 2 against 4 beside elements of 96).
Low-precision scenarios find what breaks (dtypes, devices, errors, gross
values), full precision ones find the arithmetic.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fsdptest.conformance.execute import Trace
from fsdptest.conformance.implementation import low_dtypes
from fsdptest.conformance.observe import Number, TensorView, Tolerance, first_difference
from fsdptest.conformance.scenario import Scenario

FP32_RTOL, FP32_ATOL = 1e-5, 1e-6
LOW_PRECISION_ULPS = 16
_MISSING = "<not observed>"


def tolerance(scenario: Scenario) -> Tolerance:
    """See [Note: Conformance tolerances]."""
    dtypes = low_dtypes(scenario.setup.mixed_precision)
    if not dtypes:
        return Tolerance(FP32_RTOL, FP32_ATOL)
    ulps = LOW_PRECISION_ULPS * max(torch.finfo(d).eps for d in dtypes)
    return Tolerance(ulps, ulps, scaled=True)


class Difference(NamedTuple):
    """The first place where two observations of one op differ."""

    index: int  # the op's index, -1 for the construction
    op: str
    path: str  # the observation's key, then where inside it
    ours: Any  # the values there
    reference: Any
    whole: tuple[Any, Any] | None = None  # the whole observations, when the path is inside

    def describe(self) -> str:
        where = "construction" if self.index < 0 else f"op {self.index} ({self.op})"
        text = (
            f"{where}, {self.path}:\n"
            f"    under test: {render(self.ours)}\n"
            f"    reference:  {render(self.reference)}"
        )
        apart = _elements_apart(self.ours, self.reference)
        if apart:
            text += f"\n    {apart}"
        if self.whole is not None:
            ours, reference = (_clipped(render(v)) for v in self.whole)
            text += f"\n  in the whole observation:\n    under test: {ours}\n    reference:  {reference}"
        return text


def differences(ours: Trace, reference: Trace, tol: Tolerance) -> list[Difference]:
    """Every observation that differs, in the order the ops ran, one per observation
    key (the first place inside it)."""
    found: list[Difference] = []
    for mine, theirs in zip(ours.records, reference.records):
        for key in _keys(mine.observed, theirs.observed):
            a = mine.observed.get(key, _MISSING)
            b = theirs.observed.get(key, _MISSING)
            place = first_difference(a, b, tol, key)
            if place is not None:
                path, x, y = place
                whole = None if path == key else (a, b)
                found.append(Difference(mine.index, mine.op, path, x, y, whole))
    if len(ours.records) != len(reference.records):
        last = min(len(ours.records), len(reference.records))
        records = ours.records if len(ours.records) > last else reference.records
        extra = records[last]
        found.append(Difference(extra.index, extra.op, "the run", ours.ended, reference.ended))
    return found


def _keys(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return list(a) + [k for k in b if k not in a]


def render(value: Any, limit: int = 6) -> str:
    """A short text of an observation."""
    if isinstance(value, TensorView):
        text = f"{value.kind}({value.dtype}, shape={list(value.shape)}, {value.device}"
        text += ", requires_grad" if value.requires_grad else ""
        if isinstance(value.values, torch.Tensor):
            flat = value.values.flatten().tolist()
            shown = ", ".join(_number_text(v) for v in flat[:limit])
            text += f", values=[{shown}{', ...' if len(flat) > limit else ''}]"
        elif value.values is not None:
            text += f", {value.values}"
        if value.layout:
            text += f", layout={value.layout}"
        if value.local:
            text += f", local=[{', '.join(render(v) for v in value.local)}]"
        return text + ")"
    if isinstance(value, Number):
        return _number_text(value.value)
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "dict":
        items = ", ".join(f"{render(k)}: {render(v)}" for k, v in value[1][:limit])
        more = f", ... ({len(value[1])} items)" if len(value[1]) > limit else ""
        return "{" + items + more + "}"
    if isinstance(value, tuple):
        return (
            "("
            + ", ".join(render(v) for v in value[: limit * 2])
            + (", ..." if len(value) > limit * 2 else "")
            + ")"
        )
    if isinstance(value, list):
        return (
            "["
            + ", ".join(render(v) for v in value[:limit])
            + (", ..." if len(value) > limit else "")
            + "]"
        )
    return repr(value)


def _elements_apart(ours: Any, reference: Any, limit: int = 4) -> str:
    """Where two tensors of one shape differ (``render`` shows their first values
    only): the first differing flat indices with both values, and how many."""
    views = (ours, reference)
    if not all(isinstance(v, TensorView) and isinstance(v.values, torch.Tensor) for v in views):
        return ""
    a, b = (v.values.flatten().double() for v in views)
    if a.shape != b.shape:
        return ""
    apart = torch.nonzero((a != b) & ~(a.isnan() & b.isnan())).flatten().tolist()
    if not apart:
        return ""
    shown = ", ".join(
        f"[{i}] {_number_text(a[i].item())} vs {_number_text(b[i].item())}" for i in apart[:limit]
    )
    return f"elements apart ({len(apart)} of {a.numel()}; under test vs reference): {shown}"


def _clipped(text: str, limit: int = 1200) -> str:
    return text if len(text) <= limit else text[:limit] + " ..."


def _number_text(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else repr(value)
