"""The torch modules an example's ``Model`` builds, and its data.

[Note: What keeps a drawn model wrappable]
Tied and shared parameters must stay inside one FSDP unit: the embedding and
the head it is tied to are direct children of the root, which no policy wraps
(``Embedding`` and ``Head`` are excluded from size-based wrapping, and
``ModuleWrapPolicy`` wraps only ``Block`` s); ``TiedLinears`` may become a unit
as a whole, its two ``TiedLinear`` s never separately: they are excluded from
size-based wrapping. (Making ``TiedLinears`` a force-leaf module is not enough:
under mixed precision torch's FSDP ORs the policy with one that always
recurses, so force-leaf modules are descended into; see
``suites/test_property_findings.py``.) A ``SharedLinear`` may become a unit of
its own: that unit then runs forward twice per iteration. Integer inputs stay integers under mixed
precision; the loss is computed in fp32 from the output, as a training loop
under mixed precision does.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from fsdptest.properties.examples import Block, Example, Layer, LayerKind, Model
from harness.seeding import manual_seed


class Scale(nn.Module):
    """Multiplies by a constant buffer (no parameters)."""

    scale: torch.Tensor

    def __init__(self, width: int, persistent: bool) -> None:
        super().__init__()
        values = 1.0 + 0.1 * torch.arange(width, dtype=torch.float32) / max(width, 1)
        self.register_buffer("scale", values, persistent=persistent)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale.to(x.dtype)


class Activated(nn.Module):
    """A Linear followed by tanh."""

    def __init__(self, width_in: int, width: int, bias: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(width_in, width, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class SharedLinear(nn.Module):
    """One Linear applied twice (its parameters used twice in one forward)."""

    def __init__(self, width: int, bias: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(torch.tanh(self.linear(x))))


class TiedLinear(nn.Linear):
    """One of ``TiedLinears``' Linears (a class of its own, never a unit alone)."""


class TiedLinears(nn.Module):
    """Two Linears holding one weight parameter, each with its own bias."""

    def __init__(self, width: int, bias: bool) -> None:
        super().__init__()
        self.first = TiedLinear(width, width, bias=bias)
        self.second = TiedLinear(width, width, bias=bias)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.second(torch.tanh(self.first(x))))


class BlockModule(nn.Module):
    """An example's ``Block``: its layers, then its child blocks."""

    def __init__(self, spec: Block, width_in: int) -> None:
        super().__init__()
        layers = []
        for layer in spec.layers:
            layers.append(_layer(layer, width_in))
            width_in = layer.out_width(width_in)
        self.layers = nn.Sequential(*layers)
        children = []
        for child in spec.children:
            children.append(BlockModule(child, width_in))
            width_in = child.out_width(width_in)
        self.children_blocks = nn.ModuleList(children)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(x)
        for child in self.children_blocks:
            x = child(x)
        return x


def _layer(spec: Layer, width_in: int) -> nn.Module:
    module: nn.Module
    if spec.kind is LayerKind.LINEAR:
        module = Activated(width_in, spec.width, spec.bias)
    elif spec.kind is LayerKind.NORM:
        module = nn.LayerNorm(width_in, elementwise_affine=spec.bias)
    elif spec.kind is LayerKind.SHARED:
        module = SharedLinear(width_in, spec.bias)
    elif spec.kind is LayerKind.TIED:
        module = TiedLinears(width_in, spec.bias)
    else:
        module = Scale(width_in, spec.persistent)
    if spec.frozen:
        module.requires_grad_(False)
    return module


class Head(nn.Linear):
    """The output layer (a class of its own so that size-based wrapping skips it)."""


class PropertyModel(nn.Module):
    """The module an example's ``Model`` describes (see its docstring)."""

    block_module: ClassVar[type[nn.Module]] = BlockModule  # the module of each spec block

    def __init__(self, spec: Model) -> None:
        super().__init__()
        self.embedding = nn.Embedding(spec.vocab, spec.width) if spec.vocab else None
        blocks, width = [], spec.width
        for block in spec.blocks:
            blocks.append(self.block_module(block, width))
            width = block.out_width(width)
        self.blocks = nn.ModuleList(blocks)
        self.projection = nn.Linear(width, spec.width) if spec.needs_projection() else None
        if self.projection is not None:
            width = spec.width
        self.head = Head(width, spec.vocab or spec.outputs)
        if self.embedding is not None and spec.tied_head:
            self.head.weight = self.embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x)
        for index, block in enumerate(self.blocks):
            x = self.run_block(index, block, x)
        if self.projection is not None:
            x = self.projection(x)
        return self.head(x)

    def run_block(self, index: int, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Calls the ``index``-th block (a subclass may call it in a region of its own)."""
        return block(x)


def build(example: Example, device: torch.device, seed_offset: int = 0) -> PropertyModel:
    """The example's model, the same on every rank and every call (each rank's
    own with a ``seed_offset`` of its own)."""
    manual_seed(example.seed + seed_offset)
    return PropertyModel(example.model).to(device)


class Batch:
    """One microbatch of one rank: its inputs and its targets."""

    def __init__(self, model: Model, seed: int, device: torch.device) -> None:
        generator = torch.Generator().manual_seed(seed)
        if model.vocab:
            shape = (model.batch, model.seq)
            self.inputs = torch.randint(0, model.vocab, shape, generator=generator)
            self.targets = torch.randint(0, model.vocab, shape, generator=generator)
        else:
            self.inputs = torch.randn(model.batch, model.width, generator=generator)
            self.targets = torch.randn(model.batch, model.outputs, generator=generator)
        self.inputs = self.inputs.to(device)
        self.targets = self.targets.to(device)
        self._classes = model.vocab

    def loss(self, output: torch.Tensor) -> torch.Tensor:
        output = output.float()
        if self._classes:
            return F.cross_entropy(output.reshape(-1, self._classes), self.targets.reshape(-1))
        return F.mse_loss(output, self.targets)


def batch(example: Example, rank: int, step: int, micro: int, device: torch.device) -> Batch:
    seed = 1_000_003 * example.seed + 10_007 * step + 101 * micro + rank
    return Batch(example.model, seed, device)
