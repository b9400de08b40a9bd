"""``clip_grad_norm_`` over FSDP2's DTensor gradients, and ``torch.amp.GradScaler``.

``nn.utils.clip_grad_norm_`` on a sharded model's parameters returns the total norm
of the full gradients (a DTensor whose full tensor is the replicated model's norm,
the same on every rank) and clips every shard as the replicated gradients are
clipped; training with clipping matches the replicated reference. The grad scaler
unscales DTensor gradients, and an inf in one rank's shard makes every rank skip
the step and back off the scale. Facts from upstream's
``test_fully_shard_clip_grad_norm_.py`` and ``test_fully_shard_grad_scaler.py``.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from suites.fsdp2.helpers import (
    FSDP2Test,
    average_gradients,
    batch,
    full_tensor,
    lockstep,
    mlp_stack,
    shard_each,
    skip_inf_norm_of_an_empty_shard,
)
from upstream.common_fsdp import check_sharded_parity

INF = float("inf")


class TestFullyShardClipGradNorm(FSDP2Test):
    def test_clip_grad_norm_1d(self) -> None:
        """The total norm of the sharded gradients equals the replicated model's, for
        the 2-, 1- and inf-norm, foreach or not, clipping or not (a large max_norm);
        the clipped shards equal the clipped replicated gradients, for several steps."""
        self.run_subtests(
            {"norm_type": [2.0, 1.0, INF], "max_norm": [0.5, 1e3], "foreach": [False, True]},
            self._clip,
        )

    def _clip(self, norm_type: float, max_norm: float, foreach: bool) -> None:
        run = lockstep(self, lambda: mlp_stack(6, depth=2), shard_each)
        skip_inf_norm_of_an_empty_shard(norm_type, run.reference, self.world_size)
        clip = functools.partial(
            nn.utils.clip_grad_norm_, max_norm=max_norm, norm_type=norm_type, foreach=foreach
        )
        for step in range(2):
            run.backward(batch(self.rank, step, 3, 6))
            ref_norm = clip(run.reference.parameters())
            norm = clip(run.model.parameters())
            self.assertIsInstance(norm, DTensor)
            self.assertEqual(norm.full_tensor(), ref_norm)
            check_sharded_parity(self, run.reference, run.model)
            run.step(step)

    def test_clip_grad_norm_same_on_every_rank(self) -> None:
        """Every rank computes the same total norm (all-gathered and compared exactly)."""
        model = mlp_stack(6, depth=2)
        shard_each(model)
        model(batch(self.rank, 0, 3, 6)).sum().backward()
        norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        value = full_tensor(norm).reshape(1)
        gathered = [torch.empty_like(value) for _ in range(self.world_size)]
        dist.all_gather(gathered, value)
        self.assertEqual(torch.cat(gathered), value.expand(self.world_size), rtol=0, atol=0)

    def test_clip_grad_norm_with_frozen_and_unused(self) -> None:
        """Parameters without gradients (frozen, or of a module the forward skips) are
        left out of the norm, as in the replicated model."""

        def build() -> nn.Module:
            model = mlp_stack(6, depth=3)
            for param in model[0].parameters():
                param.requires_grad_(False)
            return model

        run = lockstep(self, build, shard_each)
        run.backward(batch(self.rank, 0, 3, 6))
        ref_norm = nn.utils.clip_grad_norm_(
            [p for p in run.reference.parameters() if p.grad is not None], max_norm=0.1
        )
        norm = nn.utils.clip_grad_norm_(
            [p for p in run.model.parameters() if p.grad is not None], max_norm=0.1
        )
        self.assertEqual(norm.full_tensor(), ref_norm)
        check_sharded_parity(self, run.reference, run.model)


class TestFullyShardHSDPClipGradNorm(FSDP2Test):
    world_size = 4

    def test_clip_grad_norm_2d(self) -> None:
        """On a 2x2 mesh ((Replicate(), Shard(0)) gradients) replicas are not counted
        twice: the norm is the replicated model's."""
        self.run_subtests({"norm_type": [2.0, INF]}, self._clip_2d)

    def _clip_2d(self, norm_type: float) -> None:
        mesh = self.hsdp_mesh(2)
        run = lockstep(
            self, lambda: mlp_stack(6, depth=2), functools.partial(shard_each, mesh=mesh)
        )
        skip_inf_norm_of_an_empty_shard(norm_type, run.reference, 2)
        run.backward(batch(self.rank, 0, 3, 6))
        ref_norm = nn.utils.clip_grad_norm_(run.reference.parameters(), 0.5, norm_type=norm_type)
        norm = nn.utils.clip_grad_norm_(run.model.parameters(), 0.5, norm_type=norm_type)
        self.assertEqual(norm.full_tensor(), ref_norm)
        check_sharded_parity(self, run.reference, run.model)


class TestFullyShardGradScaler(FSDP2Test):
    def test_gradient_scaler(self) -> None:
        """Without inf: gradients are unscaled by 1/scale, the step happens and the
        scale stays. With an inf in rank 1's shard only: every rank finds it, skips
        the step (optimizer state unchanged) and multiplies the scale by the backoff."""
        self.run_subtests({"has_inf": [False, True]}, self._scaler)

    def _scaler(self, has_inf: bool) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(4, 4, bias=False) for _ in range(2))).to(self.device)
        shard_each(model)
        init_scale = 2.0
        scaler = torch.amp.GradScaler(self.device_type, init_scale=init_scale)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        scaler.scale(model(batch(self.rank, 0, 4, 4)).sum()).backward()
        grad = optim.param_groups[0]["params"][0].grad
        if has_inf and self.rank == 1:
            grad.to_local()[0, 0] = INF
        scaled = grad.to_local().clone()
        scaler.unscale_(optim)
        for found_inf in scaler._per_optimizer_states[id(optim)]["found_inf_per_device"].values():
            self.assertEqual(bool(found_inf), has_inf)
        if not has_inf:
            self.assertEqual(grad.to_local(), scaled / init_scale)
        before = copy.deepcopy(optim.state_dict()["state"])
        # Full tensors: a rank's shard may be empty (4 rows over 3 ranks chunk 2, 2, 0)
        weights = [p.full_tensor() for p in model.parameters()]
        scaler.step(optim)
        scaler.update()
        after = [p.full_tensor() for p in model.parameters()]
        if has_inf:
            self.assertEqual(optim.state_dict()["state"], before)
            self.assertEqual(after, weights)
            self.assertEqual(scaler.get_scale(), init_scale * scaler.get_backoff_factor())
        else:
            self.assertNotEqual(after, weights)
            self.assertEqual(scaler.get_scale(), init_scale)

    def test_scaled_training_matches_reference(self) -> None:
        """Training with a grad scaler (no inf) matches the replicated reference
        trained with the same scaler settings."""
        run = lockstep(self, lambda: mlp_stack(6, depth=2), shard_each)
        scalers = [torch.amp.GradScaler(self.device_type, init_scale=4.0) for _ in range(2)]
        models = (run.model, run.reference)
        for step in range(2):
            x = batch(self.rank, step, 3, 6)
            for model, scaler in zip(models, scalers, strict=True):
                scaler.scale(model(x).sum()).backward()
            average_gradients(run.reference)
            for scaler, optim in zip(scalers, run.optims, strict=True):
                scaler.step(optim)
                scaler.update()
                optim.zero_grad()
            check_sharded_parity(self, run.reference, run.model)
