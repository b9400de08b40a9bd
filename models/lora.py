"""A toy LoRA decoder: frozen base weights, trainable low-rank adapters.

Every module mixes frozen and trainable parameters in its own way, which is what
FSDP's frozen-parameter validation inspects: ``LoraAttention`` holds both (the
adapters ``lora_A``/``lora_B`` train, the projections are frozen), ``LoraMLP``
and the layer norms are entirely frozen, and ``LoraModel`` freezes its embedding
and final norm.
"""

from __future__ import annotations

import math

import torch
from torch import nn

_D_MODEL = 32
_RANK = 8
_D_HIDDEN = 128
_VOCAB = 100
_LAYERS = 4


class LoraAttention(nn.Module):
    """Single-head self-attention whose query projection carries a rank-8 adapter."""

    q_proj: nn.Linear
    lora_A: nn.Linear
    lora_B: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(_D_MODEL, _D_MODEL, bias=False)
        self.lora_A = nn.Linear(_D_MODEL, _RANK, bias=False)
        self.lora_B = nn.Linear(_RANK, _D_MODEL, bias=False)
        self.k_proj = nn.Linear(_D_MODEL, _D_MODEL, bias=False)
        self.v_proj = nn.Linear(_D_MODEL, _D_MODEL, bias=False)
        self.o_proj = nn.Linear(_D_MODEL, _D_MODEL, bias=False)
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            proj.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (batch, sequence, 32)."""
        q = self.q_proj(x) + self.lora_B(self.lora_A(x))
        scores = q @ self.k_proj(x).transpose(-2, -1) / math.sqrt(_D_MODEL)
        return self.o_proj(scores.softmax(dim=-1) @ self.v_proj(x))


class LoraMLP(nn.Module):
    """A frozen two-layer MLP (32 -> 128 -> 32)."""

    proj1: nn.Linear
    proj2: nn.Linear

    def __init__(self) -> None:
        super().__init__()
        self.proj1 = nn.Linear(_D_MODEL, _D_HIDDEN, bias=False)
        self.proj2 = nn.Linear(_D_HIDDEN, _D_MODEL, bias=False)
        self.proj1.weight.requires_grad_(False)
        self.proj2.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj2(nn.functional.relu(self.proj1(x)))


class LoraDecoder(nn.Module):
    """A pre-norm decoder layer: attention and MLP, each as a residual branch."""

    attn: LoraAttention
    mlp: LoraMLP
    inp_layernorm: nn.LayerNorm
    post_attn_layernorm: nn.LayerNorm

    def __init__(self) -> None:
        super().__init__()
        self.attn = LoraAttention()
        self.mlp = LoraMLP()
        self.inp_layernorm = nn.LayerNorm(_D_MODEL)
        self.post_attn_layernorm = nn.LayerNorm(_D_MODEL)
        for norm in (self.inp_layernorm, self.post_attn_layernorm):
            norm.weight.requires_grad_(False)
            norm.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.inp_layernorm(x))
        return h + self.mlp(self.post_attn_layernorm(h))


class LoraModel(nn.Module):
    """This is a toy LoRA decoder model: an embedding of 100 tokens into 32 features,
    4 ``LoraDecoder`` layers and a final layer norm."""

    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: nn.LayerNorm

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(_VOCAB, _D_MODEL)
        self.layers = nn.ModuleList([LoraDecoder() for _ in range(_LAYERS)])
        self.norm = nn.LayerNorm(_D_MODEL)
        self.embed_tokens.weight.requires_grad_(False)
        self.norm.weight.requires_grad_(False)
        self.norm.bias.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens``: (batch, sequence) token ids below 100."""
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)
