"""FSDP2 trains the layers models are made of as the replicated reference does:
convolutions (3-D and 4-D parameters), embeddings with integer inputs, layer and
batch norms (buffers updated per rank), a transformer encoder layer, deep and
narrow stacks, forwards with keyword and non-tensor arguments, two sharded models in
one step, and a learning-rate schedule ([Note: FSDP2 parity recipe] in
``suites/fsdp2/helpers.py``). One test per model; configurations are subtests.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from harness import current_device
from suites.fsdp2.helpers import (
    LR,
    STEPS,
    FSDP2Test,
    average_gradients,
    batch,
    lockstep,
    mlp_stack,
    shard_each,
)
from upstream.common_fsdp import check_sharded_parity

RESHARD = [True, False]


def _on_device(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """``build``, seeded, on the rank's device."""

    def built() -> nn.Module:
        torch.manual_seed(0)
        return build().to(current_device())

    return built


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, padding=1)
        self.conv2 = nn.Conv1d(3, 4, 2)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv1(x)).mean(dim=-1)  # (N, 3, H)
        return self.head(torch.relu(self.conv2(h)).mean(dim=-1))


class EmbeddingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.mlp = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids).mean(dim=1))


class NormNet(nn.Module):
    def __init__(self, norm: str) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 6)
        self.norm = nn.LayerNorm(6) if norm == "layer" else nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.lin(x)))


class KeywordNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(
        self,
        x: torch.Tensor,
        *,
        scale: float = 1.0,
        note: str = "",
        skip: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out = self.lin(x) * scale
        return out if skip is None else out + skip


class TestFullyShardModels(FSDP2Test):
    def test_conv_layers(self) -> None:
        """3-D and 4-D convolution weights shard on dim 0 and train as the reference."""
        self.run_subtests(
            {"reshard_after_forward": RESHARD, "per_layer": [True, False]}, self._conv
        )

    def _conv(self, reshard_after_forward: bool, per_layer: bool) -> None:
        run = lockstep(
            self,
            _on_device(ConvNet),
            lambda m: shard_each(
                m,
                [m.conv1, m.conv2] if per_layer else [],
                reshard_after_forward=reshard_after_forward,
            ),
        )
        run.train(STEPS, (2, 2, 4, 5))

    def test_embedding_with_integer_inputs(self) -> None:
        """An embedding fed integer ids (never cast) trains as the reference."""
        self.run_subtests({"reshard_after_forward": RESHARD}, self._embedding)

    def _embedding(self, reshard_after_forward: bool) -> None:
        run = lockstep(
            self,
            _on_device(EmbeddingNet),
            lambda m: shard_each(m, [m.emb, m.mlp], reshard_after_forward=reshard_after_forward),
        )
        for step in range(STEPS):
            ids = torch.randint(
                0, 11, (3, 4), generator=torch.Generator().manual_seed(step + 10 * self.rank)
            )
            run.backward(ids.to(self.device))
            run.step(step)

    def test_norm_layers(self) -> None:
        """Layer norm and batch norm (running statistics from each rank's own batch,
        as in the reference on the same batch) train as the reference."""
        self.run_subtests(
            {"norm": ["layer", "batch"], "reshard_after_forward": RESHARD}, self._norm
        )

    def _norm(self, norm: str, reshard_after_forward: bool) -> None:
        run = lockstep(
            self,
            _on_device(functools.partial(NormNet, norm)),
            lambda m: shard_each(m, [m.lin, m.norm], reshard_after_forward=reshard_after_forward),
        )
        run.train(STEPS, (4, 5))
        for (name, ours), (_, theirs) in zip(
            run.model.named_buffers(), run.reference.named_buffers(), strict=True
        ):
            self.assertEqual(ours, theirs, msg=name)

    def test_transformer_encoder_layer(self) -> None:
        """A tiny ``TransformerEncoderLayer`` (attention, feed-forward, norms; dropout
        off) sharded per layer trains as the reference."""
        self.run_subtests({"reshard_after_forward": RESHARD}, self._transformer)

    def _transformer(self, reshard_after_forward: bool) -> None:
        def build() -> nn.Module:
            layer = lambda: nn.TransformerEncoderLayer(
                8, 2, dim_feedforward=16, dropout=0.0, batch_first=True
            )
            return nn.Sequential(layer(), layer())

        run = lockstep(
            self,
            _on_device(build),
            functools.partial(shard_each, reshard_after_forward=reshard_after_forward),
        )
        run.train(STEPS, (2, 3, 8))

    def test_deep_and_narrow_stacks(self) -> None:
        """Stacks from one to six groups, of widths from 1 to 3: every group trains."""
        self.run_subtests({"depth": [1, 6], "dim": [1, 3]}, self._stack)

    def _stack(self, depth: int, dim: int) -> None:
        run = lockstep(self, lambda: mlp_stack(dim, depth=depth), shard_each)
        run.train(STEPS, (2, dim))

    def test_keyword_and_non_tensor_arguments(self) -> None:
        """Forward keyword arguments (a float, a string, a tensor) reach the module;
        the result trains as the reference."""
        self.run_subtests({"with_skip": [False, True]}, self._keywords)

    def _keywords(self, with_skip: bool) -> None:
        run = lockstep(self, _on_device(KeywordNet), lambda m: shard_each(m, []))
        x = batch(self.rank, 0, 2, 4)
        skip = batch(self.rank, 1, 2, 4) if with_skip else None
        outs = [m(x, scale=0.5, note="n", skip=skip) for m in (run.model, run.reference)]
        self.assertEqual(outs[0], outs[1])
        for out in outs:
            out.sum().backward()
        average_gradients(run.reference)
        check_sharded_parity(self, run.reference, run.model)

    def test_two_sharded_models_in_one_step(self) -> None:
        """Two independently sharded models feeding one loss train as their references."""
        first = lockstep(self, lambda: mlp_stack(4, depth=2, seed=0), shard_each)
        second = lockstep(self, lambda: mlp_stack(4, depth=2, seed=1), shard_each)
        for step in range(STEPS):
            x = batch(self.rank, step, 2, 4)
            loss = second.model(first.model(x)).sum()
            ref_loss = second.reference(first.reference(x)).sum()
            loss.backward()
            ref_loss.backward()
            self.assertEqual(loss, ref_loss)
            for run in (first, second):
                average_gradients(run.reference)
                check_sharded_parity(self, run.reference, run.model)
                run.step(step)

    def test_learning_rate_schedule(self) -> None:
        """A step learning-rate schedule on the sharded model's optimizer acts as on
        the reference's."""
        run = lockstep(self, lambda: mlp_stack(4, depth=2), shard_each)
        schedulers = [
            torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in run.optims
        ]
        for step in range(3):
            run.backward(batch(self.rank, step, 2, 4))
            run.step(step)
            for scheduler in schedulers:
                scheduler.step()
        self.assertEqual(run.optims[0].param_groups[0]["lr"], LR * 0.125)
        check_sharded_parity(self, run.reference, run.model)
