"""``ShardedGradScaler``: scaling, unscaling and agreeing on inf/nan across ranks.

Torch's semantics (``torch/distributed/fsdp/sharded_grad_scaler.py``, upstream
``test_fsdp_sharded_grad_scaler.py``): ``scale`` keeps the structure of nested
lists and tuples; ``_unscale_grads_(optimizer, inv_scale, found_inf,
allow_fp16=True)`` unscales dense and sparse gradients (CPU included) and
returns a dict device -> found_inf; ``step`` returns None when it skipped; the
found-inf flags are all-reduced over the scaler's process group, so a rank that
holds no gradient, or no inf, skips and backs off with the others.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fsdptest import FSDPTest
from fsdptest.api import FSDP, ShardedGradScaler, ShardingStrategy
from fsdptest.races import skip_torch_scaler_race
from harness import DistributedTest, current_device
from models import DummyProcessGroup

INF = float("inf")


def _single_rank_scaler() -> ShardedGradScaler:
    return ShardedGradScaler(
        device=current_device().type,
        init_scale=2.0,
        process_group=DummyProcessGroup(rank=0, size=1),
    )


def _sparse(indices: list[list[int]], values: list[float], dtype: torch.dtype) -> torch.Tensor:
    return torch.sparse_coo_tensor(
        torch.tensor(indices, dtype=torch.int64),
        torch.tensor(values, dtype=dtype),
        (2, 3),
        device=current_device(),
    )


class TestScalerSingleRank(DistributedTest):
    """Upstream's single-process cases, with ``DummyProcessGroup(rank=0, size=1)``."""

    world_size = 1

    def test_scale_nested_lists_and_tuples_keep_structure(self) -> None:
        """scale() returns the same nested list/tuple structure, every tensor scaled."""
        scaler = _single_rank_scaler()
        t0 = torch.full((1,), 4.0, device=current_device())
        t1 = torch.full((1,), 8.0, device=current_device())
        scaled = scaler.scale([t1, (t0, t1), [t0, t1]])
        self.assertIsInstance(scaled, list)
        self.assertIsInstance(scaled[1], tuple)
        self.assertIsInstance(scaled[2], list)
        self.assertEqual(scaled[0], 16.0)
        self.assertEqual(list(scaled[1]), [8.0, 16.0])
        self.assertEqual(scaled[2], [8.0, 16.0])
        self.assertEqual(scaler._scale.device, t1.device)

    def test_unscale_grads_dense_cpu_returns_found_inf_per_device(self) -> None:
        """_unscale_grads_ (allow_fp16=True default) unscales CPU grads; {device: found_inf}."""
        skip_torch_scaler_race(self)
        scaler = _single_rank_scaler()
        scaler.scale(torch.ones(1, device=current_device()))
        params = [
            nn.Parameter(torch.zeros(3, dtype=dtype)) for dtype in (torch.float32, torch.float16)
        ]
        for param in params:
            param.grad = torch.full_like(param, 4.0)
        optim = torch.optim.SGD(params, lr=1.0)
        per_device = scaler._unscale_grads_(optim, *self._inv_scale_and_found_inf())
        self.assertEqual(list(per_device), [params[0].device])
        self.assertEqual(per_device[params[0].device], 0.0)
        for param in params:
            self.assertEqual(param.grad, torch.full_like(param, 2.0))
        params[0].grad[1] = INF
        per_device = scaler._unscale_grads_(optim, *self._inv_scale_and_found_inf())
        self.assertEqual(per_device[params[0].device], 1.0)

    def test_unscale_grads_fp16_refused_when_allow_fp16_false(self) -> None:
        """allow_fp16=False refuses fp16 gradients, as GradScaler does."""
        scaler = _single_rank_scaler()
        scaler.scale(torch.ones(1, device=current_device()))
        param = nn.Parameter(torch.zeros(3, dtype=torch.float16))
        param.grad = torch.ones_like(param)
        optim = torch.optim.SGD([param], lr=1.0)
        with self.assertRaisesRegex(ValueError, "Attempting to unscale FP16 gradients"):
            scaler._unscale_grads_(optim, *self._inv_scale_and_found_inf(), allow_fp16=False)

    def test_unscale_grads_sparse_unscaled_and_inf_detected(self) -> None:
        """Sparse grads are unscaled; an inf value or an fp16 coalescing overflow is found."""
        scaler = _single_rank_scaler()
        scaler.scale(torch.ones(1, device=current_device()))
        grad = _sparse([[0, 1, 1], [2, 0, 2]], [16.0, 32.0, 64.0], torch.float32)
        self.assertEqual(self._unscale_sparse(scaler, grad.clone(), expect=grad / 2), 0.0)
        with_inf = _sparse([[0, 1, 1], [2, 0, 2]], [16.0, 32.0, INF], torch.float32)
        self.assertEqual(self._unscale_sparse(scaler, with_inf), 1.0)
        overflow = _sparse([[1, 1, 1], [0, 0, 2]], [2.0**15, 2.0**15, 1.0], torch.float16)
        self.assertEqual(self._unscale_sparse(scaler, overflow), 1.0)

    def _unscale_sparse(
        self,
        scaler: ShardedGradScaler,
        grad: torch.Tensor,
        expect: torch.Tensor | None = None,
    ) -> torch.Tensor:
        param = nn.Parameter(torch.zeros(2, 3, dtype=grad.dtype, device=grad.device))
        param.grad = grad
        optim = torch.optim.SGD([param], lr=1.0)
        found_inf = scaler._unscale_grads_(optim, *self._inv_scale_and_found_inf())[param.device]
        if expect is not None:
            self.assertEqual(param.grad.to_dense(), expect.to_dense())
        return found_inf

    def test_step_with_inf_gradient_returns_none_and_skips(self) -> None:
        """step() returns None and leaves the parameter unchanged when a gradient is inf."""
        scaler = _single_rank_scaler()
        param = nn.Parameter(torch.ones(2, device=current_device()))
        param.grad = torch.tensor([1.0, INF], device=current_device())
        optim = torch.optim.SGD([param], lr=1.0)
        scaler.scale(torch.full((1,), 4.0, device=current_device()))
        self.assertIsNone(scaler.step(optim))
        self.assertEqual(param.detach(), torch.ones(2), rtol=0, atol=0)

    def _inv_scale_and_found_inf(self) -> tuple[torch.Tensor, torch.Tensor]:
        device = current_device()
        return torch.full((1,), 0.5, device=device), torch.full((1,), 0.0, device=device)


class OneScalar(nn.Module):
    """One trainable element: on 2 or 3 ranks every rank but 0 holds padding only."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.full((1,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.a


class ScalarAndFrozen(nn.Module):
    """A trainable scalar first, then a frozen 30-element vector: with
    use_orig_params=True every rank but 0 holds only frozen elements."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.full((1,), 0.5))
        self.frozen = nn.Parameter(torch.linspace(0.0, 1.0, 30), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.a + self.frozen.sum()


def _model(kind: str, use_orig_params: bool) -> nn.Module:
    module = OneScalar() if kind == "one_scalar" else ScalarAndFrozen()
    return FSDP(
        module.to(current_device()),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        use_orig_params=use_orig_params,
    )


def _trainable_local_numel(model: nn.Module) -> int:
    """Elements of trainable original parameters in this rank's shard (padding excluded)."""
    if model._use_orig_params:
        return sum(p.numel() for p in model.parameters() if p.requires_grad)
    flat_param = model._handle.flat_param
    info = flat_param._shard_param_infos[0]
    return info.numel_in_shard if info.in_shard else 0


def _plant_inf_on_rank0(model: nn.Module, rank: int) -> None:
    if rank != 0:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None and p.grad.numel()]
    grads[0].view(-1)[0] = INF


class _AgreeOnInf(FSDPTest):
    def test_rank_without_gradient_shard_skips_with_rank0(self) -> None:
        """Ranks holding no trainable shard skip and back off with rank 0's inf."""
        # A flat parameter mixing frozen and trainable parameters needs
        # use_orig_params=True, hence no ("scalar_and_frozen", False).
        cases = [("one_scalar", False), ("one_scalar", True), ("scalar_and_frozen", True)]
        self.run_subtests({"kind_and_orig_params": cases}, self._check_agreement)

    def _check_agreement(self, kind_and_orig_params: tuple[str, bool]) -> None:
        kind, use_orig_params = kind_and_orig_params
        model = _model(kind, use_orig_params)
        if self.rank > 0:
            self.assertEqual(_trainable_local_numel(model), 0, msg="rank holds a trainable part")
        scaler = ShardedGradScaler(device=current_device().type, init_scale=8.0)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        self._step_and_check(model, scaler, optim, plant_inf=True)
        self._step_and_check(model, scaler, optim, plant_inf=False)

    def _step_and_check(
        self,
        model: nn.Module,
        scaler: ShardedGradScaler,
        optim: torch.optim.Optimizer,
        plant_inf: bool,
    ) -> None:
        optim.zero_grad()
        x = torch.full((2,), float(self.rank + 1), device=current_device())
        scaler.scale(model(x).sum()).backward()
        if plant_inf:
            _plant_inf_on_rank0(model, self.rank)
        before = _summoned(model)
        previous = scaler.get_scale()
        result = scaler.step(optim)
        scaler.update()
        after = _summoned(model)
        if plant_inf:
            self.assertIsNone(result)
            self.assertEqual(after, before, rtol=0, atol=0)
            self.assertEqual(scaler.get_scale(), previous * scaler.get_backoff_factor())
        else:
            self.assertNotEqual(after[0], before[0], msg="the clean step did not run")
            self.assertEqual(scaler.get_scale(), previous)

    def test_non_default_process_group_agrees(self) -> None:
        """On dist.new_group(all ranks) every rank skips rank 0's inf, then steps."""
        group = dist.new_group(list(range(self.world_size)))
        model = FSDP(OneScalar().to(current_device()), process_group=group)
        scaler = ShardedGradScaler(
            device=current_device().type, init_scale=8.0, process_group=group
        )
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        self._step_and_check(model, scaler, optim, plant_inf=True)
        self._step_and_check(model, scaler, optim, plant_inf=False)


def _summoned(model: nn.Module) -> list[torch.Tensor]:
    with FSDP.summon_full_params(model):
        return [p.detach().clone() for p in model.parameters()]


class TestAgreeOnInfWorld2(_AgreeOnInf):
    world_size = 2


class TestAgreeOnInfWorld3(_AgreeOnInf):
    world_size = 3
