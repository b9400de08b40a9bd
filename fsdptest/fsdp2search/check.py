"""Two observations of one FSDP2 program compared, on the ranks (rank side).

[Note: How FSDP2 runs are compared]
Conformance (``conform``): the implementation under test and the reference
implementation run the program on the same ranks, on one mesh, each on its own
model built from the program's seed; their runs (``fsdptest.fsdp2search.run``)
must be the same observations in the same order. Tensors are compared with
``torch.testing.assert_close`` 's defaults for their dtype (which also asks for
the same dtype and shape), everything else exactly: the same collectives (seam,
dtype, element count, group size, in order), the same state-dict entries and
the same error (type and first line of the message).

Parity (``match_replica``): the implementation's run must show the replicated
reference's numbers (``fsdptest.fsdp2search.replica``): every loss, every
local shard of a parameter and its gradient, every total norm, at the call the
reference saw it, unless the run's parameter was registered unsharded (or
on the post-forward mesh) then
(its values are those of its last all-gather, which a step since does not
change; conformance compares them). The run may not end in an error (the parity search draws only
valid programs). Tolerances follow the program's lowest precision: fp32 sums
in another order (``PARITY_TOL``); a bf16 or fp16 forward or reduction rounds
where the reference may not (``LOW_PRECISION_TOL``, with an absolute part of a
few ulps of the values' scale).
"""

from __future__ import annotations

from typing import Any

import torch

from fsdptest.fsdp2search.program import MIXED_PRECISION, Program
from fsdptest.fsdp2search.replica import Replica
from fsdptest.fsdp2search.run import (
    Fsdp2Runtime,
    Observation,
    ProgramRun,
    describe_op,
    dtype_of,
    mesh_of,
)

PARITY_TOL = {"rtol": 1e-5, "atol": 1e-5}
LOW_PRECISION_TOL = {
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 2e-3, "ulps": 4.0},
    torch.float16: {"rtol": 2e-3, "atol": 5e-4, "ulps": 4.0},
}
"""``ulps``: the absolute part grows to that many ulps of the dtype at the largest
magnitude of the expected tensor (a sum rounded in two stages, HSDP's reduce-scatter
then all-reduce, or terms that cancel, is off by ulps of its terms, not of the sum)."""
SHOWN = 8


TORCH_DEFECTS: dict[str, str] = {
    # name: the start of the error torch's fully_shard raises where it should not
    "SPLIT_SIZES_AFTER_POST_FORWARD_UNSHARD": (
        "RuntimeError: split_with_sizes expects split_sizes to sum exactly"
    ),
}
"""[Note: Where torch's FSDP2 fails and the implementation under test does not]
A program on which the reference raises one of these errors, at a call that the
implementation under test runs without error, is not a difference: the runs are
compared up to that call. Each entry is a defect of torch's ``fully_shard``,
asserted by ``suites/fsdp2/test_fsdp2_search.py::test_torch_defects_still_fail``
on the shortest program that showed it (when torch stops failing there, that
test fails and the entry goes). ``SPLIT_SIZES_AFTER_POST_FORWARD_UNSHARD``: at
world size 4, groups that reshard to 2-way meshes after forward, CPU offload and
a ``reduce_dtype`` of bf16: a no-sync backward, then ``unshard(async_op=True)`` of
the root and a forward, fail in torch's all-gather copy-out."""


STALE_AFTER_LOAD = "STALE_ALL_GATHER_AFTER_LOAD"
"""A defect of torch's ``fully_shard`` that shows in values, not in an error:
after a backward that was not the last (``set_is_last_backward(False)``), the
all-gather its backward prefetched for a frozen module (whose backward never
runs) stays pending through a state-dict load (``load_state_dict``, a DCP
round trip), and torch's next forward copies it out: it computes with the
parameters from before the load ([Note: A pending all-gather outlives a
reshard] in fsdp._fully_shard._lifecycle). A program that loads after such a
backward is compared up to the load, when the runs differ after it; asserted by
``test_torch_defects_still_fail`` (torch's values differ from the replicated
reference's)."""

LOADS = ("load_state_dict", "dcp_round_trip")


def load_after_non_last_backward(program: Program) -> int | None:
    """The first load of a frozen program made after a backward that was not the
    last (and no last one since); None when there is none."""
    if not program.frozen:
        return None
    not_last = False
    for index, op in enumerate(program.ops):
        if op.name == "train" and op.args[1] is not None:
            not_last = op.args[1] is False
        elif op.name in LOADS and not_last:
            return index
    return None


def conform(program: Program, impl: str, reference: str, device: torch.device) -> None:
    """Raises ``AssertionError`` naming where ``impl`` 's run differs from ``reference`` 's."""
    mesh = mesh_of(program, device.type)
    ours = ProgramRun(program, Fsdp2Runtime(impl), mesh, device).run()
    theirs = ProgramRun(program, Fsdp2Runtime(reference), mesh, device).run()
    defect = torch_defect(theirs, ours)
    if defect is not None:
        stop = next(o.op for o in theirs if o.key == "error")
        print(f"fsdp2 allowed: {defect} at {describe_op(program, stop)}")
        theirs, ours = _before(theirs, stop), _before(ours, stop)
    differences = in_order(program, theirs, ours)
    load = load_after_non_last_backward(program) if differences else None
    if load is not None and not in_order(
        program, _before(theirs, load + 1), _before(ours, load + 1)
    ):
        print(f"fsdp2 allowed: {STALE_AFTER_LOAD} after {describe_op(program, load)}")
        return
    if differences:
        raise AssertionError(report(f"{impl} differs from {reference}", differences))


def torch_defect(theirs: list[Observation], ours: list[Observation]) -> str | None:
    """The ``TORCH_DEFECTS`` entry the reference's error is, where this run did not
    fail at that call (see the note)."""
    error = next((o for o in theirs if o.key == "error"), None)
    if error is None or any(o.key == "error" and o.op <= error.op for o in ours):
        return None
    return next((n for n, text in TORCH_DEFECTS.items() if str(error.value).startswith(text)), None)


def _before(run: list[Observation], op: int) -> list[Observation]:
    return [o for o in run if o.op < op]


def match_replica(program: Program, impl: str, device: torch.device) -> None:
    """Raises ``AssertionError`` naming where ``impl`` 's numbers differ from the
    replicated reference's."""
    mesh = mesh_of(program, device.type)
    run = ProgramRun(program, Fsdp2Runtime(impl), mesh, device).run()
    expected = Replica(program, device).run()
    differences = [
        f"{describe_op(program, o.op)}: raised {o.value}" for o in run if o.key == "error"
    ]
    differences += by_key(program, expected, run, parity_tolerance(program))
    if differences:
        raise AssertionError(report(f"{impl} differs from the replicated reference", differences))


def parity_tolerance(program: Program) -> dict[str, Any]:
    param, reduce, _, _ = MIXED_PRECISION[program.mixed_precision]
    lowest = [d for d in (dtype_of(param), dtype_of(reduce)) if d in LOW_PRECISION_TOL]
    if not lowest:
        return PARITY_TOL
    return {**LOW_PRECISION_TOL[lowest[0]], "dtype": lowest[0]}


def in_order(program: Program, expected: list[Observation], actual: list[Observation]) -> list[str]:
    found = []
    for want, got in zip(expected, actual, strict=False):
        where = describe_op(program, want.op)
        if (want.op, want.key) != (got.op, got.key):
            found.append(
                f"{where}: the reference observed {want.key!r} next, this run "
                f"{got.key!r} at {describe_op(program, got.op)} ({_short(got.value)})"
                + _ends(expected, "the reference")
                + _ends(actual, "this run")
            )
            return found
        difference = differ(want.value, got.value, None)
        if difference:
            found.append(f"{where}, {want.key}: {difference}")
    if len(expected) != len(actual):
        longer, what = (
            (expected, "the reference") if len(expected) > len(actual) else (actual, "this run")
        )
        extra = longer[min(len(expected), len(actual))]
        found.append(
            f"{what} went on: {describe_op(program, extra.op)}, {extra.key} = {_short(extra.value)}"
        )
    return found


def _ends(run: list[Observation], who: str) -> str:
    """How ``run`` ended, when an error ended it."""
    errors = [o for o in run if o.key == "error"]
    return f"; {who} ended with {errors[0].value}" if errors else ""


def by_key(
    program: Program,
    expected: list[Observation],
    actual: list[Observation],
    tolerance: dict[str, Any],
) -> list[str]:
    seen = {(o.op, o.key): o.value for o in actual}
    found = []
    for want in expected:
        where = f"{describe_op(program, want.op)}, {want.key}"
        name = want.key.partition(":")[2]
        if any((want.op, f"{kind}:{name}") in seen for kind in ("unsharded", "post_forward")):
            continue  # not this rank's shard of the mesh (see the module note)
        if (want.op, want.key) not in seen:
            found.append(f"{where}: not observed (the run ended before it)")
            break
        difference = differ(want.value, seen[want.op, want.key], tolerance)
        if difference:
            found.append(f"{where}: {difference}")
    return found


def differ(want: Any, got: Any, tolerance: dict[str, Any] | None) -> str:
    """How ``got`` differs from ``want`` ("" when it does not)."""
    if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor):
        try:
            if tolerance is None:
                torch.testing.assert_close(got, want, equal_nan=True)
            else:
                torch.testing.assert_close(
                    got.float(),
                    want.float(),
                    equal_nan=True,
                    check_dtype=False,
                    **_scaled(tolerance, want),
                )
        except AssertionError as error:
            return " ".join(str(error).split())[:400]
        return ""
    if type(want) is not type(got) or want != got:
        return f"expected {_short(want)}, got {_short(got)}"
    return ""


def _scaled(tolerance: dict[str, Any], want: torch.Tensor) -> dict[str, float]:
    """``rtol`` and ``atol``, the latter at least ``ulps`` ulps of the low-precision
    dtype at ``want`` 's largest magnitude (see ``LOW_PRECISION_TOL``)."""
    ulps = tolerance.get("ulps", 0.0)
    dtype = tolerance.get("dtype")
    atol = tolerance["atol"]
    if ulps and want.numel():
        eps = torch.finfo(dtype if isinstance(dtype, torch.dtype) else torch.bfloat16).eps
        atol = max(atol, ulps * eps * float(want.float().abs().max()))
    return {"rtol": tolerance["rtol"], "atol": atol}


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)} {value.dtype}"
    return repr(value)[:300]


def report(title: str, differences: list[str]) -> str:
    more = len(differences) - SHOWN
    lines = [f"{title}: {len(differences)} difference(s)", *differences[:SHOWN]]
    return "\n  ".join([*lines, *([f"... and {more} more"] if more > 0 else [])])
