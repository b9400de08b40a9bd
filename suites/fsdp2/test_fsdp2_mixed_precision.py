"""FSDP2 mixed precision (``MixedPrecisionPolicy``): the compute dtype of the
unsharded parameters, the reduce dtype of every reduce-scatter and all-reduce
(seen through the seams, as upstream's ``reduce_scatter_with_assert`` sees it),
the output dtype, ``cast_forward_inputs``, sharded parameters and gradients kept in
full precision, and training against a reference that computes in the same low
precision. Facts from upstream's ``test_fully_shard_mixed_precision.py``.
The reference: [Note: A low-precision reference] in ``suites/fsdp2/helpers.py``.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdptest.api import MixedPrecisionPolicy, fully_shard
from suites.fsdp2.helpers import (
    LOW_PRECISION_TOL,
    LR,
    STEPS,
    CollectiveLog,
    FSDP2Test,
    LowPrecisionReference,
    assert_sharded_close,
    batch,
    fsdp_modules,
    mlp_stack,
    shard_each,
)
from upstream.common_fsdp import patch_reduce_scatter, reduce_scatter_with_assert

LOW = (torch.bfloat16, torch.float16)


class TestFullyShardMixedPrecisionTraining(FSDP2Test):
    def test_compute_dtype(self) -> None:
        """With ``param_dtype`` low and no ``reduce_dtype``, the forward computes and
        the gradients are reduced in ``param_dtype``, the sharded parameters and
        gradients stay fp32, and training matches a low-precision reference."""
        self.run_subtests(
            {"param_dtype": list(LOW), "reshard_after_forward": [True, False]},
            self._train,
            reduce_dtype=None,
        )

    def test_reduce_dtype(self) -> None:
        """``reduce_dtype`` sets the dtype of every reduce-scatter, whatever the
        compute dtype; training matches the reference that reduces in it."""
        self.run_subtests(
            {
                "param_dtype": [torch.float32, torch.bfloat16],
                "reduce_dtype": [torch.float32, torch.bfloat16],
                "reshard_after_forward": [True, False],
            },
            self._train,
        )

    def _train(
        self,
        param_dtype: torch.dtype,
        reduce_dtype: torch.dtype | None,
        reshard_after_forward: bool,
    ) -> None:
        model = mlp_stack(8, depth=2)
        reference = LowPrecisionReference(
            copy.deepcopy(model), param_dtype, reduce_dtype or param_dtype
        )
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        shard_each(model, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        optim = torch.optim.SGD(model.parameters(), lr=LR)
        for step in range(STEPS):
            x = batch(self.rank, step, 2, 8)
            with CollectiveLog(("reduce_scatter",)) as log:
                loss = model(x).sum()
                loss.backward()
            self.assertEqual(loss.dtype, param_dtype, "the output is in the compute dtype")
            tol = LOW_PRECISION_TOL[coarser(param_dtype, reduce_dtype)]
            self.assertEqual(loss, reference.backward(x), **tol)
            self.assertEqual(
                {c.dtype for c in log.of("reduce_scatter")}, {reduce_dtype or param_dtype}
            )
            assert_sharded_close(self, reference.full, model, coarser(param_dtype, reduce_dtype))
            optim.step()
            optim.zero_grad()
            reference.step()

    def test_unsharded_parameters_in_compute_dtype(self) -> None:
        """Inside the forward the module's parameters are unsharded tensors of
        ``param_dtype``; buffers are not cast (a policy casts parameters and inputs only)."""
        self.run_subtests({"param_dtype": [torch.float32, *LOW]}, self._inside_forward)

    def _inside_forward(self, param_dtype: torch.dtype) -> None:
        model = mlp_stack(8, depth=2, with_buffer=True)
        shard_each(model, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype))
        seen: list[tuple[torch.dtype, bool, torch.dtype]] = []

        def record(module: nn.Module, args: Any) -> None:
            weight = module.in_proj.weight
            seen.append((weight.dtype, isinstance(weight, DTensor), module.buffer.dtype))

        for mlp in model:
            mlp.register_forward_pre_hook(record)
        model(batch(self.rank, 0, 2, 8)).float().sum().backward()
        self.assertEqual(seen, [(param_dtype, False, torch.float32)] * len(model))
        for name, param in model.named_parameters():
            self.assertEqual(param.dtype, torch.float32, name)
            self.assertEqual(param.grad.dtype, torch.float32, f"{name}.grad")

    def test_reduce_dtype_through_patch_reduce_scatter(self) -> None:
        """Upstream's way: ``patch_reduce_scatter`` with ``reduce_scatter_with_assert``
        sees every reduce-scatter output in ``reduce_dtype``."""
        self.run_subtests({"reduce_dtype": [torch.float32, torch.bfloat16]}, self._patched)

    def _patched(self, reduce_dtype: torch.dtype) -> None:
        model = mlp_stack(8, depth=2)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        shard_each(model, mp_policy=policy)
        seen: list[torch.dtype] = []

        def assert_fn(output: torch.Tensor) -> None:
            seen.append(output.dtype)
            self.assertEqual(output.dtype, reduce_dtype)

        orig = _torch_reduce_scatter()
        patched = functools.partial(reduce_scatter_with_assert, self, orig, assert_fn)
        with patch_reduce_scatter(patched):
            model(batch(self.rank, 0, 2, 8)).sum().backward()
        self.assertEqual(len(seen), len(fsdp_modules(model)) - 1)  # the root holds no parameter


def coarser(param_dtype: torch.dtype, reduce_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype whose tolerance applies: the coarser of the compute and reduce dtypes
    (a bf16 reduction rounds fp32 gradients to bf16)."""
    if reduce_dtype is None or reduce_dtype == param_dtype:
        return param_dtype
    return (
        reduce_dtype
        if torch.finfo(reduce_dtype).eps > torch.finfo(param_dtype).eps
        else param_dtype
    )


def _torch_reduce_scatter() -> Any:
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class TestFullyShardMixedPrecisionCasts(FSDP2Test):
    def test_output_dtype(self) -> None:
        """``output_dtype`` casts the floating-point outputs of the module; without
        it they are in the compute dtype."""
        self.run_subtests(
            {"param_dtype": list(LOW), "output_dtype": [None, torch.float32, torch.float16]},
            self._output,
        )

    def _output(self, param_dtype: torch.dtype, output_dtype: torch.dtype | None) -> None:
        model = mlp_stack(8, depth=1)
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, output_dtype=output_dtype)
        fully_shard(model, mp_policy=policy)
        out = model(batch(self.rank, 0, 2, 8))
        self.assertEqual(out.dtype, output_dtype or param_dtype)
        out.float().sum().backward()
        self.assertEqual(model[0].in_proj.weight.grad.dtype, torch.float32)

    def test_cast_forward_inputs(self) -> None:
        """With ``cast_forward_inputs`` the module's floating-point inputs arrive in
        ``param_dtype``; without it they arrive as given; integer inputs are never cast."""
        self.run_subtests(
            {"cast_forward_inputs": [True, False], "param_dtype": list(LOW)},
            self._cast_inputs,
        )

    def _cast_inputs(self, cast_forward_inputs: bool, param_dtype: torch.dtype) -> None:
        torch.manual_seed(0)
        model = TakesIndices(8).to(self.device)
        policy = MixedPrecisionPolicy(
            param_dtype=param_dtype, cast_forward_inputs=cast_forward_inputs
        )
        fully_shard(model, mp_policy=policy)
        x = batch(self.rank, 0, 3, 8)
        indices = torch.arange(3, device=self.device)
        model(x, indices)
        expected = param_dtype if cast_forward_inputs else torch.float32
        self.assertEqual(model.seen, (expected, torch.int64))

    def test_submodule_with_its_own_policy(self) -> None:
        """A child computing in bf16 with ``output_dtype=float32`` inside an fp32 root:
        the child's parameters are bf16 in its forward, the root's stay fp32, and the
        whole trains (the child's output is cast back for the root's layer)."""
        model = mlp_stack(8, depth=2)
        child_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
        fully_shard(model[0], mp_policy=child_policy)
        fully_shard(model)
        dtypes: list[torch.dtype] = []
        for mlp in model:
            mlp.register_forward_pre_hook(lambda m, _: dtypes.append(m.in_proj.weight.dtype))
        out = model(batch(self.rank, 0, 2, 8))
        self.assertEqual(dtypes, [torch.bfloat16, torch.float32])
        self.assertEqual(out.dtype, torch.float32)
        out.sum().backward()
        for name, param in model.named_parameters():
            self.assertEqual(param.grad.dtype, torch.float32, name)


class TakesIndices(nn.Module):
    """A linear on a float input plus an embedding of integer indices; records the
    dtypes its forward receives."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.emb = nn.Embedding(4, dim)
        self.seen: tuple[torch.dtype, torch.dtype] | None = None

    def forward(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        self.seen = (x.dtype, indices.dtype)
        return self.lin(x.to(self.lin.weight.dtype)) + self.emb(indices)


class TestFullyShardHSDPMixedPrecision(FSDP2Test):
    world_size = 4

    def test_hsdp_reduce_dtype(self) -> None:
        """On a 2x2 mesh both the reduce-scatter and the all-reduce over replicas run
        in ``reduce_dtype``."""
        self.run_subtests({"reduce_dtype": [torch.float32, torch.bfloat16]}, self._hsdp)

    def _hsdp(self, reduce_dtype: torch.dtype) -> None:
        model = mlp_stack(8, depth=2)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        shard_each(model, mesh=self.hsdp_mesh(2), mp_policy=policy)
        with CollectiveLog(("reduce_scatter", "all_reduce")) as log:
            model(batch(self.rank, 0, 2, 8)).sum().backward()
        self.assertEqual({c.dtype for c in log.calls if not isinstance(c, str)}, {reduce_dtype})
        self.assertEqual(log.count("all_reduce"), log.count("reduce_scatter"))
        self.assertTrue(log.count("all_reduce") > 0)


class TestFullyShardMixedPrecisionMore(FSDP2Test):
    def test_gradient_accumulation_in_reduce_dtype(self) -> None:
        """bf16 compute with fp32 reduction over microbatches without sync: the
        accumulated gradient is reduced once, in fp32, and matches the reference
        that accumulates the bf16 gradients in fp32 (docs/guide/bug-classes.md, class 1)."""
        model = mlp_stack(8, depth=2)
        reference = LowPrecisionReference(copy.deepcopy(model), torch.bfloat16, torch.float32)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        shard_each(model, mp_policy=policy)
        accumulated = [torch.zeros_like(p) for p in reference.full.parameters()]
        with CollectiveLog(("reduce_scatter",)) as log:
            for micro in range(3):
                model.set_requires_gradient_sync(micro == 2)
                x = batch(self.rank, micro, 2, 8)
                model(x).sum().backward()
                reference.backward(x)
                for total, param in zip(accumulated, reference.full.parameters(), strict=True):
                    total += param.grad
        self.assertEqual({c.dtype for c in log.of("reduce_scatter")}, {torch.float32})
        self.assertEqual(log.count("reduce_scatter"), len(fsdp_modules(model)) - 1)
        for param, total in zip(reference.full.parameters(), accumulated, strict=True):
            param.grad = total
        assert_sharded_close(self, reference.full, model, torch.bfloat16)

    def test_frozen_layer_under_mixed_precision(self) -> None:
        """A frozen layer computes in bf16 too and gets no gradient; the rest reduce
        in the reduce dtype."""
        model = mlp_stack(8, depth=2)
        model[0].requires_grad_(False)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        shard_each(model, mp_policy=policy)
        with CollectiveLog(("reduce_scatter",)) as log:
            model(batch(self.rank, 0, 2, 8)).sum().backward()
        self.assertEqual(log.count("reduce_scatter"), 1)
        for name, param in model.named_parameters():
            self.assertEqual(param.grad is None, name.startswith("0."), name)

    def test_all_gather_in_param_dtype(self) -> None:
        """The all-gathers carry the parameters cast to ``param_dtype``."""
        self.run_subtests({"param_dtype": [torch.float32, *LOW]}, self._all_gather_dtype)

    def _all_gather_dtype(self, param_dtype: torch.dtype) -> None:
        model = mlp_stack(8, depth=2)
        shard_each(model, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype))
        with CollectiveLog(("all_gather",)) as log:
            model(batch(self.rank, 0, 2, 8))
        self.assertEqual({c.dtype for c in log.of("all_gather")}, {param_dtype})
