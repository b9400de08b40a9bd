"""The torch modules a scenario's ``Net`` builds, and its data (rank side).

The layers of the property search (``fsdptest.properties.modules``) plus three
kinds its models lack: a batch norm (running statistics and an int64 counter
among the buffers), a counter (a float64 buffer added to the activations and
an int64 buffer counting training forwards: buffers of dtypes mixed precision
must not touch or must restore) and a Linear inside torch's
activation-checkpointing wrapper (recomputed in backward; its names carry the
wrapper's prefix). [Note: What keeps a drawn model wrappable] in that module
holds here too.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)

from fsdptest.conformance.scenario import (
    ApplyFn,
    AutogradOff,
    Block,
    BufferDType,
    Layer,
    LayerKind,
    Net,
)
from fsdptest.properties.modules import (
    Activated,
    PropertyModel,
    Scale,
    SharedLinear,
    TiedLinears,
)
from harness.seeding import manual_seed


class BatchNorm(nn.Module):
    """BatchNorm1d over the last dimension of inputs of any rank."""

    def __init__(self, width: int, affine: bool) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(width, affine=affine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.reshape(-1, x.shape[-1])).reshape(x.shape)


class Counter(nn.Module):
    """Adds a float64 offset; counts training forwards in an int64 buffer."""

    offset: torch.Tensor
    count: torch.Tensor

    def __init__(self, width: int, persistent: bool) -> None:
        super().__init__()
        offset = 0.01 * torch.arange(width, dtype=torch.float64)
        self.register_buffer("offset", offset, persistent=persistent)
        self.register_buffer("count", torch.zeros((), dtype=torch.int64), persistent=persistent)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.count += 1
        return x + self.offset.to(x.dtype)


class TypedScale(Scale):
    """``Scale`` with its buffer in a given dtype (the product is in the input's)."""

    def __init__(self, width: int, persistent: bool, dtype: torch.dtype) -> None:
        super().__init__(width, persistent)
        self.scale = self.scale.to(dtype)


class NetBlock(nn.Module):
    """A scenario's ``Block``: its layers, then its child blocks, each child called
    with autograd on or off as its ``Block.autograd`` says (``run_block``)."""

    def __init__(self, spec: Block, width_in: int) -> None:
        super().__init__()
        layers = []
        for layer in spec.layers:
            layers.append(_layer(layer, width_in))
            width_in = layer.out_width(width_in)
        self.layers = nn.Sequential(*layers)
        children = []
        for child in spec.children:
            children.append(NetBlock(child, width_in))
            width_in = child.out_width(width_in)
        self.children_blocks = nn.ModuleList(children)
        self.child_modes = tuple(child.autograd for child in spec.children)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(x)
        for child, mode in zip(self.children_blocks, self.child_modes):
            x = run_block(child, mode, x)
        return x


def run_block(block: nn.Module, mode: AutogradOff, x: torch.Tensor) -> torch.Tensor:
    """Calls ``block`` with autograd off as ``mode`` says. The region encloses the
    call, as a model that freezes a trunk writes it (``with torch.no_grad(): x =
    self.trunk(x)``): FSDP's pre-forward of the block's unit, and a forward
    prefetch it starts, run inside it too."""
    with _REGIONS.get(mode, contextlib.nullcontext)():
        x = block(x)
    if mode is AutogradOff.DETACH:
        return x.detach()
    if mode is AutogradOff.INFERENCE:
        return x.clone()  # a normal tensor again: what follows may save it for backward
    return x


_REGIONS: dict[AutogradOff, Callable[[], contextlib.AbstractContextManager[object]]] = {
    AutogradOff.NO_GRAD: torch.no_grad,
    AutogradOff.INFERENCE: torch.inference_mode,
}
_BUFFER_DTYPES = {
    BufferDType.FLOAT32: torch.float32,
    BufferDType.FLOAT64: torch.float64,
    BufferDType.FLOAT16: torch.float16,
    BufferDType.BFLOAT16: torch.bfloat16,
}


def _layer(spec: Layer, width_in: int) -> nn.Module:
    module: nn.Module
    kind = spec.kind
    if kind is LayerKind.LINEAR:
        module = Activated(width_in, spec.width, spec.bias)
    elif kind is LayerKind.CHECKPOINTED:
        inner = Activated(width_in, spec.width, spec.bias)
        module = checkpoint_wrapper(inner, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    elif kind is LayerKind.NORM:
        module = nn.LayerNorm(width_in, elementwise_affine=spec.bias)
    elif kind is LayerKind.BATCHNORM:
        module = BatchNorm(width_in, spec.bias)
    elif kind is LayerKind.SHARED:
        module = SharedLinear(width_in, spec.bias)
    elif kind is LayerKind.TIED:
        module = TiedLinears(width_in, spec.bias)
    elif kind is LayerKind.COUNTER:
        module = Counter(width_in, spec.persistent)
    else:
        module = TypedScale(width_in, spec.persistent, _BUFFER_DTYPES[spec.buffer_dtype])
    if spec.frozen:
        module.requires_grad_(False)
    return module


class ConformanceNet(PropertyModel):
    """The module a scenario's ``Net`` describes: the property search's model
    with this package's blocks (``Net`` has the fields ``PropertyModel`` reads)."""

    block_module = NetBlock

    def __init__(self, spec: Net) -> None:
        super().__init__(spec)  # type: ignore[arg-type]
        self.block_modes = tuple(block.autograd for block in spec.blocks)

    def run_block(self, index: int, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return run_block(block, self.block_modes[index], x)


def build(spec: Net, seed: int, device: torch.device) -> ConformanceNet:
    """The model, the same for the same seed (on the meta device: no values)."""
    manual_seed(seed)
    if device.type == "meta":
        with torch.device("meta"):
            return ConformanceNet(spec)
    return ConformanceNet(spec).to(device)


@torch.no_grad()
def materialize(module: nn.Module, names: dict[int, str], device: torch.device) -> None:
    """A ``param_init_fn``: moves ``module``'s own meta tensors to ``device`` and
    fills each from its name alone (``names``: module id -> name in the model),
    so that the values do not depend on the order an implementation calls it in."""
    module.to_empty(device=device, recurse=False)
    prefix = names.get(id(module), "?")
    for name, tensor in [
        *module.named_parameters(recurse=False),
        *module.named_buffers(recurse=False),
    ]:
        tensor.copy_(deterministic_values(f"{prefix}.{name}", tensor))


def deterministic_values(name: str, like: torch.Tensor) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if like.is_floating_point():
        values = torch.rand(like.shape, generator=generator, dtype=torch.float64) - 0.5
    else:
        values = torch.randint(0, 3, like.shape, generator=generator)
    return values.to(dtype=like.dtype, device=like.device)


class Batch:
    """One forward's inputs and targets on one rank."""

    def __init__(self, spec: Net, seed: int, device: torch.device) -> None:
        generator = torch.Generator().manual_seed(seed)
        if spec.vocab:
            shape = (spec.batch, spec.seq)
            self.inputs = torch.randint(0, spec.vocab, shape, generator=generator)
            self.targets = torch.randint(0, spec.vocab, shape, generator=generator)
        else:
            self.inputs = torch.randn(spec.batch, spec.width, generator=generator)
            self.targets = torch.randn(spec.batch, spec.outputs, generator=generator)
        self.inputs = self.inputs.to(device)
        self.targets = self.targets.to(device)
        self._classes = spec.vocab

    def loss(self, output: torch.Tensor) -> torch.Tensor:
        output = output.float()
        if self._classes:
            return F.cross_entropy(output.reshape(-1, self._classes), self.targets.reshape(-1))
        return F.mse_loss(output, self.targets)


def batch(spec: Net, seed: int, rank: int, op_index: int, device: torch.device) -> Batch:
    return Batch(spec, 1_000_003 * seed + 10_007 * op_index + rank, device)


@torch.no_grad()
def _scale_linears(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        module.weight.mul_(0.5)


@torch.no_grad()
def _fill_buffers(module: nn.Module) -> None:
    for buffer in module.buffers(recurse=False):
        if buffer.is_floating_point():
            buffer.add_(1.0)


APPLY_FNS: dict[ApplyFn, Callable[[nn.Module], None]] = {
    # the functions a program's ``apply`` op hands ``module.apply``
    ApplyFn.SCALE_LINEARS: _scale_linears,
    ApplyFn.FILL_BUFFERS: _fill_buffers,
}
