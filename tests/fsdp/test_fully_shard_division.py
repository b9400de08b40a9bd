"""How ``fully_shard``'s gradient reduction divides (``Division.of`` in
fsdp._fully_shard._collectives), on every path, the accelerator's included, which
a CPU rank never takes: the ops are torch's (``_get_gradient_divide_factors``) and
are accepted by a collective of the fake process group (see
tests/fsdp/conftest.py), and the reduction they describe, applied by hand to each
rank's gradient as NCCL applies it, gives the sum over ranks divided by the
factor."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

from fsdp import _comm
from fsdp._fully_shard._collectives import Division
from tests.fsdp.conftest import WORLD_SIZE

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FACTORS = (None, 1.0, float(WORLD_SIZE), 8.0)


def _state(op: object) -> tuple[object, float | None]:
    """A reduce op as (kind, ``PREMUL_SUM`` factor), whichever way it was spelt."""
    if isinstance(op, dist.ReduceOp.RedOpType):  # also an instance of ReduceOp
        op = dist.ReduceOp(op)
    state = op.__getstate__()  # (kind, factor): how a ReduceOp pickles
    assert isinstance(state, tuple)
    return state[0], state[1]


def _reduced(op: object, tensors: list[Tensor]) -> Tensor:
    """What a reduction with ``op`` over the ranks' tensors gives: ``PREMUL_SUM``
    scales each input by its factor, cast to the tensors' dtype, then sums."""
    kind, factor = _state(op)
    if kind == dist.ReduceOp.PREMUL_SUM:
        assert factor is not None
        tensors = [t * torch.tensor(factor, dtype=t.dtype) for t in tensors]
    total = torch.stack(tensors).sum(0)
    return total / len(tensors) if kind == dist.ReduceOp.AVG else total


def _divided(tensor: Tensor, factor: float | None) -> Tensor:
    return tensor if factor is None else tensor / factor


def _hsdp_reduction(division: Division, grads: list[list[Tensor]]) -> Tensor:
    """``grads[replica][shard rank]`` reduced as ``reduce_grads`` does: divided
    before, reduce-scattered within each replica, all-reduced across replicas,
    divided after."""
    per_replica = [
        _reduced(division.reduce_scatter_op, [_divided(g, division.pre) for g in replica])
        for replica in grads
    ]
    if len(per_replica) > 1:
        per_replica = [_reduced(division.all_reduce_op, per_replica)]
    return _divided(per_replica[0], division.post)


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("force_sum", [False, True])
@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_accelerator_division_is_torchs(
    fake_group: dist.ProcessGroup,
    dtype: torch.dtype,
    factor: float | None,
    force_sum: bool,
    replicas: int,
) -> None:
    """On an accelerator the factors and ops are torch's, a custom factor of
    fp32/bf16 gradients a ``PREMUL_SUM`` op that a reduce-scatter accepts."""
    replicate = fake_group if replicas > 1 else None
    theirs = _get_gradient_divide_factors(fake_group, replicate, dtype, "cuda", factor, force_sum)
    ours = Division.of(dtype, WORLD_SIZE * replicas, WORLD_SIZE, factor, force_sum, "cuda")
    assert (ours.pre, ours.post) == (theirs[0], theirs[1])
    assert _state(ours.reduce_scatter_op) == _state(theirs[2])
    assert _state(ours.all_reduce_op) == _state(theirs[3])
    send, out = torch.ones(2 * WORLD_SIZE, dtype=dtype), torch.empty(2, dtype=dtype)
    _comm.reduce_scatter(out, send, fake_group, ours.reduce_scatter_op)


def test_custom_factor_on_an_accelerator_is_a_premul_sum() -> None:
    """The path run 82 found broken on NCCL ranks: fp32/bf16 gradients with a
    factor other than the shard size are reduced by ``PREMUL_SUM(1 / factor)``."""
    for dtype in (torch.float32, torch.bfloat16):
        division = Division.of(dtype, WORLD_SIZE, WORLD_SIZE, 8.0, False, "cuda")
        assert isinstance(division.reduce_scatter_op, dist.ReduceOp)
        assert _state(division.reduce_scatter_op) == (dist.ReduceOp.PREMUL_SUM, 1 / 8.0)
        assert (division.pre, division.post) == (None, None)


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduction_divides_the_sum_by_the_factor(
    dtype: torch.dtype, factor: float | None, replicas: int, device_type: str
) -> None:
    """Each rank's gradient reduced as the division says is the sum over the
    data-parallel ranks divided by the factor (by their number without one); on
    the CPU a custom factor divides the sum after the reduction."""
    data_parallel = WORLD_SIZE * replicas
    division = Division.of(dtype, data_parallel, WORLD_SIZE, factor, False, device_type)
    if device_type == "cpu" and factor is not None:
        assert _state(division.reduce_scatter_op)[0] == dist.ReduceOp.SUM
    generator = torch.Generator().manual_seed(0)
    grads = [
        [torch.randn(16, generator=generator).to(dtype) for _ in range(WORLD_SIZE)]
        for _ in range(replicas)
    ]
    total = torch.stack([g.double() for replica in grads for g in replica]).sum(0)
    expected = total / (data_parallel if factor is None else factor)
    # Rounding: each rank's gradient is rounded to the dtype before the sum, the
    # sum and the divisions (and PREMUL_SUM's factor) round again in it.
    tol = {torch.float32: 1e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(
        _hsdp_reduction(division, grads).double(), expected, rtol=tol, atol=tol
    )
