"""``FSDP.clip_grad_norm_`` against ``torch.nn.utils.clip_grad_norm_`` on DDP.

The total norm is over the whole (unsharded) gradient, counted once, the same on
every rank and equal to DDP's; the clipped gradients then step the parameters
to DDP's. The loss is scaled so that every norm type exceeds every ``max_norm``
(asserted): clipping always happens. Also: a rank with no gradients warns and
returns a float32 zero; a non-root instance refuses; the returned dtype is the
promotion of the gradient dtypes.
"""

from __future__ import annotations

import enum
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdptest import FSDPTest
from fsdptest.api import (
    ADAPTER,
    FSDP,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
    clean_tensor_name,
)
from fsdptest.parity import REORDERED_FP32
from fsdptest.races import skip_torch_offload_race
from harness import current_device

LOSS_SCALE = 100.0
# The norm sums its terms in another order than nn.utils (per shard, then across
# ranks), and the 1-norm adds a few hundred terms: 1e-5 relative covers that.
NORM_RTOL, NORM_ATOL = 1e-5, 1e-6


class Sharding(enum.Enum):
    """The inner units' and the root's strategies."""

    FULL_SHARD = enum.auto()
    SHARD_GRAD_OP = enum.auto()
    NO_SHARD = enum.auto()
    MIXED = enum.auto()  # inner units NO_SHARD, the root FULL_SHARD

    @property
    def inner(self) -> ShardingStrategy:
        return ShardingStrategy.NO_SHARD if self is Sharding.MIXED else ShardingStrategy[self.name]

    @property
    def root(self) -> ShardingStrategy:
        return (
            ShardingStrategy.FULL_SHARD if self is Sharding.MIXED else ShardingStrategy[self.name]
        )


class Block(nn.Module):
    """Casts its input to its weight's dtype, so units of different precisions chain."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x.to(self.lin.weight.dtype)))


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    # 104, 154 and 60 elements: not divisible by 2 or 3
    return nn.Sequential(Block(7, 13), Block(13, 11), Block(11, 5))


def _input(rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(4, 7, generator=generator).to(current_device())


def _loss(model: nn.Module, rank: int) -> torch.Tensor:
    return model(_input(rank)).float().sum() * LOSS_SCALE


def _ddp(module: nn.Module) -> DDP:
    device = current_device()
    module = module.to(device)
    return DDP(module, device_ids=[device.index] if device.type == "cuda" else None)


def _fsdp(
    inner: ShardingStrategy,
    root: ShardingStrategy,
    *,
    use_orig_params: bool,
    offload: bool = False,
    inner_precision: MixedPrecision | None = None,
    root_precision: MixedPrecision | None = None,
) -> FSDP:
    """Blocks 0 and 1 are inner units; the root holds block 2."""
    net = _net() if offload else _net().to(current_device())
    common = {"use_orig_params": use_orig_params, "cpu_offload": CPUOffload(offload)}
    for i in range(2):
        net[i] = FSDP(net[i], sharding_strategy=inner, mixed_precision=inner_precision, **common)
    return FSDP(net, sharding_strategy=root, mixed_precision=root_precision, **common)


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    with FSDP.summon_full_params(model):
        return {clean_tensor_name(n): p.detach().clone() for n, p in model.named_parameters()}


def _same_on_every_rank(test: FSDPTest, value: torch.Tensor) -> None:
    local = value.detach().double().reshape(1).to(current_device())
    gathered = [torch.empty_like(local) for _ in range(test.world_size)]
    dist.all_gather(gathered, local)
    for other in gathered[1:]:
        test.assertEqual(other, gathered[0], rtol=0, atol=0)


class _ClipGradNorm(FSDPTest):
    def test_total_norm_and_clipped_step_equal_ddp(self) -> None:
        """Every max_norm x norm type x sharding x use_orig_params x offload."""
        config = {
            "max_norm": [0.1, 2.5],
            "norm_type": [1.0, 2.0, math.inf],
            "sharding": list(Sharding),
            "use_orig_params": [False, True],
            "offload": [False, True],
        }
        self.run_subtests(config, self._check_parity)

    def _check_parity(
        self,
        max_norm: float,
        norm_type: float,
        sharding: Sharding,
        use_orig_params: bool,
        offload: bool,
    ) -> None:
        skip_torch_offload_race(
            self, [sharding.inner, sharding.root], CPUOffload(offload), use_orig_params
        )
        model = _fsdp(
            sharding.inner,
            sharding.root,
            use_orig_params=use_orig_params,
            offload=offload,
        )
        reference = _ddp(_net())
        for m in (model, reference):
            _loss(m, self.rank).backward()
        total = model.clip_grad_norm_(max_norm, norm_type)
        expected = nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
        self.assertGreater(expected.item(), max_norm, "the gradients were not clipped")
        self.assertEqual(total, expected, rtol=NORM_RTOL, atol=NORM_ATOL)
        _same_on_every_rank(self, total)
        for m in (model, reference):
            torch.optim.SGD(m.parameters(), lr=0.1).step()
        # The clip coefficients differ by the norm's rounding: fp32 defaults.
        self.assertEqual(
            _full_params(model),
            {n: p.detach() for n, p in reference.module.named_parameters()},
            rtol=REORDERED_FP32.rtol,
            atol=REORDERED_FP32.atol,
        )

    def test_rank_without_gradients_warns_and_returns_fp32_zero(self) -> None:
        """Forward only: the norm is a float32 zero, with the documented warning."""
        config = {
            "sharding_strategy": [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP],
            "use_orig_params": [False, True],
        }
        self.run_subtests(config, self._check_no_gradients)

    def _check_no_gradients(
        self, sharding_strategy: ShardingStrategy, use_orig_params: bool
    ) -> None:
        # fp16 parameters: the norm's dtype is float32 all the same
        model = FSDP(
            nn.Linear(24, 24).to(current_device()),
            sharding_strategy=sharding_strategy,
            mixed_precision=MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32),
            use_orig_params=use_orig_params,
        )
        model(torch.randn(8, 24, device=current_device()))
        regex = (
            f"on rank {self.rank} with no gradients -- returning the total norm "
            "in the default dtype torch.float32"
        )
        with self.assertWarnsRegex(UserWarning, regex):
            total = model.clip_grad_norm_(1.0)
        self.assertEqual(total.dtype, torch.float32)
        self.assertEqual(total, torch.zeros((), dtype=torch.float32), rtol=0, atol=0)

    def test_non_root_instance_raises(self) -> None:
        """clip_grad_norm_ on an inner unit raises RuntimeError."""
        self.run_subtests({"use_orig_params": [False, True]}, self._check_non_root)

    def _check_non_root(self, use_orig_params: bool) -> None:
        model = _fsdp(
            ShardingStrategy.FULL_SHARD,
            ShardingStrategy.FULL_SHARD,
            use_orig_params=use_orig_params,
        )
        _loss(model, self.rank).backward()
        with self.assertRaisesRegex(
            RuntimeError, "should only be called on the root FSDP instance"
        ):
            model.module[0].clip_grad_norm_(1.0)

    def test_fp16_gradients_return_fp16_norm(self) -> None:
        """keep_low_precision_grads in fp16 everywhere: the norm is float16."""
        config = {
            "sharding_strategy": [
                ShardingStrategy.FULL_SHARD,
                ShardingStrategy.SHARD_GRAD_OP,
                ShardingStrategy.NO_SHARD,
            ],
            "use_orig_params": [False, True],
        }
        self.run_subtests(config, self._check_fp16)

    def _check_fp16(self, sharding_strategy: ShardingStrategy, use_orig_params: bool) -> None:
        fp16 = MixedPrecision(
            param_dtype=torch.float16,
            reduce_dtype=torch.float16,
            keep_low_precision_grads=True,
        )
        model = _fsdp(
            sharding_strategy,
            sharding_strategy,
            use_orig_params=use_orig_params,
            inner_precision=fp16,
            root_precision=fp16,
        )
        _loss(model, self.rank).backward()
        grads = {p.grad.dtype for p in model.parameters() if p.grad is not None}
        self.assertEqual(grads, {torch.float16})
        total = model.clip_grad_norm_(1.0)
        self.assertEqual(total.dtype, torch.float16)
        self.assertGreater(total.item(), 0.0)

    def test_mixed_gradient_dtypes_return_fp32_norm(self) -> None:
        """bf16 gradients in the inner units, fp32 in the root: the norm is float32."""
        self.run_subtests({"use_orig_params": [False, True]}, self._check_mixed_dtypes)

    def _check_mixed_dtypes(self, use_orig_params: bool) -> None:
        bf16 = MixedPrecision(
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.bfloat16,
            keep_low_precision_grads=True,
            cast_forward_inputs=True,
        )
        model = _fsdp(
            ShardingStrategy.FULL_SHARD,
            ShardingStrategy.FULL_SHARD,
            inner_precision=bf16,
            use_orig_params=use_orig_params,
        )
        _loss(model, self.rank).backward()
        grads = {p.grad.dtype for p in model.parameters() if p.grad is not None}
        self.assertEqual(grads, {torch.bfloat16, torch.float32})
        total = model.clip_grad_norm_(1.0)
        self.assertEqual(total.dtype, torch.float32)
        self.assertGreater(total.item(), 0.0)


class TestClipGradNormWorld2(_ClipGradNorm):
    world_size = 2


class TestClipGradNormWorld3(_ClipGradNorm):
    world_size = 3


class _ThreeParameters(nn.Module):
    """1 + 14 + 1 elements: over two ranks the first is outside rank 1's shard
    and the last outside rank 0's, so each rank has an empty original parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Parameter(torch.ones(1))
        self.middle = nn.Parameter(torch.ones(14))
        self.last = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.first + (x * self.middle).sum() + x * self.last


class TestClipGradNormEdgeCases(FSDPTest):
    world_size = 2

    def test_inf_norm_with_empty_user_gradients(self) -> None:
        """use_orig_params, gradients a user sets on every original parameter (the
        rank's empty ones too), then an infinity-norm clip: the norm of the gradients
        (2.0), every rank; torch's FSDP raises on each rank (vector_norm of an empty
        tensor), which is asserted."""
        model = FSDP(_ThreeParameters().to(current_device()), use_orig_params=True)
        params = list(model.parameters())
        self.assertEqual([p.numel() == 0 for p in params], [self.rank == 1, False, self.rank == 0])
        for param in params:
            param.grad = torch.full_like(param, 2.0)
        if ADAPTER.known_defects.inf_norm_of_empty_user_gradient:
            with self.assertRaisesRegex(RuntimeError, "empty tensor"):
                model.clip_grad_norm_(1.0, math.inf)
            return
        total = model.clip_grad_norm_(1.0, math.inf)
        self.assertEqual(total, torch.tensor(2.0), rtol=0, atol=0)
        _same_on_every_rank(self, total)
        for param in params:
            self.assertEqual(param.grad, torch.full_like(param, 2.0 / (2.0 + 1e-6)))


# -- parameters no unit manages, and the returned dtype --------------------------------------------


def _net_with_unmanaged() -> nn.Sequential:
    """``_net`` and a fourth block that no unit manages (ignored): its gradient is
    each rank's own, counted once per rank in that rank's norm."""
    net = _net()
    net.append(Block(5, 3))
    return net


def _ddp_ignoring_last_block(net: nn.Module) -> DDP:
    """DDP leaving the last block's parameters out of its all-reduce, as FSDP does."""
    names = [f"3.{name}" for name, _ in net[3].named_parameters()]
    DDP._set_params_and_buffers_to_ignore_for_model(net, names)
    return _ddp(net)


def _fsdp_with_unmanaged(
    sharding: Sharding,
    use_orig_params: bool,
    as_states: bool,
    inner_precision: MixedPrecision | None = None,
    root_precision: MixedPrecision | None = None,
) -> FSDP:
    net = _net_with_unmanaged().to(current_device())
    common = {"use_orig_params": use_orig_params}
    for i in range(2):
        net[i] = FSDP(
            net[i], sharding_strategy=sharding.inner, mixed_precision=inner_precision, **common
        )
    ignored = {"ignored_states": list(net[3].parameters())} if as_states else {}
    ignored = ignored or {"ignored_modules": [net[3]]}
    return FSDP(
        net, sharding_strategy=sharding.root, mixed_precision=root_precision, **ignored, **common
    )


def _promoted_grad_dtype(model: nn.Module) -> torch.dtype:
    dtypes = [p.grad.dtype for p in model.parameters() if p.grad is not None]
    promoted = dtypes[0]
    for dtype in dtypes[1:]:
        promoted = torch.promote_types(promoted, dtype)
    return promoted


class _ClipGradNormUnmanaged(FSDPTest):
    @pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf], ids=["l1", "l2", "inf"])
    def test_unmanaged_parameters_count_once_on_their_rank(self, norm_type: float) -> None:
        """An ignored block's gradient (each rank's own) enters that rank's norm
        once (the infinity norm: the largest over the ranks), and is clipped: the norm and that block's clipped gradients equal
        DDP's leaving the block out of its all-reduce, for every sharding x
        use_orig_params x norm type x max_norm x ignored as modules or as
        parameters."""
        config = {
            "max_norm": [0.1, 2.5],
            "norm_type": [norm_type],
            "sharding": list(Sharding),
            "use_orig_params": [False, True],
            "as_states": [False, True],
        }
        self.run_subtests(config, self._check_unmanaged)

    def _check_unmanaged(
        self,
        max_norm: float,
        norm_type: float,
        sharding: Sharding,
        use_orig_params: bool,
        as_states: bool,
    ) -> None:
        model = _fsdp_with_unmanaged(sharding, use_orig_params, as_states)
        reference = _ddp_ignoring_last_block(_net_with_unmanaged())
        for m in (model, reference):
            _loss(m, self.rank).backward()
        total = model.clip_grad_norm_(max_norm, norm_type)
        grads = [p.grad for p in reference.parameters() if p.grad is not None]
        expected = nn.utils.get_total_norm(grads, norm_type)
        if math.isinf(norm_type) and sharding is not Sharding.NO_SHARD:
            # The infinity norm is the largest element of every rank's gradients
            # (torch's FSDP all-reduces the maximum, unmanaged gradients included);
            # where no unit shards, nn.utils.clip_grad_norm_ clips on each rank alone.
            dist.all_reduce(expected, op=dist.ReduceOp.MAX)
        nn.utils.clip_grads_with_norm_(reference.parameters(), max_norm, expected)
        self.assertEqual(total, expected, rtol=NORM_RTOL, atol=NORM_ATOL)
        # Each rank clips with its own norm (its own unmanaged gradient in it), so
        # the managed shards of a summoned parameter were clipped by different
        # coefficients; the unmanaged gradients are whole on every rank.
        clipped = [p.grad for p in model.module[3].parameters()]
        self.assertEqual(clipped, [p.grad for p in reference.module[3].parameters()])

    @pytest.mark.parametrize("use_orig_params", [False, True])
    def test_norm_dtype_is_every_gradients_promotion(self, use_orig_params: bool) -> None:
        """The returned norm's dtype promotes the dtypes of every gradient of the
        rank, whichever unit (root, inner, or none) holds the low-precision ones."""
        bf16 = MixedPrecision(
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.bfloat16,
            keep_low_precision_grads=True,
            cast_forward_inputs=True,
        )
        config = {
            "precisions": [(bf16, None), (None, bf16), (bf16, bf16)],
            "unmanaged": [False, True],
            "use_orig_params": [use_orig_params],
            "sharding": [Sharding.FULL_SHARD, Sharding.MIXED],
        }
        self.run_subtests(config, self._check_dtype)

    def _check_dtype(
        self,
        precisions: tuple[MixedPrecision | None, MixedPrecision | None],
        unmanaged: bool,
        use_orig_params: bool,
        sharding: Sharding,
    ) -> None:
        inner, root = precisions
        if unmanaged:
            model = _fsdp_with_unmanaged(sharding, use_orig_params, False, inner, root)
        else:
            model = _fsdp(
                sharding.inner,
                sharding.root,
                use_orig_params=use_orig_params,
                inner_precision=inner,
                root_precision=root,
            )
        _loss(model, self.rank).backward()
        expected = _promoted_grad_dtype(model)
        total = model.clip_grad_norm_(1.0)
        self.assertEqual(total.dtype, expected)
        self.assertGreater(total.item(), 0.0)


class TestClipGradNormUnmanagedWorld2(_ClipGradNormUnmanaged):
    world_size = 2


class TestClipGradNormUnmanagedWorld3(_ClipGradNormUnmanaged):
    world_size = 3
