"""Every allowed difference of the conformance search is asserted
(``fsdptest.conformance.allowed``, [Note: Nothing is silently skipped]):

- what torch's FSDP is not asked (``UNASKED``) still fails in torch: the
  entries pinned down in ``suites/test_property_findings.py`` name an existing
  test there; the others are asserted here (``TestTorchLimitations``, on
  torch's FSDP whatever ``--fsdp-impl`` says);
- every observation rewrite (``NORMALISED``) still rewrites something of
  torch's trace on a witness scenario: when torch stops doing what it allows,
  the rewrite stops applying and the test fails;
- every divergence of ours (``PENDING``, ``PENDING_UNASKED``) is still there on
  its witness scenario (ours against torch's): fixing it fails the test, and the
  entry (and its note in the README) is then deleted.

These compare this project's FSDP with torch's by module (``local``, ``torch``),
whatever ``--fsdp-impl`` and ``--fsdp-reference`` say.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from torch import nn

from fsdptest import FSDPTest
from fsdptest._constants import TORCH_CPU_OFFLOAD_ERROR
from fsdptest.conformance import allowed
from fsdptest.conformance import scenario as sc
from fsdptest.properties.examples import DType, Precision, Sharding
from harness import current_device

ROOT = Path(__file__).resolve().parents[1]
L, B, K = sc.Layer, sc.Block, sc.LayerKind
NET = sc.Net(vocab=0, width=2, blocks=(B((L(K.LINEAR, 2),)),))
TRAIN = (sc.ZeroGrad(), sc.Forward(), sc.Backward(), sc.OptimStep())


DEFAULT = sc.Setup()


def _scenario(ops: tuple[sc.Op, ...], setup: sc.Setup = DEFAULT, net: sc.Net = NET) -> sc.Scenario:
    return sc.Scenario(2, net, setup, (*ops, sc.Final()))


def _settings(kind: sc.StateDictKind) -> sc.SetStateDictType:
    return sc.SetStateDictType(sc.Settings(kind=kind))


ORIG = sc.Setup(use_orig_params=True)
NO_SHARD = sc.Setup(sharding=Sharding.NO_SHARD)
BUFFER = sc.Net(vocab=0, width=2, blocks=(B((L(K.LINEAR, 2), L(K.SCALE))),))
LOW_GRADS = Precision(
    param_dtype=DType.BFLOAT16, reduce_dtype=DType.FLOAT16, keep_low_precision_grads=True
)

# A scenario where each NORMALISED entry rewrites torch's trace.
NORMALISED_WITNESSES: dict[str, sc.Scenario] = {
    "FLAT_VIEW_ATTRIBUTES_HAVE_NO_CONTRACT": _scenario(()),
    "TORCH_INTERNAL_WARNINGS": _scenario(
        (*TRAIN, _settings(sc.StateDictKind.SHARDED), sc.SaveOptimState())
    ),
    "TORCH_WARNING_TYPOS": _scenario((sc.SaveStateDict(), sc.LoadStateDict(slot=0)), NO_SHARD),
    "OPTIMIZER_STATE_ENTRY_ORDER": _scenario(
        (
            *TRAIN,
            sc.SaveOptimState(),
            sc.LoadOptimState(slot=0),
        ),
        sc.Setup(optimizer=sc.Optimizer.ADAM),
    ),
    "STATE_DICT_TYPE_DEPRECATION": _scenario((_settings(sc.StateDictKind.FULL),)),
    "OPTIM_STATE_DICT_OBJECT_EXCHANGES": _scenario(
        (*TRAIN, sc.SaveOptimState(api=sc.OptimApi.FULL), sc.LoadOptimState(slot=0))
    ),
    "LOCAL_FLAT_PARAM_REQUIRES_GRAD": _scenario(
        (*TRAIN, _settings(sc.StateDictKind.LOCAL), sc.SaveStateDict())
    ),
    "FLAT_PARAM_PADDING_VALUE": _scenario(
        (*TRAIN, _settings(sc.StateDictKind.LOCAL), sc.SaveStateDict()), ORIG
    ),
    # NO_SHARD, use_orig_params, fp16 parameters and reductions, meta init, a tied
    # 1-wide net with batch norms: the first scaled backward (scale 2**16) overflows.
    "OVERFLOWED_GRADIENT_VALUES": sc.Scenario.from_replay_id(
        "eNqtUk1PwzAM_SvI51yGND56Q-LACSQ4TlOUpm4bLU0qJ1nZpv53nG6DiQ3EgVvs5_dsP2cHgydb"
        "yWC2CMW1gIBYQTG7u78V4DBCsYO116qEYi5gMFVsGRVQWq9XAYrFDqzaIO2fK-OYDNGwBtcYxela"
        "2YDjUoBuja0I3Q8kaxwqgq8m43IUf1QXn2Cpom6dpw5OkpekfxA_L_1F5h9HnOJvlmXTspJsUXFN"
        "pIQCfIp9ilw0H_OxYurziUKrqDKuYaXnF_n29PD6yGodhvbISwGlJ9PIXpHqwjHdmXdu0BNqE4x3"
        "WWsqkFXc9PwjoLZexdkNqxFWSeMFoEx1jXQB0CpEWXsaeDhp3H7ufd8JIu_P8Wl5MRkSOCnrZO3p"
        "gJnPqxtn-HPyilGxj-D7fIAFbJG8bIj9Ejv2bwEH-WMYtLJYXZVKrw5paMgPseVWEWmt7PQ9MtE4"
        "DjJtOX4AWwQVLQ=="
    ),
    "SCALER_FOUND_INF_AGREEMENT": _scenario(
        (sc.ZeroGrad(), sc.Forward(), sc.ScaledBackward(), sc.ScalerStep()),
        sc.Setup(offload_params=True, wrap=sc.Wrap.BLOCKS, ignored_blocks=(0,)),
        sc.Net(vocab=0, width=2, blocks=(B((L(K.LINEAR, 2),)), B((L(K.LINEAR, 2),)))),
    ),
    "SHARDED_TENSOR_LOCAL_SHARD_RANK": sc.Scenario(
        4,
        NET,
        sc.Setup(sharding=Sharding.HYBRID_SHARD, replicas=2),
        (_settings(sc.StateDictKind.SHARDED), sc.SaveStateDict(), sc.Final()),
    ),
}

# Entries whose witness rewrites torch's trace on accelerator ranks only, and the
# test asserting torch's behaviour on both sides of that boundary.
ON_ACCELERATORS = {
    "SCALER_FOUND_INF_AGREEMENT": "TestTorchLimitationsAnywhere::test_scaler_agreement_per_device",
}

# A scenario where each PENDING entry hides a divergence of ours.
PENDING_WITNESSES: dict[str, sc.Scenario] = {}

# A scenario holding each call that is not drawn for ours.
PENDING_UNASKED_WITNESSES: dict[str, sc.Scenario] = {}


def _witnesses_at(world_size: int) -> list[str]:
    return sorted(n for n, s in NORMALISED_WITNESSES.items() if s.world_size == world_size)


def _assert_normalised_applies(name: str) -> None:
    """The rewrite still changes torch's trace of its witness scenario (on some rank:
    a hybrid shard group's ranks differ from the global ones on ranks != 0 only)."""
    import torch.distributed as dist

    from fsdptest.conformance.execute import Run
    from fsdptest.conformance.implementation import FsdpApi

    if name in ON_ACCELERATORS and current_device().type == "cpu":
        pytest.skip(f"{name} applies on accelerator ranks; {ON_ACCELERATORS[name]} asserts both")
    trace = Run(NORMALISED_WITNESSES[name], FsdpApi("torch"), current_device()).trace()
    entry = allowed.NORMALISED[name]
    counts: dict[str, int] = {}
    for record in trace.records:
        allowed.normalise(record.op, record.observed, [entry], counts)
    applied = torch.tensor([counts.get(name, 0)], device=current_device())
    dist.all_reduce(applied)
    assert int(applied.item()) > 0, f"{name} no longer applies to torch's trace"


class TestAllowedDifferencesWorld4(FSDPTest):
    world_size = 4

    @pytest.mark.parametrize("name", _witnesses_at(4))
    def test_torch_still_differs_where_normalised(self, name: str) -> None:
        _assert_normalised_applies(name)


class TestAllowedDifferences(FSDPTest):
    world_size = 2

    @pytest.mark.parametrize("name", _witnesses_at(2))
    def test_torch_still_differs_where_normalised(self, name: str) -> None:
        _assert_normalised_applies(name)

    @pytest.mark.parametrize("name", sorted(PENDING_WITNESSES))
    def test_pending_divergence_is_still_there(self, name: str) -> None:
        """Without the entry, ours differs from torch's where it says; with it, less."""
        from fsdptest.conformance.check import run_both

        scenario = PENDING_WITNESSES[name]
        without = run_both(scenario, "local", "torch", without=frozenset({name}))
        with_entry = run_both(scenario, "local", "torch")
        self.assertGreater(
            len(without.left),
            len(with_entry.left),
            f"{name}: ours no longer differs from torch's here (fixed?): delete the entry",
        )
        self.assertGreater(with_entry.allowed.get(name, 0), 0)

    @pytest.mark.parametrize("name", sorted(PENDING_UNASKED_WITNESSES))
    def test_unasked_divergence_is_still_there(self, name: str) -> None:
        """The call ours is not asked still makes it differ from torch's."""
        import torch.distributed as dist

        from fsdptest.conformance.check import run_both

        verdict = run_both(PENDING_UNASKED_WITNESSES[name], "local", "torch")
        differing = torch.tensor([len(verdict.left)], device=current_device())
        dist.all_reduce(differing)  # on some rank: a sharded gradient differs on its owner only
        self.assertGreater(
            int(differing.item()),
            0,
            f"{name}: ours no longer differs from torch's (fixed?): delete the entry",
        )


class TestTorchLimitations(FSDPTest):
    """Torch's FSDP (``torch.distributed.fsdp`` itself) on CPU ranks."""

    world_size = 2

    def _torch_fsdp(self, module: nn.Module, **kwargs: object) -> nn.Module:
        import torch.distributed.fsdp as torch_fsdp

        kwargs.setdefault("device_id", torch.device("cpu"))
        return torch_fsdp.FullyShardedDataParallel(module, **kwargs)

    def setUp(self) -> None:
        super().setUp()
        if current_device().type != "cpu":
            pytest.skip("asserts what torch's FSDP does on CPU ranks")

    def test_summon_offload_to_cpu_on_cpu_ranks(self) -> None:
        """T1: every rank raises (rank 0 only under rank0_only=True)."""
        import torch.distributed.fsdp as torch_fsdp

        for rank0_only in (False, True):
            model = self._torch_fsdp(nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1, bias=False)))
            summon = torch_fsdp.FullyShardedDataParallel.summon_full_params(
                model, offload_to_cpu=True, rank0_only=rank0_only, writeback=False
            )
            if rank0_only and self.rank != 0:
                with summon:
                    pass
                continue
            with self.assertRaisesRegex(RuntimeError, "out of bounds for storage of size 0"):
                with summon:
                    pass
        model = self._torch_fsdp(nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1, bias=False)))
        config = torch_fsdp.FullStateDictConfig(offload_to_cpu=True, rank0_only=False)
        with torch_fsdp.FullyShardedDataParallel.state_dict_type(
            model, torch_fsdp.StateDictType.FULL_STATE_DICT, config
        ):
            with self.assertRaisesRegex(RuntimeError, "out of bounds for storage of size 0"):
                model.state_dict()

    def test_sync_module_states_on_cpu_ranks(self) -> None:
        """T2: torch refuses CPU modules even with device_id=cpu."""
        with self.assertRaisesRegex(ValueError, "requires them to be on GPU"):
            self._torch_fsdp(nn.Linear(2, 2), sync_module_states=True)

    def test_optim_state_dict_aliases_states_with_orig_params(self) -> None:
        """T3: Adam's exp_avg comes back equal to exp_avg_sq (with use_orig_params=False
        it does not)."""
        import torch.distributed.fsdp as torch_fsdp

        for use_orig_params in (True, False):
            torch.manual_seed(0)
            model = self._torch_fsdp(
                nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)), use_orig_params=use_orig_params
            )
            optim = torch.optim.Adam(model.parameters(), lr=0.01)
            model(torch.randn(2, 3)).sum().backward()
            optim.step()
            saved = torch_fsdp.FullyShardedDataParallel.optim_state_dict(model, optim)
            state = saved["state"]["0.weight"]
            aliased = torch.equal(state["exp_avg"], state["exp_avg_sq"])
            self.assertEqual(aliased, use_orig_params, f"use_orig_params={use_orig_params}")

    def test_no_sync_gives_frozen_parameters_gradients(self) -> None:
        """T4: after a backward under no_sync the frozen Linear has a .grad (with
        a synced backward it has none)."""
        for synced in (True, False):
            net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
            net[1].requires_grad_(False)
            model = self._torch_fsdp(net, use_orig_params=True)
            context = model.no_sync() if not synced else torch.enable_grad()
            with context:
                model(torch.ones(2, 2)).sum().backward()
            has_grad = net[1].weight.grad is not None
            self.assertEqual(has_grad, not synced, f"synced={synced}")

    def test_wrapping_a_unit_again_with_mixed_precision(self) -> None:
        """FSDP(FSDP(m)): with a param_dtype the first forward fails (torch's message names the dtypes); without, it
        trains."""
        import torch.distributed.fsdp as torch_fsdp

        def wrapped(**kwargs: object) -> nn.Module:
            torch.manual_seed(0)
            inner = self._torch_fsdp(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)), **kwargs)
            return self._torch_fsdp(inner)

        model = wrapped()
        model(torch.ones(2, 2)).sum().backward()
        precision = torch_fsdp.MixedPrecision(param_dtype=torch.float16)
        with self.assertRaisesRegex(RuntimeError, "dtype"):
            wrapped(mixed_precision=precision)(torch.ones(2, 2)).sum().backward()

    def test_wrapping_an_initialised_root_again(self) -> None:
        """FSDP(root) after root.state_dict(): the next state_dict() fails torch's
        root check (before any such call the wrapped-again model saves)."""
        fresh = self._torch_fsdp(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)))
        self.assertEqual(len(self._torch_fsdp(fresh).state_dict()), 4)
        used = self._torch_fsdp(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)))
        used.state_dict()
        again = self._torch_fsdp(used)
        with self.assertRaisesRegex(AssertionError, "should not have been set yet"):
            again.state_dict()

    def test_summon_with_grads_gives_frozen_parameters_gradients(self) -> None:
        """use_orig_params=True, a frozen Linear in the unit, after a backward: outside
        a summon its .grad is None, inside summon_full_params(with_grads=True) torch
        gives it a zero gradient."""
        import torch.distributed.fsdp as torch_fsdp

        net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        net[1].requires_grad_(False)
        model = self._torch_fsdp(net, use_orig_params=True)
        model(torch.ones(2, 2)).sum().backward()
        self.assertIsNone(net[1].weight.grad)
        with torch_fsdp.FullyShardedDataParallel.summon_full_params(model, with_grads=True):
            grad = net[1].weight.grad
            self.assertIsNotNone(grad)
            self.assertEqual(grad, torch.zeros(2, 2))

    def test_state_dict_inside_summon_rank0_only_or_local(self) -> None:
        """Inside summon_full_params: a FULL_STATE_DICT with rank0_only raises KeyError
        on ranks != 0, a LOCAL_STATE_DICT raises everywhere (a plain FULL_STATE_DICT
        works; the rank0_only summon is pinned in suites/test_torch_conformance.py::
        TestTorchConformance::test_state_dict_inside_rank0_only_summon)."""
        import torch.distributed.fsdp as torch_fsdp

        fsdp = torch_fsdp.FullyShardedDataParallel
        full = torch_fsdp.StateDictType.FULL_STATE_DICT
        model = self._torch_fsdp(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)))
        with fsdp.summon_full_params(model):
            with fsdp.state_dict_type(model, full):
                self.assertEqual(
                    sorted(model.state_dict()), ["0.bias", "0.weight", "1.bias", "1.weight"]
                )
            config = torch_fsdp.FullStateDictConfig(rank0_only=True)
            with fsdp.state_dict_type(model, full, config):
                if self.rank == 0:
                    self.assertEqual(len(model.state_dict()), 4)
                else:
                    with self.assertRaisesRegex(KeyError, "_flat_param"):
                        model.state_dict()
            with fsdp.state_dict_type(model, torch_fsdp.StateDictType.LOCAL_STATE_DICT):
                with self.assertRaises(ValueError):
                    model.state_dict()

    def test_use_dtensor_without_a_device_mesh(self) -> None:
        """The private _use_dtensor=True without a device mesh: state_dict() fails on a
        None mesh's ndim, optim_state_dict on a None _device_mesh (with the default
        configs both save)."""
        import torch.distributed.fsdp as torch_fsdp

        fsdp, sharded = (
            torch_fsdp.FullyShardedDataParallel,
            torch_fsdp.StateDictType.SHARDED_STATE_DICT,
        )
        model = self._torch_fsdp(
            nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)), use_orig_params=True
        )
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.ones(2, 2)).sum().backward()
        optim.step()
        with fsdp.state_dict_type(model, sharded):
            self.assertEqual(len(model.state_dict()), 4)
            self.assertEqual(len(fsdp.optim_state_dict(model, optim)["state"]), 4)
        config = torch_fsdp.ShardedStateDictConfig(_use_dtensor=True)
        with fsdp.state_dict_type(model, sharded, config):
            with self.assertRaisesRegex(
                AttributeError, "'NoneType' object has no attribute 'ndim'"
            ):
                model.state_dict()
        optim_config = torch_fsdp.ShardedOptimStateDictConfig(_use_dtensor=True)
        with fsdp.state_dict_type(model, sharded, None, optim_config):
            with self.assertRaisesRegex(AssertionError, "_device_mesh to be not None"):
                fsdp.optim_state_dict(model, optim)

    def _no_shard(self, precision: object) -> nn.Module:
        import torch.distributed.fsdp as torch_fsdp

        torch.manual_seed(0)
        return self._torch_fsdp(
            nn.Linear(2, 2),
            sharding_strategy=torch_fsdp.ShardingStrategy.NO_SHARD,
            mixed_precision=precision,
        )

    def test_no_shard_hook_is_handed_the_accumulated_gradient(self) -> None:
        """NO_SHARD, fp16 params and reduction or full precision, every rank the same input: a second
        backward without zero_grad hands the hook twice the first backward's
        gradient (the reduced one again plus the new one); after zero_grad the
        same gradient as the first."""
        import torch.distributed.fsdp as torch_fsdp

        low = torch_fsdp.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16)
        for precision in (low, None):
            self._check_hook_handed_accumulated(precision)

    def _check_hook_handed_accumulated(self, precision: object) -> None:
        model = self._no_shard(precision)
        handed: list[torch.Tensor] = []

        def hook(state: object, grad: torch.Tensor) -> None:
            handed.append(grad.detach().float().clone())
            torch.distributed.all_reduce(grad)
            grad.div_(torch.distributed.get_world_size())

        model.register_comm_hook(None, hook)
        for zero_grad in (False, False, True):
            if zero_grad:
                model.zero_grad(set_to_none=True)
            model(torch.ones(1, 2)).sum().backward()
        first, second, fresh = handed
        self.assertGreater(float(first.abs().sum()), 0.0)
        torch.testing.assert_close(second, 2 * first, rtol=1e-2, atol=1e-3)
        torch.testing.assert_close(fresh, first, rtol=1e-2, atol=1e-3)

    def test_no_shard_no_sync_onto_a_full_precision_gradient(self) -> None:
        """NO_SHARD with a bf16 param_dtype: a backward under no_sync onto the zeroed
        float32 gradient of a synced backward leaves .grad float32; from no
        gradient, the window's gradient is bfloat16. With an fp16 reduce_dtype and
        keep_low_precision_grads, onto the kept fp16 gradient it stays float16."""
        import torch.distributed.fsdp as torch_fsdp

        params = torch_fsdp.MixedPrecision(param_dtype=torch.bfloat16)
        kept = torch_fsdp.MixedPrecision(reduce_dtype=torch.float16, keep_low_precision_grads=True)
        cases = (
            (params, False, torch.float32),
            (params, True, torch.bfloat16),
            (kept, False, torch.float16),  # the kept low-precision reduced gradient's dtype
        )
        for precision, set_to_none, dtype in cases:
            model = self._no_shard(precision)
            model(torch.ones(1, 2)).sum().backward()
            model.zero_grad(set_to_none=set_to_none)
            with model.no_sync():
                model(torch.ones(1, 2)).sum().backward()
            grads = {p.grad.dtype for p in model.parameters()}
            self.assertEqual(grads, {dtype}, f"{precision}, set_to_none={set_to_none}")

    def test_local_load_keeps_a_stale_unsharded_parameter(self) -> None:
        """SHARD_GRAD_OP: after a no_grad forward, loading another model's
        LOCAL_STATE_DICT and summoning shows the values from before the load;
        without the forward, the loaded ones."""
        import torch.distributed.fsdp as torch_fsdp

        fsdp = torch_fsdp.FullyShardedDataParallel
        local = torch_fsdp.StateDictType.LOCAL_STATE_DICT

        def build(seed: int) -> nn.Module:
            torch.manual_seed(seed)
            return self._torch_fsdp(
                nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)),
                sharding_strategy=torch_fsdp.ShardingStrategy.SHARD_GRAD_OP,
            )

        def full(model: nn.Module) -> torch.Tensor:
            with fsdp.summon_full_params(model):
                return torch.cat([p.detach().flatten().clone() for p in model.parameters()])

        source = build(1)
        with fsdp.state_dict_type(source, local):
            saved = source.state_dict()
        for forward_first in (True, False):
            target = build(0)
            before = full(target)
            if forward_first:
                with torch.no_grad():
                    target(torch.ones(1, 2))
            with fsdp.state_dict_type(target, local):
                target.load_state_dict(saved)
            expected = before if forward_first else full(source)
            self.assertEqual(full(target), expected, f"forward_first={forward_first}")

    def test_replaced_data_is_lost_while_unsharded_is_kept(self) -> None:
        """SHARD_GRAD_OP, use_orig_params: after a no_grad forward, `p.data = p * 0.5`
        of every original parameter is not seen by summon_full_params, nor after
        it; without the forward, it is."""
        import torch.distributed.fsdp as torch_fsdp

        fsdp = torch_fsdp.FullyShardedDataParallel

        def full(model: nn.Module) -> torch.Tensor:
            with fsdp.summon_full_params(model):
                return torch.cat([p.detach().flatten().clone() for p in model.parameters()])

        for forward_first in (True, False):
            torch.manual_seed(0)
            model = self._torch_fsdp(
                nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)),
                sharding_strategy=torch_fsdp.ShardingStrategy.SHARD_GRAD_OP,
                use_orig_params=True,
            )
            before = full(model)
            if forward_first:
                with torch.no_grad():
                    model(torch.ones(1, 2))
            for param in model.parameters():
                param.data = param.detach().clone().mul_(0.5)
            expected = before if forward_first else before * 0.5
            self.assertEqual(full(model), expected, f"forward_first={forward_first}")
            self.assertEqual(full(model), expected, f"after, forward_first={forward_first}")

    def test_summon_with_grads_after_a_no_sync_backward(self) -> None:
        """SUMMON_WITH_GRADS_AFTER_NO_SYNC_BACKWARD: a backward inside no_sync, then
        summon_full_params(with_grads=True): torch asserts; before the backward, not."""
        import torch.distributed.fsdp as torch_fsdp

        fsdp = torch_fsdp.FullyShardedDataParallel
        model = self._torch_fsdp(
            nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)), use_orig_params=True
        )
        with model.no_sync():
            with fsdp.summon_full_params(model, with_grads=True):
                pass
            model(torch.ones(2, 3)).sum().backward()
            with self.assertRaisesRegex(AssertionError, "Expects tensor to be sharded"):
                with fsdp.summon_full_params(model, with_grads=True):
                    pass

    def test_zero_grad_after_a_no_sync_backward_keeps_the_set_aside_gradient(self) -> None:
        """ZERO_GRAD_KEEPS_GRADIENT_SET_ASIDE_BY_NO_SYNC: a synced backward, one under
        no_sync, zero_grad(set_to_none=True), one synced backward: torch's gradient is
        that of the first backward and the last (2g: the parameters do not change),
        where it is the last one's alone (g) without the window."""
        for use_orig_params in (False, True):
            model = self._torch_fsdp(
                nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)), use_orig_params=use_orig_params
            )
            once = _last_backward(model, window=False)
            kept = _last_backward(model, window=True)
            self.assertTrue(any(g is not None and g.numel() for g in once))
            for grad, doubled in zip(once, kept, strict=True):
                self.assertEqual(doubled, None if grad is None else 2 * grad, f"{use_orig_params=}")

    def test_user_gradient_hidden_after_a_none_writeback(self) -> None:
        """USER_GRADIENT_HIDDEN_AFTER_A_NONE_WRITEBACK: a unit per linear (not the
        root, which keeps its parameters after forward); the first weight's gradient
        set alone, a forward (the writeback marks its bias None), every gradient
        set, a forward: the bias shows None where it is in the rank's shard (every
        rank under NO_SHARD), and the backward's gradient lacks the user's value."""
        import torch.distributed.fsdp as torch_fsdp

        strategies = [torch_fsdp.ShardingStrategy.FULL_SHARD, torch_fsdp.ShardingStrategy.NO_SHARD]
        self.run_subtests({"sharding_strategy": strategies}, self._check_hidden_gradient)

    def _check_hidden_gradient(self, sharding_strategy: object) -> None:
        import torch.distributed.fsdp as torch_fsdp
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        def build() -> nn.Module:
            torch.manual_seed(0)
            return self._torch_fsdp(
                nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)),
                use_orig_params=True,
                auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                sharding_strategy=sharding_strategy,
            )

        model, x = build(), torch.ones(2, 3)
        weight, bias = list(model.parameters())[:2]
        held = self.rank == 1 or sharding_strategy is torch_fsdp.ShardingStrategy.NO_SHARD
        self.assertEqual(bias.numel(), 3 if held else 0)  # FULL_SHARD: 12 elements, 6 a rank
        weight.grad = torch.full_like(weight, 0.25)
        with torch.no_grad():
            model(x)
        for param in model.parameters():
            param.grad = torch.full_like(param, 0.25)
        loss = model(x).sum()
        self.assertIsNone(bias.grad)
        loss.backward()
        fresh = build()
        fresh(x).sum().backward()
        self.assertEqual(bias.grad, list(fresh.parameters())[1].grad)

    def test_optim_state_of_some_parameters_of_a_unit(self) -> None:
        """OPTIM_STATE_OF_SOME_PARAMETERS_OF_A_UNIT: use_orig_params, SGD with momentum
        stepped while the first parameter's gradient is None: optim_state_dict raises."""
        import torch.distributed.fsdp as torch_fsdp

        model = self._torch_fsdp(
            nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)), use_orig_params=True
        )
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        params = list(model.parameters())
        for param in params[1:]:
            param.grad = torch.full_like(param, 0.25)
        optim.step()
        with self.assertRaisesRegex(RuntimeError, "is not in the optimizer state"):
            torch_fsdp.FullyShardedDataParallel.optim_state_dict(model, optim)

    def test_user_gradients_with_kept_low_precision_gradients(self) -> None:
        """USER_GRADIENTS_WITH_KEPT_LOW_PRECISION: use_orig_params, gradients kept in a
        low precision (fp16 parameters; NO_SHARD with a bf16 reduce_dtype alone): after a
        backward, a user's full-precision gradients make the next
        summon_full_params raise (a grad_dtype error)."""
        import torch.distributed.fsdp as torch_fsdp

        strategy = torch_fsdp.ShardingStrategy
        cases = {
            strategy.FULL_SHARD: {"param_dtype": torch.float16},
            strategy.NO_SHARD: {"reduce_dtype": torch.bfloat16},
        }
        for sharding_strategy, low in cases.items():
            model = self._torch_fsdp(
                nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)),
                use_orig_params=True,
                sharding_strategy=sharding_strategy,
                mixed_precision=torch_fsdp.MixedPrecision(**low, keep_low_precision_grads=True),
            )
            model(torch.ones(2, 3)).sum().backward()
            for param in model.parameters():
                param.grad = torch.full_like(param, 0.25)
            with self.assertRaisesRegex(RuntimeError, "grad_dtype", msg=str(low)):
                with torch_fsdp.FullyShardedDataParallel.summon_full_params(model):
                    pass


def _last_backward(model: nn.Module, window: bool) -> list[torch.Tensor | None]:
    """The gradients after ``zero_grad(set_to_none=True)`` and a synced backward;
    with ``window``, a synced backward and one under no_sync come before it."""
    x = torch.ones(2, 3)
    if window:
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
        with model.no_sync():  # type: ignore[operator]
            model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


class TestTorchLimitationsAnywhere(FSDPTest):
    """Torch's FSDP (``torch.distributed.fsdp`` itself) where its behaviour depends on
    the ranks' device: each test asserts both sides of the boundary."""

    world_size = 2

    def test_local_state_dict_offload(self) -> None:
        """LOCAL_STATE_DICT_OFFLOAD_ON_ACCELERATOR: raises on accelerator ranks, saves
        CPU local shards on CPU ranks."""
        import torch.distributed.fsdp as torch_fsdp

        fsdp = torch_fsdp.FullyShardedDataParallel
        module = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)).to(current_device())
        model = fsdp(module, device_id=current_device())
        model(torch.ones(2, 3, device=current_device())).sum().backward()
        config = torch_fsdp.LocalStateDictConfig(offload_to_cpu=True)
        with fsdp.state_dict_type(model, torch_fsdp.StateDictType.LOCAL_STATE_DICT, config):
            if current_device().type != "cpu":
                with self.assertRaisesRegex(ValueError, "requires_grad property is incompatible"):
                    model.state_dict()
                return
            state_dict = model.state_dict()
        for shard in state_dict["_flat_param"].local_shards():
            self.assertEqual(shard.tensor.device, torch.device("cpu"))

    def test_unsharded_orig_param_optim_state_offload(self) -> None:
        """UNSHARDED_ORIG_PARAM_OPTIM_STATE_NOT_OFFLOADED: NO_SHARD, use_orig_params,
        an Adam step, optim_state_dict under the default FullOptimStateDictConfig
        (offload_to_cpu=True): the states stay on the ranks' device (on CPU ranks
        the CPU); with flat parameters they go to the CPU."""
        import torch.distributed.fsdp as torch_fsdp

        fsdp = torch_fsdp.FullyShardedDataParallel
        device = current_device()
        for use_orig_params in (True, False):
            model = fsdp(
                nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)).to(device),
                device_id=device,
                use_orig_params=use_orig_params,
                sharding_strategy=torch_fsdp.ShardingStrategy.NO_SHARD,
            )
            optim = torch.optim.Adam(model.parameters(), lr=0.1)
            model(torch.ones(2, 3, device=device)).sum().backward()
            optim.step()
            saved = fsdp.optim_state_dict(model, optim)
            devices = {
                value.device
                for state in saved["state"].values()
                for value in state.values()
                if torch.is_tensor(value) and value.dim() > 0
            }
            expected = device if use_orig_params else torch.device("cpu")
            self.assertEqual(devices, {expected}, f"{use_orig_params=}")

    def test_hybrid_sync_module_states_order(self) -> None:
        """HYBRID_SYNC_ORDER_BEFORE_TORCH_2_13: the broadcasts of sync_module_states
        for HYBRID_SHARD over a (1, 2) mesh (the replicate group is each rank alone),
        a Linear and a BatchNorm: before torch 2.13, the buffers and parameters over
        the shard group, then the parameters over the replicate group; from 2.13, the
        replicate group first, then the buffers again with the parameters over the
        shard group. Torch cannot sync module states on CPU ranks
        (TestTorchLimitations::test_sync_module_states_on_cpu_ranks)."""
        import torch.distributed.fsdp as torch_fsdp
        from torch.distributed.device_mesh import init_device_mesh

        from fsdptest.conformance.observe import Collectives
        from fsdptest.conformance.target import torch_before_2_13

        device = current_device()
        if device.type == "cpu":
            pytest.skip("torch's FSDP syncs module states on accelerator ranks only")
        mesh = init_device_mesh(device.type, (1, 2))
        module = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).to(device)
        with Collectives() as collectives:
            torch_fsdp.FullyShardedDataParallel(
                module,
                device_mesh=mesh,
                sharding_strategy=torch_fsdp.ShardingStrategy.HYBRID_SHARD,
                sync_module_states=True,
            )
        broadcasts = [(c.input_numel, c.group) for c in collectives.take() if c.kind == "BROADCAST"]
        shard, replicate = (0, 1), (self.rank,)
        buffers = [(3, shard), (3, shard), (1, shard)]  # running mean, running var, count
        params = [(9, shard), (3, shard), (3, shard), (3, shard)]
        if torch_before_2_13():
            expected = buffers + params + [(n, replicate) for n, _ in params]
        else:
            expected = [(n, replicate) for n, _ in buffers + params] + buffers + params
        self.assertEqual(broadcasts, expected)

    def test_scaler_agreement_per_device(self) -> None:
        """SCALER_FOUND_INF_AGREEMENT: torch's ShardedGradScaler.unscale_ all-reduces one
        flag per gradient device: two on accelerator ranks with an offloaded unit
        beside an ignored module (whose gradients stay on the device), one on CPU
        ranks (torch cannot offload there: every gradient is on the CPU). This
        project's scaler all-reduces once in both."""
        import torch.distributed.fsdp as torch_fsdp
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        import fsdp as ours
        from fsdp.sharded_grad_scaler import ShardedGradScaler as OurScaler
        from fsdptest.conformance.observe import Collectives

        device = current_device()
        expected = {torch_fsdp: 1 if device.type == "cpu" else 2, ours: 1}
        for impl, count in expected.items():
            module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)).to(device)
            model = impl.FullyShardedDataParallel(
                module,
                device_id=device,
                ignored_modules=[module[0]],
                cpu_offload=impl.CPUOffload(offload_params=device.type != "cpu"),
            )
            optim = torch.optim.SGD(model.parameters(), lr=0.1)
            scaler = (ShardedGradScaler if impl is torch_fsdp else OurScaler)(device=device.type)
            scaler.scale(model(torch.ones(2, 2, device=device)).sum()).backward()
            with Collectives() as collectives:
                scaler.unscale_(optim)
            calls = [(c.kind, c.dtype, c.input_numel) for c in collectives.take()]
            self.assertEqual(calls, [("ALL_REDUCE", "torch.float32", 1)] * count, impl.__name__)

    def test_offloaded_edits_before_the_first_reshard(self) -> None:
        """OFFLOADED_EDITS_BEFORE_FIRST_RESHARD: parameter offload, the lazy
        initialisation (entering no_sync), an in-place edit of the flat parameter:
        on accelerator ranks the edit is lost at the first reshard (after a forward
        and backward, no optimizer step, the parameter is the unedited one); on CPU
        ranks torch's lazy initialisation cannot pin the offloaded shard."""
        import torch.distributed.fsdp as torch_fsdp

        device = current_device()
        torch.manual_seed(0)
        model = torch_fsdp.FullyShardedDataParallel(
            nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)).to(device),
            device_id=device,
            cpu_offload=torch_fsdp.CPUOffload(offload_params=True),
        )
        if device.type == "cpu":
            with self.assertRaisesRegex(RuntimeError, TORCH_CPU_OFFLOAD_ERROR):
                with model.no_sync():  # type: ignore[operator]
                    pass
            return
        with model.no_sync():  # type: ignore[operator]
            pass
        (flat,) = list(model.parameters())
        before = flat.detach().clone()
        with torch.no_grad():
            flat.mul_(0.5)
        model(torch.ones(2, 2, device=device)).sum().backward()
        (flat,) = list(model.parameters())
        self.assertEqual(flat.detach(), before)

    def test_cast_buffers_saved_on_the_device(self) -> None:
        """CAST_BUFFERS_SAVED_ON_THE_DEVICE: a BatchNorm's buffers under
        MixedPrecision(buffer_dtype=float16), a SHARDED_STATE_DICT with
        offload_to_cpu=True: saved in float32 on the ranks' device (the CPU on CPU
        ranks, where offloading and the device agree)."""
        import torch.distributed.fsdp as torch_fsdp

        fsdp = torch_fsdp.FullyShardedDataParallel
        device = current_device()
        model = fsdp(
            nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).to(device),
            device_id=device,
            mixed_precision=torch_fsdp.MixedPrecision(buffer_dtype=torch.float16),
        )
        config = torch_fsdp.ShardedStateDictConfig(offload_to_cpu=True)
        with fsdp.state_dict_type(model, torch_fsdp.StateDictType.SHARDED_STATE_DICT, config):
            saved = model.state_dict()
        mean = saved["1.running_mean"]
        self.assertEqual((mean.dtype, mean.device.type), (torch.float32, device.type))
        self.assertEqual(saved["0.weight"].local_shards()[0].tensor.device.type, "cpu")

    def test_offloaded_orig_params_before_backward(self) -> None:
        """OFFLOADED_ORIG_PARAMS_SHOW_ZERO_GRADIENTS: after a forward, the parameters of
        the rank's shard have zero gradients on accelerator ranks; on CPU ranks torch
        cannot offload (it fails when first used)."""
        import torch.distributed.fsdp as torch_fsdp

        module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)).to(current_device())
        model = torch_fsdp.FullyShardedDataParallel(
            module,
            device_id=current_device(),
            use_orig_params=True,
            cpu_offload=torch_fsdp.CPUOffload(offload_params=True),
        )
        batch = torch.ones(2, 2, device=current_device())
        if current_device().type == "cpu":
            with self.assertRaisesRegex(RuntimeError, TORCH_CPU_OFFLOAD_ERROR):
                model(batch)
            return
        model(batch)
        grads = [p.grad for p in model.parameters() if p.numel() > 0]
        self.assertTrue(grads and all(g is not None and not g.any() for g in grads), grads)

    def test_offloaded_low_precision_gradient_second_backward(self) -> None:
        """OFFLOADED_LOW_PRECISION_GRADIENT_SECOND_BACKWARD: SHARD_GRAD_OP, parameter
        offload, bf16 parameters and gradients kept in bf16: on accelerator ranks the
        second backward raises; on CPU ranks torch cannot offload."""
        import torch.distributed.fsdp as torch_fsdp

        device = current_device()
        model = torch_fsdp.FullyShardedDataParallel(
            nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)).to(device),
            device_id=device,
            sharding_strategy=torch_fsdp.ShardingStrategy.SHARD_GRAD_OP,
            cpu_offload=torch_fsdp.CPUOffload(offload_params=True),
            mixed_precision=torch_fsdp.MixedPrecision(
                param_dtype=torch.bfloat16,
                reduce_dtype=torch.bfloat16,
                keep_low_precision_grads=True,
            ),
        )
        batch = torch.ones(2, 2, device=device)
        if device.type == "cpu":
            with self.assertRaisesRegex(RuntimeError, TORCH_CPU_OFFLOAD_ERROR):
                model(batch)
            return
        model(batch).sum().backward()
        model.zero_grad(set_to_none=True)
        with self.assertRaisesRegex(RuntimeError, "grad_dtype"):
            model(batch).sum().backward()


class TestRecorder(FSDPTest):
    """The recorder sees the collectives torch issues outside ``torch.distributed``'s
    public names ([Note: Collectives as observed])."""

    world_size = 2

    def test_coalesced_broadcast_is_recorded_as_broadcasts(self) -> None:
        """torch's sync_module_states path (dist._broadcast_coalesced, on accelerators
        only) records as a broadcast per tensor, as broadcasting them one by one does."""
        import torch.distributed as dist

        from fsdptest.conformance.observe import Collectives

        device = current_device()
        tensors = [
            torch.full((3,), float(self.rank), device=device),
            torch.arange(4, device=device) + self.rank,
        ]
        with Collectives() as coalesced:
            dist._broadcast_coalesced(dist.group.WORLD, tensors, 1 << 20, 0)
        self.assertEqual(tensors[0].tolist(), [0.0] * 3)  # it broadcast rank 0's
        self.assertEqual(tensors[1].tolist(), [0, 1, 2, 3])
        with Collectives() as single:
            for tensor in tensors:
                dist.broadcast(tensor, src=0)
        recorded = coalesced.take()
        self.assertEqual(recorded, single.take())
        self.assertEqual(
            [(c.kind, c.dtype, c.input_numel) for c in recorded],
            [("BROADCAST", "torch.float32", 3), ("BROADCAST", "torch.int64", 4)],
        )

    def test_dtensor_redistribution_is_recorded(self) -> None:
        """DTensor's full_tensor() all-gathers through the functional collectives:
        recorded as an all-gather of the (padded) local shard over the mesh."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        from fsdptest.conformance.observe import Collectives

        device = current_device()
        mesh = init_device_mesh(device.type, (2,))
        value = distribute_tensor(torch.arange(6.0, device=device).reshape(3, 2), mesh, [Shard(0)])
        with Collectives() as collectives:
            full = value.full_tensor()
        self.assertEqual(full.tolist(), [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]])
        recorded = [
            (c.kind, c.dtype, c.input_numel, c.output_numel, c.group) for c in collectives.take()
        ]
        self.assertEqual(recorded, [("ALL_GATHER", "torch.float32", 4, 8, (0, 1))])


@pytest.mark.parametrize("name", sorted([*allowed.UNASKED, *allowed.PENDING_UNASKED]))
def test_unasked_entries_name_their_evidence(name: str) -> None:
    """Each entry's evidence is a test that exists (or, for the limitations asserted
    elsewhere, a file that does)."""
    entry = allowed.UNASKED.get(name) or allowed.PENDING_UNASKED[name]
    evidence = entry.evidence
    path, _, rest = evidence.partition("::")
    path = path.split(" ")[0]
    assert (ROOT / path).is_file(), f"{name}: {path} does not exist"
    if rest:
        module = importlib.import_module(path[: -len(".py")].replace("/", "."))
        target: object = module
        for part in rest.split("::"):
            assert hasattr(target, part), f"{name}: {evidence} does not exist"
            target = getattr(target, part)


def test_every_entry_has_a_witness() -> None:
    """No entry goes unasserted."""
    assert set(NORMALISED_WITNESSES) == set(allowed.NORMALISED)
    assert set(PENDING_WITNESSES) == set(allowed.PENDING)
    assert set(PENDING_UNASKED_WITNESSES) == set(allowed.PENDING_UNASKED)
