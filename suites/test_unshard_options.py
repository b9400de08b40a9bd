"""``summon_full_params`` options: ``rank0_only``, ``with_grads``, ``writeback``,
and what leaving the context does to an unsharded parameter forward kept.

Torch's semantics (``torch/distributed/fsdp/_unshard_param_utils.py``, upstream
``test_fsdp_unshard_params.py``): with ``rank0_only`` only rank 0 sees full
parameters, the other ranks stay sharded; ``with_grads`` (``use_orig_params``
only, not with ``offload_to_cpu``) gathers the gradients too and writes them
back like the parameters; a unit whose unsharded parameter was allocated before
the summon keeps it afterwards, except that under parameter mixed precision the
summon's full-precision gather frees the low-precision copy. Summoning inside
forward or backward, and ``rank0_only`` with ``writeback``, raise.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fsdptest import FSDPTest
from fsdptest.api import FSDP, CPUOffload, MixedPrecision, ModuleWrapPolicy, ShardingStrategy
from harness import current_device
from harness.collectives import Collective, CollectiveRecorder

ALL_STRATEGIES = [
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.NO_SHARD,
]
SHARDED = [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP]


class Block(nn.Module):
    """An inner FSDP unit."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


def _net() -> nn.Sequential:
    """Linear, Block, Block, Linear; sizes do not divide by 2 or 3."""
    torch.manual_seed(0)
    layers = [nn.Linear(7, 13), Block(13, 11), Block(11, 5), nn.Linear(5, 3)]
    return nn.Sequential(*layers).to(current_device())


def _wrap(strategy: ShardingStrategy, use_orig_params: bool, offload: bool = False) -> nn.Module:
    """An FSDP root (the outer Linears) over two inner Block units."""
    return FSDP(
        _net(),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=strategy,
        use_orig_params=use_orig_params,
        cpu_offload=CPUOffload(offload_params=offload),
    )


def _input(rank: int, step: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 7, generator=generator).to(current_device())


def _units_with_params(model: nn.Module) -> list[nn.Module]:
    return [unit for unit in FSDP.fsdp_modules(model) if unit._handle is not None]


def _storage_numel(flat_param: torch.Tensor) -> int:
    """Elements allocated for the unsharded (padded) flat parameter; 0 when freed."""
    padded = flat_param._full_param_padded
    return padded.untyped_storage().size() // padded.element_size()


def _sharded_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {
        name: None if p.grad is None else p.grad.detach().clone()
        for name, p in model.named_parameters()
    }


class _Rank0Only(FSDPTest):
    def test_rank0_only_full_on_rank0_sharded_elsewhere(self) -> None:
        """rank0_only: rank 0 sees full params, others stay sharded; nothing persists."""
        config = {
            "use_orig_params": [False, True],
            "offload": [False, True],
            "strategy": ALL_STRATEGIES,
        }
        self.run_subtests(config, self._check_rank0_only)

    def _check_rank0_only(
        self, use_orig_params: bool, offload: bool, strategy: ShardingStrategy
    ) -> None:
        model = _wrap(strategy, use_orig_params, offload)
        sharded_numels = [p.numel() for p in model.parameters()]
        before = _full_params(model)
        with FSDP.summon_full_params(model, rank0_only=True, writeback=False):
            if self.rank == 0:
                self._check_full_like_replica(model)
                _zero_all(model)
            elif use_orig_params:
                self._check_sharded_views(model, sharded_numels, strategy)
            else:
                self._check_sharded_flat_params(model)
        if strategy is not ShardingStrategy.NO_SHARD:
            # NO_SHARD exposes the real storage on rank 0 (torch documents that
            # writes persist there); sharded strategies expose a copy.
            self.assertEqual(_full_params(model), before, rtol=0, atol=0)

    def _check_full_like_replica(self, model: nn.Module) -> None:
        expected = list(_net().named_parameters())
        actual = list(model.named_parameters())
        self.assertEqual([n for n, _ in actual], [n for n, _ in expected])
        for (_, param), (_, ref) in zip(actual, expected):
            self.assertIsInstance(param, nn.Parameter)
            self.assertEqual(param.shape, ref.shape)
            self.assertEqual(param, ref, rtol=0, atol=0)

    def _check_sharded_views(
        self, model: nn.Module, sharded_numels: list[int], strategy: ShardingStrategy
    ) -> None:
        params = list(model.parameters())
        self.assertEqual([p.numel() for p in params], sharded_numels)
        if strategy is not ShardingStrategy.NO_SHARD:
            self.assertEqual({p.dim() for p in params}, {1})

    def _check_sharded_flat_params(self, model: nn.Module) -> None:
        for unit in _units_with_params(model):
            handle = unit._handle
            flat_param = handle.flat_param
            expected = (
                flat_param._sharded_size
                if handle.uses_sharded_strategy
                else flat_param._unpadded_unsharded_size
            )
            self.assertEqual(flat_param.shape, expected)

    def test_rank0_only_with_writeback_raises(self) -> None:
        """rank0_only=True with writeback=True is not supported."""
        model = _wrap(ShardingStrategy.FULL_SHARD, use_orig_params=False)
        with self.assertRaisesRegex(NotImplementedError, "is not supported"):
            with FSDP.summon_full_params(model, rank0_only=True, writeback=True):
                pass


def _full_params(model: nn.Module) -> list[torch.Tensor]:
    with FSDP.summon_full_params(model):
        return [p.detach().clone() for p in model.parameters()]


@torch.no_grad()
def _zero_all(model: nn.Module) -> None:
    for param in model.parameters():
        param.zero_()


class TestRank0OnlyWorld2(_Rank0Only):
    world_size = 2


class TestRank0OnlyWorld3(_Rank0Only):
    world_size = 3


class _WithGrads(FSDPTest):
    def test_with_grads_gathers_and_writes_back_gradients(self) -> None:
        """with_grads: gathered grads are averaged; doubling persists iff writeback or NO_SHARD."""
        config = {"writeback": [False, True], "strategy": ALL_STRATEGIES}
        self.run_subtests(config, self._check_with_grads)

    def _check_with_grads(self, writeback: bool, strategy: ShardingStrategy) -> None:
        model = _wrap(strategy, use_orig_params=True)
        x = _input(self.rank)
        model(x).sum().backward()
        expected = self._averaged_replica_grads(x)
        before = _sharded_grads(model)
        with FSDP.summon_full_params(model, writeback=writeback, with_grads=True):
            actual = list(model.named_parameters())
            self.assertEqual([n for n, _ in actual], list(expected))
            for name, param in actual:
                self.assertIsNotNone(param.grad, msg=name)
                # Averaged in another order than the reduce-scatter: fp32 tolerance.
                self.assertEqual(param.grad, expected[name], msg=name)
                param.grad *= 2
        doubled = writeback or strategy is ShardingStrategy.NO_SHARD
        factor = 2.0 if doubled else 1.0
        after = _sharded_grads(model)
        self.assertEqual(list(after), list(before))
        for name, grad in before.items():
            if grad is None:
                self.assertIsNone(after[name], msg=name)
            else:
                self.assertEqual(after[name], grad * factor, rtol=0, atol=0, msg=name)

    def _averaged_replica_grads(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        replica = _net()
        replica(x).sum().backward()
        grads = {}
        for name, param in replica.named_parameters():
            assert param.grad is not None
            dist.all_reduce(param.grad)
            grads[name] = param.grad / self.world_size
        return grads

    def test_with_grads_before_backward_gives_none(self) -> None:
        """with_grads before any backward: every summoned parameter's gradient is None."""
        self.run_subtests({"strategy": ALL_STRATEGIES}, self._check_none_grads)

    def _check_none_grads(self, strategy: ShardingStrategy) -> None:
        model = _wrap(strategy, use_orig_params=True)
        for unit in _units_with_params(model):
            self.assertIsNone(unit._handle.flat_param.grad)
        with FSDP.summon_full_params(model, with_grads=True):
            for name, param in model.named_parameters():
                self.assertIsNone(param.grad, msg=name)

    def test_with_grads_unsupported_configs_raise(self) -> None:
        """with_grads=True needs use_orig_params=True and offload_to_cpu=False."""
        config = {"orig_params_and_offload_to_cpu": [(False, False), (False, True), (True, True)]}
        self.run_subtests(config, self._check_with_grads_raises)

    def _check_with_grads_raises(self, orig_params_and_offload_to_cpu: tuple[bool, bool]) -> None:
        use_orig_params, offload_to_cpu = orig_params_and_offload_to_cpu
        model = _wrap(ShardingStrategy.FULL_SHARD, use_orig_params)
        model(_input(self.rank)).sum().backward()
        with self.assertRaises(NotImplementedError):
            with FSDP.summon_full_params(model, with_grads=True, offload_to_cpu=offload_to_cpu):
                pass


class TestWithGradsWorld2(_WithGrads):
    world_size = 2


class TestWithGradsWorld3(_WithGrads):
    world_size = 3


def _two_level(
    strategy: ShardingStrategy, mixed_precision: MixedPrecision | None, use_orig_params: bool
) -> nn.Module:
    """FSDP(Sequential(FSDP(Linear(5, 5)), Linear(5, 3))), both without bias."""
    torch.manual_seed(0)
    kwargs = {
        "sharding_strategy": strategy,
        "mixed_precision": mixed_precision,
        "use_orig_params": use_orig_params,
    }
    inner = FSDP(nn.Linear(5, 5, bias=False).to(current_device()), **kwargs)
    outer = nn.Linear(5, 3, bias=False).to(current_device())
    return FSDP(nn.Sequential(inner, outer), **kwargs)


def _flat_params(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(root, inner) flat parameters of ``_two_level``."""
    return model._handle.flat_param, model.module[0]._handle.flat_param


# All-gathers of the backward that follows forward (+ an empty summon), as
# torch's FSDP does them (recorded under --fsdp-impl torch, gloo, 2 and 3
# ranks): (strategy, mixed precision) -> (with the summon, without it). Under
# FULL_SHARD the inner unit re-gathers in backward; the root keeps its
# parameter (also through the summon) unless mixed precision made the summon
# free the low-precision copy. Under SHARD_GRAD_OP nothing is re-gathered
# unless the summon freed a low-precision copy.
BACKWARD_ALL_GATHERS = {
    (ShardingStrategy.FULL_SHARD, False): (1, 1),
    (ShardingStrategy.FULL_SHARD, True): (2, 1),
    (ShardingStrategy.SHARD_GRAD_OP, False): (0, 0),
    (ShardingStrategy.SHARD_GRAD_OP, True): (2, 0),
}


class _KeepsUnshardedParams(FSDPTest):
    def test_summon_after_forward_keeps_what_forward_kept(self) -> None:
        """An empty summon keeps forward's unsharded params (not under MP); backward as torch's."""
        config = {
            "strategy": SHARDED,
            "mixed_precision": [False, True],
            "use_orig_params": [False, True],
        }
        self.run_subtests(config, self._check_keeps)

    def _check_keeps(
        self, strategy: ShardingStrategy, mixed_precision: bool, use_orig_params: bool
    ) -> None:
        mp = MixedPrecision(param_dtype=torch.float16) if mixed_precision else None
        model = _two_level(strategy, mp, use_orig_params)
        twin = _two_level(strategy, mp, use_orig_params)
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(self.rank))
        x = x.to(current_device())
        out, twin_out = model(x), twin(x)
        kept_inner = strategy is ShardingStrategy.SHARD_GRAD_OP
        self._check_storage(model, "after forward", root_kept=True, inner_kept=kept_inner)
        with FSDP.summon_full_params(model):
            pass
        kept_through_summon = not mixed_precision
        self._check_storage(
            model,
            "after the summon",
            root_kept=kept_through_summon,
            inner_kept=kept_inner and kept_through_summon,
        )
        with CollectiveRecorder((Collective.ALL_GATHER,)) as recorder:
            out.float().sum().backward()
        with CollectiveRecorder((Collective.ALL_GATHER,)) as twin_recorder:
            twin_out.float().sum().backward()
        counts = (len(recorder.calls), len(twin_recorder.calls))
        self.assertEqual(counts, BACKWARD_ALL_GATHERS[(strategy, mixed_precision)])
        self._check_storage(model, "after backward", root_kept=False, inner_kept=False)
        grads = [p.grad for p in _flat_params(model)]
        twin_grads = [p.grad for p in _flat_params(twin)]
        self.assertEqual(grads, twin_grads, rtol=0, atol=0)

    def _check_storage(
        self, model: nn.Module, stage: str, root_kept: bool, inner_kept: bool
    ) -> None:
        """The unsharded storage is the padded full size where kept, else freed."""
        for flat_param, kept, which in zip(
            _flat_params(model), (root_kept, inner_kept), ("root", "inner")
        ):
            expected = flat_param._sharded_size.numel() * self.world_size if kept else 0
            self.assertEqual(
                _storage_numel(flat_param), expected, msg=f"{which} unsharded storage {stage}"
            )


class TestKeepsUnshardedParamsWorld2(_KeepsUnshardedParams):
    world_size = 2


class TestKeepsUnshardedParamsWorld3(_KeepsUnshardedParams):
    world_size = 3


class SummonsInForward(nn.Module):
    """Calls summon_full_params on the FSDP unit it is given, during forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(5))

    def forward(self, fsdp_module: nn.Module) -> torch.Tensor:
        with FSDP.summon_full_params(fsdp_module):
            pass
        return self.a.sum()


class _Errors(FSDPTest):
    def test_summon_during_forward_raises_assertion(self) -> None:
        """A summon from inside forward raises AssertionError."""
        self.run_subtests({"use_orig_params": [False, True]}, self._check_forward_raises)

    def _check_forward_raises(self, use_orig_params: bool) -> None:
        model = FSDP(SummonsInForward().to(current_device()), use_orig_params=use_orig_params)
        with self.assertRaisesRegex(
            AssertionError, "Cannot manually unshard parameters during forward/backward"
        ):
            model(model)

    def test_summon_during_backward_raises_assertion(self) -> None:
        """A summon from a tensor hook during backward raises AssertionError."""
        self.run_subtests({"use_orig_params": [False, True]}, self._check_backward_raises)

    def _check_backward_raises(self, use_orig_params: bool) -> None:
        model = FSDP(nn.Linear(2, 1).to(current_device()), use_orig_params=use_orig_params)
        output = model(torch.ones(2, device=current_device()))

        def summon_in_backward(grad: torch.Tensor) -> torch.Tensor:
            with FSDP.summon_full_params(model):
                pass
            return grad

        output.register_hook(summon_in_backward)
        with self.assertRaisesRegex(
            AssertionError, "Cannot manually unshard parameters during forward/backward"
        ):
            output.backward()


class TestErrorsWorld2(_Errors):
    world_size = 2


class TestErrorsWorld3(_Errors):
    world_size = 3
