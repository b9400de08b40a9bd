"""``FSDPModule``: the class swap, the sharded layout, and every method of torch's
``FSDPModule``, each checked against torch's ``fully_shard`` doing the same
(exact) or against what the method promises."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from harness import DistributedTest
from harness.collectives import Collective, CollectiveRecorder
from tests.fsdp.fully_shard_cases import (
    IMPLEMENTATIONS,
    OURS,
    TORCH,
    assert_same_params,
    local_batch,
    lockstep,
    loss_of,
    model,
    shard_layers,
    twins,
)


def _sharded(api: SimpleNamespace, device: torch.device, **kwargs: Any) -> nn.Sequential:
    return shard_layers(model(device), api, **kwargs)


# torch 2.11's fully_shard([a, b]) gathers the group again for a module that runs after the
# root's forward (the head per chunk); 2.13's, like ours, gathers it once in forward
# (docs/runs/gpu-runs.md, run 77).
GROUPED_GATHERS_AS_2_13 = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)


def _gathers(recorder: CollectiveRecorder) -> list[int]:
    return [call.output_numel for call in recorder.of(Collective.ALL_GATHER)]


class TestFullyShardModule(DistributedTest):
    world_size = 2

    def test_class_swap_and_sharded_layout(self) -> None:
        """The module becomes an FSDP<Class> (an FSDPModule and still its class);
        each parameter a Shard(0) DTensor whose local tensor is torch.chunk's
        piece, on a buffer padded to rank 0's piece (zero padding), as torch's;
        slicing builds a plain module; deepcopy is refused."""
        ours, theirs = twins(lambda api: _sharded(api, self.device))
        self.assertEqual(type(ours).__name__, "FSDPSequential")
        self.assertTrue(isinstance(ours, OURS.FSDPModule) and isinstance(ours, nn.Sequential))
        assert_same_params(self, ours, theirs, grads=False)
        for param, full in zip(ours.parameters(), model(self.device).parameters()):
            assert isinstance(param, DTensor)
            self.assertEqual(param.placements, (Shard(0),))
            self.assertEqual(param.full_tensor(), full.detach(), atol=0, rtol=0)
            rows = math.ceil(full.size(0) / self.world_size)
            row = full[0].numel()
            storage = param.to_local().untyped_storage()
            self.assertEqual(storage.size(), rows * row * full.element_size())
            padded = torch.empty(0, dtype=full.dtype, device=self.device).set_(storage)
            self.assertEqual(padded[param.to_local().numel() :].count_nonzero().item(), 0)
        self.assertIs(type(ours[0:2]), nn.Sequential)
        with self.assertRaisesRegex(AssertionError, "FSDP does not support deepcopy"):
            copy.deepcopy(ours)

    def test_unshard_and_reshard_by_hand(self) -> None:
        """unshard(async_op=True) returns a handle whose wait registers the full
        parameters; reshard registers the shards again; a forward after an
        unshard issues no all-gather of its own."""
        module = OURS.fully_shard(model(self.device), reshard_after_forward=True)
        handle = module.unshard(async_op=True)
        self.assertIsInstance(handle, OURS.UnshardHandle)
        handle.wait()
        for param, full in zip(module.parameters(), model(self.device).parameters()):
            self.assertFalse(isinstance(param, DTensor))
            self.assertEqual(param, full, atol=0, rtol=0)
        module.reshard()
        self.assertTrue(all(isinstance(p, DTensor) for p in module.parameters()))
        self.assertIsNone(module.unshard())
        with CollectiveRecorder() as recorder:
            module(local_batch(self, 0))
        self.assertEqual(_gathers(recorder), [])
        self.assertTrue(all(isinstance(p, DTensor) for p in module.parameters()))

    def test_gradient_accumulation_without_sync(self) -> None:
        """Microbatches under set_requires_gradient_sync(False), then one with sync:
        no reduce-scatter before the last, the same gradients as torch's, and
        those of the whole batch."""
        self.run_subtests({"precision": ["fp32", "bf16-reduce-fp32"]}, self._check_accumulation)

    def _check_accumulation(self, precision: str) -> None:
        kwargs: dict[str, Any] = {}
        if precision != "fp32":
            policy = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
            kwargs = {"mp_policy": policy}
        models = [_sharded(api, self.device, **_policies(api, kwargs)) for api in IMPLEMENTATIONS]
        x = local_batch(self, 0)
        for sharded in models:
            with CollectiveRecorder() as recorder:
                sharded.set_requires_gradient_sync(False)
                loss_of(sharded, x[:2]).backward()
                sharded.set_requires_gradient_sync(True)
                loss_of(sharded, x[2:]).backward()
            scatters = recorder.of(Collective.REDUCE_SCATTER)
            self.assertEqual(len(scatters), 3)  # the last backward's only
        assert_same_params(self, models[0], models[1])
        if precision == "fp32":
            whole = _sharded(OURS, self.device)
            loss_of(whole, x).backward()
            for accumulated, once in zip(models[0].parameters(), whole.parameters()):
                # two sums of two rows against one of four: another order of additions
                self.assertEqual(
                    accumulated.grad.to_local(), once.grad.to_local(), atol=1e-5, rtol=1e-5
                )

    def test_reshard_after_backward_off(self) -> None:
        """set_reshard_after_backward(False): the parameters stay unsharded after
        backward and the next forward all-gathers nothing."""
        for api in IMPLEMENTATIONS:
            sharded = _sharded(api, self.device)
            sharded.set_reshard_after_backward(False)
            loss_of(sharded, local_batch(self, 0)).backward()
            self.assertFalse(any(isinstance(p, DTensor) for p in sharded.parameters()), api.name)
            with CollectiveRecorder() as recorder:
                sharded(local_batch(self, 1))
            self.assertEqual(_gathers(recorder), [], api.name)

    def test_set_reshard_after_forward(self) -> None:
        """True reshards the root after forward too (it keeps its parameters by
        default), False keeps every module unsharded; a non-bool is refused."""
        for api in IMPLEMENTATIONS:
            root = api.fully_shard(model(self.device))
            root(local_batch(self, 0))
            self.assertFalse(any(isinstance(p, DTensor) for p in root.parameters()), api.name)
            root.reshard()
            root.set_reshard_after_forward(True)
            root(local_batch(self, 0))
            self.assertTrue(all(isinstance(p, DTensor) for p in root.parameters()), api.name)
            with self.assertRaisesRegex(ValueError, "reshard_after_forward should be a bool"):
                root.set_reshard_after_forward(2)  # type: ignore[arg-type]

    def test_explicit_prefetch_matches_torch(self) -> None:
        """set_modules_to_forward_prefetch / set_modules_to_backward_prefetch: the
        all-gathers come in torch's order, and training is torch's."""
        traces, models = [], []
        for api in IMPLEMENTATIONS:
            sharded = _sharded(api, self.device, reshard_after_forward=True)
            layers = [sharded[0], sharded[2], sharded[3]]
            layers[0].set_modules_to_forward_prefetch([layers[1], layers[2]])
            layers[2].set_modules_to_backward_prefetch([layers[1], layers[0]])
            with CollectiveRecorder() as recorder:
                loss_of(sharded, local_batch(self, 0)).backward()
            traces.append(_gathers(recorder))
            models.append(sharded)
        self.assertEqual(traces[0], traces[1])
        assert_same_params(self, models[0], models[1])
        with self.assertRaisesRegex(ValueError, "Expects FSDPModule but got"):
            models[0].set_modules_to_forward_prefetch([nn.Linear(2, 2)])

    def test_gradient_divide_factor(self) -> None:
        """The loss sum(weights) gives every rank a gradient of ones: reduced, the
        gradient is world / factor (the mean, 1, without a factor), also with
        sums only and through the deprecated name."""
        config = {"factor": [None, 1.0, 8.0], "sum_only": [False, True], "alias": [False, True]}
        self.run_subtests(config, self._check_divide_factor)

    def _check_divide_factor(self, factor: float | None, sum_only: bool, alias: bool) -> None:
        sharded = OURS.fully_shard(_ParamSum().to(self.device))
        if factor is not None:
            setter = (
                sharded.set_reduce_scatter_divide_factor
                if alias
                else sharded.set_gradient_divide_factor
            )
            setter(factor)
        sharded.set_force_sum_reduction_for_comms(sum_only)
        sharded(local_batch(self, 0)).backward()
        expected = self.world_size / factor if factor is not None else 1.0
        for param in sharded.parameters():
            grad = param.grad.to_local()
            self.assertEqual(grad, torch.full_like(grad, expected), atol=0, rtol=0)

    def test_register_fsdp_forward_method(self) -> None:
        """A registered method unshards before and reshards after, as forward does;
        an unknown method is refused; a plain module is left alone."""
        outputs = []
        for api in IMPLEMENTATIONS:
            sharded = _WithGenerate().to(self.device)
            api.fully_shard(sharded, reshard_after_forward=True)
            api.register_fsdp_forward_method(sharded, "generate")
            outputs.append(sharded.generate(local_batch(self, 0, features=4)))
            self.assertTrue(all(isinstance(p, DTensor) for p in sharded.parameters()))
            with self.assertRaisesRegex(ValueError, "does not have a method missing"):
                api.register_fsdp_forward_method(sharded, "missing")
        self.assertEqual(outputs[0], outputs[1], atol=0, rtol=0)
        OURS.register_fsdp_forward_method(nn.Linear(2, 2), "forward")  # a no-op

    def test_unshard_in_backward_off(self) -> None:
        """set_unshard_in_backward(False) on a module whose backward needs no
        parameter of its own (an embedding): backward all-gathers it no more, and
        gradients are torch's."""
        traces, models = [], []
        for api in IMPLEMENTATIONS:
            torch.manual_seed(0)
            net = nn.Sequential(nn.Embedding(9, 4), nn.Linear(4, 5)).to(self.device)
            api.fully_shard(net[0], reshard_after_forward=True)
            api.fully_shard(net[1], reshard_after_forward=True)
            api.fully_shard(net)
            net[0].set_unshard_in_backward(False)
            tokens = torch.arange(4, device=self.device) + self.rank
            with CollectiveRecorder() as recorder:
                net(tokens).sum().backward()
            traces.append(_gathers(recorder))
            models.append(net)
        self.assertEqual(traces[0], traces[1])
        self.assertEqual(len(traces[0]), 3)  # embedding, linear, linear again
        assert_same_params(self, models[0], models[1])

    def test_reduce_scatter_unused_params(self) -> None:
        """A parameter one rank uses and the other does not: with
        set_reduce_scatter_unused_params(True) its zero gradient is reduced too,
        and gradients are torch's."""
        if not hasattr(TORCH.FSDPModule, "set_reduce_scatter_unused_params"):
            pytest.skip(
                f"torch {torch.__version__}'s FSDPModule has no set_reduce_scatter_unused_params"
            )
        models = []
        for api in IMPLEMENTATIONS:
            torch.manual_seed(0)
            net = _Branches().to(self.device)
            api.fully_shard(net)
            net.set_reduce_scatter_unused_params(True)
            net(local_batch(self, 0, features=4), use_second=self.rank == 0).sum().backward()
            models.append(net)
        assert_same_params(self, models[0], models[1])

    def test_all_reduce_hook(self) -> None:
        """set_all_reduce_hook: the hook sees each group's reduced gradient buffer
        once per backward; what it does to it is in the gradients, as torch's."""
        models, calls = [], []
        for api in IMPLEMENTATIONS:
            sharded = api.fully_shard(model(self.device))
            seen: list[int] = []

            def hook(output: torch.Tensor, seen: list[int] = seen) -> None:
                seen.append(output.numel())
                output.mul_(2)

            sharded.set_all_reduce_hook(hook)
            loss_of(sharded, local_batch(self, 0)).backward()
            models.append(sharded)
            calls.append(seen)
        self.assertEqual(calls[0], calls[1])
        self.assertEqual(len(calls[0]), 1)
        assert_same_params(self, models[0], models[1])

    def test_is_last_backward_and_post_optim_event(self) -> None:
        """Microbatches with set_is_last_backward(False) until the last train as
        torch's; a post-optimizer event is accepted and consumed."""
        models = [_sharded(api, self.device) for api in IMPLEMENTATIONS]
        for sharded in models:
            sharded.set_is_last_backward(False)
            loss_of(sharded, local_batch(self, 0)).backward()
            sharded.set_is_last_backward(True)
            loss_of(sharded, local_batch(self, 1)).backward()
        assert_same_params(self, models[0], models[1])
        event = torch.Event(device=self.device) if self.device.type != "cpu" else None
        if event is not None:
            event.record()
            models[0].set_post_optim_event(event)
            lockstep(self, models, steps=1)

    def test_custom_comms_and_separate_reduce_scatter_group(self) -> None:
        """set_custom_all_gather / set_custom_reduce_scatter route the collectives
        through the user's objects; a separate reduce-scatter group over the same
        ranks; training stays torch's."""
        models = [_sharded(api, self.device) for api in IMPLEMENTATIONS]
        counts = {"all_gather": 0, "reduce_scatter": 0}
        layer = models[0][0]
        layer.set_custom_all_gather(_CountingAllGather(counts))
        layer.set_custom_reduce_scatter(_CountingReduceScatter(counts))
        models[0][2].set_separate_reduce_scatter_group()
        with self.assertRaisesRegex(AssertionError, "all gather comm is custom"):
            layer.set_allocate_memory_from_process_group_for_comm(True)
        models[0][3].set_allocate_memory_from_process_group_for_comm(True)
        lockstep(self, models, steps=2)
        self.assertEqual(counts, {"all_gather": 4, "reduce_scatter": 2})

    def test_reset_iter_state_after_a_failed_forward(self) -> None:
        """After an exception in forward, reset_iter_state on the root reshards
        everything, and the next iteration trains as a fresh model does."""
        broken, fresh = _sharded(OURS, self.device), _sharded(OURS, self.device)
        with self.assertRaises(RuntimeError):
            broken(torch.ones(2, 3, device=self.device))  # a wrong feature count
        broken.reset_iter_state()
        self.assertTrue(all(isinstance(p, DTensor) for p in broken.parameters()))
        lockstep(self, [broken, fresh], steps=2)
        with self.assertRaisesRegex(RuntimeError, "must be called on the root"):
            broken[0].reset_iter_state()

    def test_modules_grouped_in_one_call(self) -> None:
        """fully_shard([embedding, head]) with tied weights: one group, both modules
        FSDPModules, one all-gather for both in forward; a head run again after the
        root's forward (per chunk) trains as torch's does."""
        models, traces = [], []
        for api in IMPLEMENTATIONS:
            net = _Tied().to(self.device)
            api.fully_shard(net.body, reshard_after_forward=True)
            api.fully_shard([net.embed, net.head], reshard_after_forward=True)
            api.fully_shard(net)
            self.assertTrue(
                isinstance(net.embed, api.FSDPModule) and isinstance(net.head, api.FSDPModule)
            )
            tokens = torch.arange(6, device=self.device) + self.rank
            with CollectiveRecorder() as recorder:
                hidden = net(tokens)
                loss = sum(net.head(chunk).pow(2).sum() for chunk in hidden.chunk(2))
                loss.backward()
            traces.append(_gathers(recorder))
            models.append(net)
        if GROUPED_GATHERS_AS_2_13:
            self.assertEqual(traces[0], traces[1])
        assert_same_params(self, models[0], models[1])
        with self.assertRaisesRegex(RuntimeError, "requires a single root module"):
            lone = [nn.Linear(2, 2).to(self.device), nn.Linear(2, 2).to(self.device)]
            OURS.fully_shard(lone)
            lone[0](torch.ones(1, 2, device=self.device))

    def test_unsupported_setters_say_so(self) -> None:
        """set_symm_mem_for_comm is not provided (NCCL symmetric memory); the
        reduce-scatter buffer cap is checked as torch checks it."""
        sharded = _sharded(OURS, self.device)
        with self.assertRaisesRegex(NotImplementedError, "symmetric-memory"):
            sharded.set_symm_mem_for_comm()
        with self.assertRaisesRegex(TypeError, "must be an int"):
            sharded.set_reduce_scatter_max_input_buffers(True)
        with self.assertRaisesRegex(ValueError, "must be a positive int"):
            sharded.set_reduce_scatter_max_input_buffers(0)
        sharded.set_reduce_scatter_max_input_buffers(2)


def _policies(api: SimpleNamespace, kwargs: dict[str, Any]) -> dict[str, Any]:
    if "mp_policy" in kwargs:
        return {"mp_policy": api.MixedPrecisionPolicy(**kwargs["mp_policy"])}
    return {}


class _WithGenerate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu() + self.lin.weight.sum()


class _ParamSum(nn.Module):
    """Its output is the sum of its parameters: each gets a gradient of ones."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(p.sum() for p in self.parameters()) + 0 * x.sum()


class _Tied(nn.Module):
    """An embedding and a head sharing their weight; the forward stops before the head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.body(self.embed(tokens))


class _Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 3)
        self.second = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, use_second: bool) -> torch.Tensor:
        out = self.first(x)
        return self.second(out) if use_second else out


class _CountingAllGather:
    """torch's AllGather interface: allocate and call."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: Any, input_tensor: Any, group: Any, async_op: bool = False
    ) -> Any:
        self.counts["all_gather"] += 1
        return dist.all_gather_into_tensor(
            output_tensor, input_tensor, group=group, async_op=async_op
        )


class _CountingReduceScatter(_CountingAllGather):
    """torch's ReduceScatter interface."""

    def __call__(  # type: ignore[override]
        self, output_tensor: Any, input_tensor: Any, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        self.counts["reduce_scatter"] += 1
        return dist.reduce_scatter_tensor(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )
