"""A small encoder-decoder transformer whose output projection shares the embedding weight.

[Note: Process groups for hybrid sharding]
``init`` takes either one process group or a pair ``(shard group, replicate
group)``. The model itself only needs a rank (to seed its input), which it takes
from the first group of a pair. FSDP receives the group as given, except that a
hybrid strategy with a single group gets ``None``, so that FSDP builds its own
intra-node and inter-node groups.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdptest.api import FSDP, ModuleWrapPolicy, ShardingStrategy
from fsdptest.interface import DeviceInitMode, FSDPInitMode, FSDPTestModel, to_device_if
from harness.seeding import manual_seed

GroupArg = dist.ProcessGroup | tuple[dist.ProcessGroup, dist.ProcessGroup]

_VOCAB = 23
_D_MODEL = 16
_BATCH = 2
_MODEL_SEED = 0


class TransformerWithSharedParams(FSDPTestModel):
    """``nn.Transformer`` (2 encoder and 2 decoder layers, feed-forward width 8, dropout
    0.1) between an embedding of 23 tokens into 16 features and an output projection
    tied to it. Buffers: ``vocab_bias`` (ones, added to the source embedding) and
    ``long_buffer`` (int64 zeros, so buffer casting must skip integer buffers). An
    optional ``BatchNorm1d`` over the batch normalises the target embedding.
    A ``deterministic`` model is seeded and put in ``eval()`` (no dropout).
    """

    rank: int
    world_size: int
    bs: int
    embed_tokens: nn.Embedding
    transformer: nn.Transformer
    output_proj: nn.Linear
    bn: nn.Module
    vocab_bias: torch.Tensor
    long_buffer: torch.Tensor

    def __init__(
        self,
        group: dist.ProcessGroup,
        device_init_mode: DeviceInitMode,
        add_bn: bool,
        deterministic: bool,
    ) -> None:
        super().__init__()
        self.rank = group.rank()
        self.world_size = group.size()
        self.bs = _BATCH
        if deterministic:
            manual_seed(_MODEL_SEED)
        self.embed_tokens = nn.Embedding(_VOCAB, _D_MODEL)
        self.transformer = nn.Transformer(
            d_model=_D_MODEL,
            num_encoder_layers=2,
            num_decoder_layers=2,
            dim_feedforward=8,
            dropout=0.1,
        )
        self.output_proj = nn.Linear(_D_MODEL, _VOCAB)
        self.output_proj.weight = self.embed_tokens.weight
        self.register_buffer("vocab_bias", torch.ones(_D_MODEL))
        self.register_buffer("long_buffer", torch.zeros(_D_MODEL, dtype=torch.long))
        self.bn = nn.BatchNorm1d(self.bs) if add_bn else nn.Identity()
        to_device_if(self, device_init_mode.is_before())
        if deterministic:
            self.eval()

    def get_input(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        manual_seed(1 + self.rank)
        src = torch.arange(12, device=device).view(6, self.bs)  # (time, batch)
        tgt = torch.arange(self.bs * 4, device=device).view(4, self.bs)
        return src, tgt

    def forward(self, src_ids: torch.Tensor, tgt_ids: torch.Tensor) -> torch.Tensor:
        src = self.embed_tokens(src_ids)
        src = src + self.vocab_bias + self.long_buffer.type_as(src)
        tgt = self.bn(self.embed_tokens(tgt_ids))
        return self.output_proj(self.transformer(src, tgt))

    def get_loss(self, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        _, tgt = inputs
        logits = output.view(-1, output.size(-1))
        return nn.functional.cross_entropy(logits, tgt.view(-1), reduction="sum")

    def run_backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def get_ignored_modules(self) -> list[nn.Module]:
        return [self.transformer]

    @staticmethod
    def init(
        group: GroupArg,
        fsdp_init_mode: FSDPInitMode,
        device_init_mode: DeviceInitMode,
        fsdp_kwargs: Mapping[str, Any] | None = None,
        deterministic: bool = False,
        add_bn: bool = True,
    ) -> nn.Module:
        """``NO_FSDP``: the bare model. ``RECURSIVE``: the model under a top-level FSDP
        whose auto-wrap policy wraps every encoder and decoder layer, unless
        ``fsdp_kwargs`` brings its own ``auto_wrap_policy``. ``fsdp_kwargs`` is not
        modified. See [Note: Process groups for hybrid sharding]."""
        model_group = group[0] if isinstance(group, tuple) else group
        model = TransformerWithSharedParams(model_group, device_init_mode, add_bn, deterministic)
        if fsdp_init_mode is FSDPInitMode.NO_FSDP:
            return model
        kwargs = dict(fsdp_kwargs or {})
        kwargs.setdefault(
            "auto_wrap_policy",
            ModuleWrapPolicy({nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}),
        )
        fsdp_model = FSDP(model, _fsdp_group(group, kwargs), **kwargs)
        return to_device_if(fsdp_model, device_init_mode.is_after())


def _fsdp_group(group: GroupArg, fsdp_kwargs: Mapping[str, Any]) -> GroupArg | None:
    hybrid = {ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2}
    if fsdp_kwargs.get("sharding_strategy") in hybrid and not isinstance(group, tuple):
        return None
    return group
