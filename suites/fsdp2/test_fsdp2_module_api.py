"""The ``FSDPModule`` methods one by one, and gradient bookkeeping: ``unshard`` /
``reshard`` (idempotent, handles), ``set_reshard_after_backward``,
``set_gradient_divide_factor``, per-module ``reshard_after_forward``, ``zero_grad``,
gradients accumulated over backwards without ``zero_grad``, freezing and
unfreezing between steps, a parameter first used on the last microbatch, and the
optimizer's view of the parameters (DTensors, before and after a step). Facts from
upstream's ``test_fully_shard_training.py``, ``test_fully_shard_comm.py`` and
``test_fully_shard_frozen.py``; bug classes 1, 2 and 7 (docs/guide/bug-classes.md).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdptest.api import fully_shard
from suites.fsdp2.helpers import (
    STEPS,
    CollectiveLog,
    FSDP2Test,
    average_gradients,
    batch,
    fsdp_modules,
    lockstep,
    mlp_stack,
    shard_each,
)
from upstream.common_fsdp import check_sharded_parity


class TestFullyShardUnshardReshard(FSDP2Test):
    def test_unshard_is_idempotent(self) -> None:
        """A second ``unshard`` of an unsharded group all-gathers nothing; waiting on
        a handle twice is harmless; ``reshard`` of a sharded group is a no-op."""
        self.run_subtests({"async_op": [False, True]}, self._idempotent)

    def _idempotent(self, async_op: bool) -> None:
        model = mlp_stack(4, depth=2)
        shard_each(model)
        model(batch(self.rank, 0, 2, 4))  # lazy initialisation
        model[0].reshard()
        model[0].reshard()
        self.assertIsInstance(model[0].in_proj.weight, DTensor)
        with CollectiveLog(("all_gather",)) as log:
            handles = [model[0].unshard(async_op=async_op) for _ in range(2)]
            for handle in handles:
                if handle is not None:
                    handle.wait()
                    handle.wait()
        self.assertEqual(log.count("all_gather"), 1)
        model[0].reshard()

    def test_unsharded_values_are_the_full_parameters(self) -> None:
        """After ``unshard`` each registered parameter is the full parameter (equal to
        the DTensor's full tensor before), and ``reshard`` gives the same shards back."""
        model = mlp_stack(5, depth=2)
        shard_each(model)
        model(batch(self.rank, 0, 2, 5))
        model.reshard()
        for mlp in model:
            mlp.reshard()
        shards = {n: p.to_local().clone() for n, p in model.named_parameters()}
        fulls = {n: p.full_tensor() for n, p in model.named_parameters()}
        for mlp in model:
            mlp.unshard()
        for name, param in model.named_parameters():
            self.assertFalse(isinstance(param, DTensor), name)
            self.assertEqual(param, fulls[name], msg=name)
        for mlp in model:
            mlp.reshard()
        for name, param in model.named_parameters():
            self.assertEqual(param.to_local(), shards[name], msg=name)

    def test_pending_all_gather_outlives_reshard(self) -> None:
        """``unshard(async_op=True)`` then ``reshard()``: the all-gather stays pending
        and the next forward copies it out without all-gathering again (torch's
        ``FSDPParamGroup.reshard`` leaves it); the output is the full model's."""
        model = mlp_stack(4, depth=2)
        expected = mlp_stack(4, depth=2)
        shard_each(model)
        x = batch(self.rank, 0, 2, 4)
        model(x)  # lazy initialisation
        model.reshard()
        for mlp in model:
            mlp.reshard()
        handle = model[0].unshard(async_op=True)
        model[0].reshard()
        self.assertIsInstance(model[0].in_proj.weight, DTensor)
        with CollectiveLog(("all_gather",)) as log:
            out = model(x)
        self.assertEqual(log.count("all_gather"), 1)  # model[1]'s alone
        self.assertEqual(out, expected(x))
        if handle is not None:
            handle.wait()

    def test_set_reshard_after_backward_false(self) -> None:
        """With ``set_reshard_after_backward(False)`` the parameters stay unsharded
        after backward, and the next forward all-gathers nothing for those groups."""
        model = mlp_stack(4, depth=2)
        shard_each(model, model)
        model.set_reshard_after_backward(False)
        model(batch(self.rank, 0, 2, 4)).sum().backward()
        for name, param in model.named_parameters():
            self.assertFalse(isinstance(param, DTensor), name)
        with CollectiveLog(("all_gather",)) as log:
            model(batch(self.rank, 1, 2, 4))
        self.assertEqual(log.count("all_gather"), 0)

    def test_per_module_reshard_after_forward(self) -> None:
        """Children resharding and a root that does not (and the reverse): the
        backward all-gathers exactly the resharded groups; training matches."""
        self.run_subtests({"root_reshards": [False, True]}, self._per_module)

    def _per_module(self, root_reshards: bool) -> None:
        def shard(model: nn.Module) -> None:
            for mlp in list(model)[:-1]:  # the last linear is the root's
                shard_each(mlp, [], reshard_after_forward=not root_reshards)
            shard_each(model, [], reshard_after_forward=root_reshards)

        def build() -> nn.Sequential:  # the last linear on the rank's device, as the MLPs
            return nn.Sequential(*mlp_stack(4, depth=2), nn.Linear(4, 4, device=self.device))

        run = lockstep(self, build, shard)
        for step in range(STEPS):
            with CollectiveLog(("all_gather",)) as log:
                out = run.model(batch(self.rank, step, 2, 4))
                log.calls.clear()
                out.sum().backward()
            self.assertEqual(log.count("all_gather"), 1 if root_reshards else 2)
            run.reference(batch(self.rank, step, 2, 4)).sum().backward()
            average_gradients(run.reference)
            check_sharded_parity(self, run.reference, run.model)
            run.step(step)


class TestFullyShardGradients(FSDP2Test):
    def test_set_gradient_divide_factor(self) -> None:
        """``set_gradient_divide_factor(f)``: each gradient is the sum over ranks
        divided by f (f = 1: the sum; f = W: the mean)."""
        self.run_subtests({"factor": [1.0, 2.0, "world"]}, self._divide_factor)

    def _divide_factor(self, factor: float | str) -> None:
        divide = float(self.world_size) if factor == "world" else float(factor)
        torch.manual_seed(0)
        model = ScaledSum(nn.Linear(3, 3)).to(self.device)
        fully_shard(model)
        model.set_gradient_divide_factor(divide)
        try:
            model(torch.tensor(float(self.rank + 1), device=self.device)).backward()
        except RuntimeError as error:
            if "PREMUL_SUM with Gloo" not in str(error):
                raise
            pytest.skip(
                f"the FSDP under test divides by {divide} (not the world size) with "
                "ReduceOp.PREMUL_SUM, which gloo does not implement: NCCL ranks run this"
            )
        total = self.world_size * (self.world_size + 1) / 2
        for name, param in model.named_parameters():
            grad = param.grad.to_local()
            self.assertEqual(grad, torch.full_like(grad, total / divide), msg=name)

    def test_gradients_accumulate_without_zero_grad(self) -> None:
        """Two backwards without ``zero_grad`` leave the sum of the two means, as
        the reference's ``.grad`` accumulates."""
        self.run_subtests({"reshard_after_forward": [True, False]}, self._accumulate)

    def _accumulate(self, reshard_after_forward: bool) -> None:
        run = lockstep(
            self,
            lambda: mlp_stack(4, depth=2),
            functools.partial(shard_each, reshard_after_forward=reshard_after_forward),
        )
        for micro in range(2):
            x = batch(self.rank, micro, 2, 4)
            for model in (run.model, run.reference):
                model(x).sum().backward()
        average_gradients(run.reference)
        check_sharded_parity(self, run.reference, run.model)

    def test_zero_grad(self) -> None:
        """``zero_grad(set_to_none=True)`` leaves no gradient; ``False`` leaves zero
        DTensor gradients of the shards' shape."""
        self.run_subtests({"set_to_none": [True, False]}, self._zero_grad)

    def _zero_grad(self, set_to_none: bool) -> None:
        model = mlp_stack(4, depth=2)
        shard_each(model)
        model(batch(self.rank, 0, 2, 4)).sum().backward()
        model.zero_grad(set_to_none=set_to_none)
        for name, param in model.named_parameters():
            if set_to_none:
                self.assertIsNone(param.grad, name)
            else:
                self.assertIsInstance(param.grad, DTensor, name)
                self.assertEqual(
                    param.grad.to_local(), torch.zeros_like(param.to_local()), msg=name
                )

    def test_freeze_then_unfreeze(self) -> None:
        """A layer frozen for a step (no gradient, unchanged), then unfrozen: it
        trains again, as in the reference."""
        run = lockstep(self, lambda: mlp_stack(4, depth=2), shard_each)
        for step, frozen in enumerate((True, False, False)):
            for model in (run.model, run.reference):
                model[0].requires_grad_(not frozen)
            before = [p.to_local().clone() for p in run.model[0].parameters()]
            run.backward(batch(self.rank, step, 2, 4))
            run.step(0)
            after = [p.to_local() for p in run.model[0].parameters()]
            if frozen:
                self.assertEqual(after, before)
            check_sharded_parity(self, run.reference, run.model)

    def test_parameter_first_used_on_last_microbatch(self) -> None:
        """A layer used only by the last of three microbatches without sync in
        between: its gradient is that microbatch's mean, the rest the sum."""
        run = lockstep(
            self,
            lambda: SometimesUsed(4).to(self.device),
            lambda m: shard_each(m, [m.always, m.late]),
        )
        model = run.model
        for micro in range(3):
            last = micro == 2
            model.set_requires_gradient_sync(last)
            for m in (model, run.reference):
                m.use_late = last
                m(batch(self.rank, micro, 2, 4)).sum().backward()
        average_gradients(run.reference)
        check_sharded_parity(self, run.reference, model)

    def test_optimizer_steps_dtensor_parameters(self) -> None:
        """The optimizer holds the sharded DTensors, and they stay DTensors of the same
        placements after its step."""
        model = mlp_stack(4, depth=2)
        shard_each(model)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        placements = [tuple(p.placements) for p in model.parameters()]
        for param in optim.param_groups[0]["params"]:
            self.assertIsInstance(param, DTensor)
        for step in range(STEPS):
            model(batch(self.rank, step, 2, 4)).sum().backward()
            optim.step()
            optim.zero_grad()
        self.assertEqual([tuple(p.placements) for p in model.parameters()], placements)
        self.assertEqual(len(fsdp_modules(model)), 3)


class ScaledSum(nn.Module):
    """``scale * (sum of every parameter)``: its gradient is ``scale`` everywhere."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        return scale * sum(p.sum() for p in self.inner.parameters())


class SometimesUsed(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.always = nn.Linear(dim, dim)
        self.late = nn.Linear(dim, dim)
        self.use_late = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.always(x)
        return self.late(out) if self.use_late else out
