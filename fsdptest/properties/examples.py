"""The examples of the property search: plain data that rebuilds a model, an FSDP
configuration and a training schedule the same way on every rank.

[Note: Examples are plain data]
An example is a tree of frozen dataclasses of ints, bools, strings and enums;
nothing in it is a tensor, a module or a torch object. Hypothesis draws and
shrinks it in the pytest process, it is pickled to the ranks, and every rank
builds the same model (seeded), the same FSDP arguments and the same schedule
from it. ``describe()`` renders it on one screen, and ``replay_id()`` encodes
it as one token (compressed JSON) that ``Example.from_replay_id`` decodes: a
failing example can be re-run alone, without hypothesis and without its
database, from the line the report prints.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import json
import types
import typing
import zlib
from typing import Any


class LayerKind(enum.Enum):
    """A layer of a block. Every kind keeps the width but ``LINEAR``."""

    LINEAR = "linear"  # Linear(width_in, width), then tanh
    NORM = "norm"  # LayerNorm(width_in), affine when ``bias``
    SHARED = "shared"  # one Linear(w, w) applied twice: a module used twice in forward
    TIED = "tied"  # two Linear(w, w) modules holding one weight parameter (own biases)
    SCALE = "scale"  # multiplies by a constant buffer, persistent when ``persistent``


@dataclasses.dataclass(frozen=True)
class Layer:
    kind: LayerKind
    width: int = 0  # LINEAR's output width; the other kinds keep their input's
    bias: bool = True  # Linear bias, or LayerNorm's affine parameters
    frozen: bool = False  # requires_grad=False for the layer's parameters
    persistent: bool = True  # SCALE: whether its buffer is in the state dict

    def describe(self, width_in: int) -> str:
        flags = [f for f, on in (("no-bias", not self.bias), ("frozen", self.frozen)) if on]
        if self.kind is LayerKind.SCALE:
            flags = ["buffer" if self.persistent else "non-persistent buffer"]
        shape = f"{width_in}->{self.out_width(width_in)}"
        return f"{self.kind.value}({', '.join([shape, *flags])})"

    def out_width(self, width_in: int) -> int:
        return self.width if self.kind is LayerKind.LINEAR else width_in

    def has_params(self) -> bool:
        return self.kind is not LayerKind.SCALE and (self.kind is not LayerKind.NORM or self.bias)


@dataclasses.dataclass(frozen=True)
class Block:
    """A submodule: its layers in order, then its child blocks in order."""

    layers: tuple[Layer, ...]
    children: tuple[Block, ...] = ()

    def out_width(self, width_in: int) -> int:
        for layer in self.layers:
            width_in = layer.out_width(width_in)
        for child in self.children:
            width_in = child.out_width(width_in)
        return width_in

    def describe(self, width_in: int) -> str:
        parts = []
        for layer in self.layers:
            parts.append(layer.describe(width_in))
            width_in = layer.out_width(width_in)
        for child in self.children:
            parts.append(child.describe(width_in))
            width_in = child.out_width(width_in)
        return f"[{', '.join(parts)}]"

    def all_layers(self) -> tuple[Layer, ...]:
        return self.layers + tuple(layer for c in self.children for layer in c.all_layers())


@dataclasses.dataclass(frozen=True)
class Model:
    """``vocab > 0``: token ids -> Embedding(vocab, width) -> blocks -> a head to
    ``vocab`` logits, cross-entropy against token targets; the head's weight is
    the embedding's when ``tied_head`` (through a projection back to ``width``
    when the blocks end in another width). ``vocab == 0``: features of ``width``
    -> blocks -> a head to ``outputs``, mean squared error."""

    vocab: int
    width: int
    blocks: tuple[Block, ...]
    tied_head: bool = False
    outputs: int = 1
    batch: int = 2
    seq: int = 3

    def out_width(self) -> int:
        width = self.width
        for block in self.blocks:
            width = block.out_width(width)
        return width

    def needs_projection(self) -> bool:
        return self.vocab > 0 and self.tied_head and self.out_width() != self.width

    def describe(self) -> str:
        if self.vocab:
            source = f"tokens(vocab={self.vocab}, batch={self.batch}x{self.seq}) -> embedding({self.width})"
        else:
            source = f"features({self.width}, batch={self.batch})"
        parts, width = [source], self.width
        for block in self.blocks:
            parts.append(block.describe(width))
            width = block.out_width(width)
        if self.needs_projection():
            parts.append(f"projection({width}->{self.width})")
            width = self.width
        head = f"head({width}->{self.vocab or self.outputs}"
        parts.append(head + (", tied to the embedding)" if self.vocab and self.tied_head else ")"))
        return " -> ".join(parts)

    def layer_count(self) -> int:
        return sum(len(b.all_layers()) for b in self.blocks)


class Sharding(enum.Enum):
    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"
    HYBRID_SHARD_ZERO2 = "_HYBRID_SHARD_ZERO2"

    def is_hybrid(self) -> bool:
        return self in (Sharding.HYBRID_SHARD, Sharding.HYBRID_SHARD_ZERO2)


class DType(enum.Enum):
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class Prefetch(enum.Enum):
    NONE = "none"
    BACKWARD_PRE = "BACKWARD_PRE"
    BACKWARD_POST = "BACKWARD_POST"


class Wrap(enum.Enum):
    """The auto-wrap policy: none (one unit), every ``Block`` (``ModuleWrapPolicy``),
    or ``size_based_auto_wrap_policy`` with ``min_num_params``."""

    NONE = "none"
    BLOCKS = "blocks"
    SIZE = "size"


@dataclasses.dataclass(frozen=True)
class Precision:
    """Every field of ``MixedPrecision``; None dtypes as torch's (not cast)."""

    param_dtype: DType | None = None
    reduce_dtype: DType | None = None
    buffer_dtype: DType | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    norms_in_full_precision: bool = False  # _module_classes_to_ignore adds LayerNorm

    def describe(self) -> str:
        fields = dataclasses.asdict(self)
        defaults = dataclasses.asdict(Precision())
        changed = [f"{k}={_text(v)}" for k, v in fields.items() if v != defaults[k]]
        return f"MixedPrecision({', '.join(changed)})"


@dataclasses.dataclass(frozen=True)
class Config:
    """The FSDP constructor's arguments. ``replicas`` is the hybrid mesh's replica
    count (the shard group has ``world_size // replicas`` ranks); 1 otherwise.
    ``ignored_blocks`` index the model's top-level blocks."""

    sharding: Sharding = Sharding.FULL_SHARD
    replicas: int = 1
    use_orig_params: bool = False
    mixed_precision: Precision | None = None
    offload_params: bool = False
    backward_prefetch: Prefetch = Prefetch.BACKWARD_PRE
    forward_prefetch: bool = False
    wrap: Wrap = Wrap.NONE
    min_num_params: int = 0
    ignored_blocks: tuple[int, ...] = ()
    # every rank builds its model from its own seed; FSDP (sync_module_states=True)
    # and DDP both start from rank 0's states
    sync_module_states: bool = False

    def describe(self) -> str:
        parts = [self.sharding.name]
        if self.sharding.is_hybrid():
            parts.append(f"replicas={self.replicas}")
        parts.append(f"use_orig_params={self.use_orig_params}")
        if self.mixed_precision is not None:
            parts.append(self.mixed_precision.describe())
        if self.offload_params:
            parts.append("CPUOffload(offload_params=True)")
        parts.append(f"backward_prefetch={self.backward_prefetch.name}")
        if self.forward_prefetch:
            parts.append("forward_prefetch=True")
        wrap = {Wrap.NONE: "no auto-wrap", Wrap.BLOCKS: "ModuleWrapPolicy({Block})"}
        parts.append(wrap.get(self.wrap, f"size_based(min_num_params={self.min_num_params})"))
        if self.ignored_blocks:
            parts.append(f"ignored_modules=blocks{list(self.ignored_blocks)}")
        if self.sync_module_states:
            parts.append("sync_module_states=True (each rank its own initial values)")
        return ", ".join(parts)

    def shard_size(self, world_size: int) -> int:
        """The ranks one flat parameter is sharded over."""
        if self.sharding is Sharding.NO_SHARD:
            return 1
        return world_size // self.replicas if self.sharding.is_hybrid() else world_size


class Clip(enum.Enum):
    """``clip_grad_norm_`` before the optimizer step: (max_norm, norm_type). The
    small maximum makes clipping happen."""

    NONE = "none"
    L2 = "l2"
    L1 = "l1"
    INF = "inf"

    def arguments(self) -> tuple[float, float] | None:
        norm_type = {Clip.L2: 2.0, Clip.L1: 1.0, Clip.INF: float("inf")}.get(self)
        return None if norm_type is None else (0.05, norm_type)


class Between(enum.Enum):
    """What happens after a step's optimizer step, before the next step."""

    NOTHING = "nothing"
    FULL_STATE_DICT = "full_state_dict"  # save, zero the parameters, load
    SHARDED_STATE_DICT = "sharded_state_dict"
    LOCAL_STATE_DICT = "local_state_dict"
    SUMMON_EDIT = "summon_edit"  # summon_full_params(writeback=True), scale every parameter
    # the same with offload_to_cpu=True (the edits are made on CPU copies)
    SUMMON_EDIT_OFFLOADED = "summon_edit_offloaded"


SYNC, NO_SYNC = "S", "N"


@dataclasses.dataclass(frozen=True)
class Step:
    """One optimizer step: ``microbatches`` is one letter per backward, ``N``
    under ``no_sync()`` and ``S`` synced, ending in ``S``."""

    microbatches: str = SYNC
    set_to_none: bool = True
    clip: Clip = Clip.NONE
    then: Between = Between.NOTHING

    def describe(self) -> str:
        parts = [self.microbatches, f"zero_grad(set_to_none={self.set_to_none})"]
        if self.clip is not Clip.NONE:
            max_norm, norm_type = self.clip.arguments()  # type: ignore[misc]
            parts.append(f"clip_grad_norm_({max_norm}, {norm_type})")
        if self.then is not Between.NOTHING:
            parts.append(f"then {self.then.value}")
        return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class Example:
    world_size: int
    model: Model
    config: Config
    steps: tuple[Step, ...]
    seed: int = 0

    def describe(self) -> str:
        steps = "; ".join(f"{i}: {s.describe()}" for i, s in enumerate(self.steps))
        return (
            f"world_size={self.world_size}, seed={self.seed}\n"
            f"  model:  {self.model.describe()}\n"
            f"  fsdp:   {self.config.describe()}\n"
            f"  steps:  {steps}"
        )

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """How hypothesis prints a drawn example."""
        printer.text(f"Example({self.describe()})")

    def replay_id(self) -> str:
        return encode_replay_id(_plain(self))

    @classmethod
    def from_replay_id(cls, replay_id: str) -> Example:
        return _rebuild(cls, decode_replay_id(replay_id))


def encode_replay_id(data: Any) -> str:
    """JSON ``data`` as a replay id: compressed, URL-safe base64 (one shell word)."""
    text = json.dumps(data, separators=(",", ":"))
    return base64.urlsafe_b64encode(zlib.compress(text.encode(), 9)).decode()


def decode_replay_id(replay_id: str) -> Any:
    """The JSON data of ``replay_id`` (raises ValueError or zlib.error on garbage)."""
    return json.loads(zlib.decompress(base64.urlsafe_b64decode(replay_id.encode())).decode())


def _text(value: object) -> str:
    return value.name if isinstance(value, enum.Enum) else str(value)


def _plain(value: object) -> Any:
    """JSON data: dataclasses as dicts of their fields that differ from the
    default, enums by value, tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _plain(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if f.default is dataclasses.MISSING or getattr(value, f.name) != f.default
        }
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _rebuild(kind: Any, data: Any) -> Any:
    """The inverse of ``_plain`` for the type ``kind`` (from the dataclasses' hints)."""
    if data is None:
        return None
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(kind) if a is not type(None)]
        return _rebuild(inner, data)
    if origin is tuple:
        return tuple(_rebuild(typing.get_args(kind)[0], v) for v in data)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return kind(data)
    if dataclasses.is_dataclass(kind):
        hints = typing.get_type_hints(kind)
        return kind(**{name: _rebuild(hints[name], v) for name, v in data.items()})
    return data


def biased_one_by_one(
    blocks: tuple[Any, ...], width: int, kinds: tuple[Any, ...]
) -> tuple[Any, ...]:
    """``blocks`` (of either model description: a property example's or a
    conformance scenario's) with a bias given to every layer of ``kinds`` that
    maps width 1 to width 1, so that no unit's flat parameter has one element
    (see [Note: What torch's FSDP is not asked] in fsdptest.properties.strategies)."""

    def fix(block: Any, width: int) -> Any:
        fixed = []
        for layer in block.layers:
            out = layer.out_width(width)
            one_by_one = width == 1 and out == 1 and layer.kind in kinds
            fixed.append(dataclasses.replace(layer, bias=True) if one_by_one else layer)
            width = out
        children = []
        for child in block.children:
            children.append(fix(child, width))
            width = child.out_width(width)
        return dataclasses.replace(block, layers=tuple(fixed), children=tuple(children))

    fixed = []
    for block in blocks:
        fixed.append(fix(block, width))
        width = block.out_width(width)
    return tuple(fixed)


def first_block_trainable(blocks: tuple[Any, ...]) -> tuple[Any, ...]:
    """``blocks`` (of either model description) with the layers of the first block,
    in forward order, that has parameters unfrozen."""
    done = False

    def visit(block: Any) -> Any:
        nonlocal done
        layers = block.layers
        if not done and any(layer.has_params() for layer in layers):
            layers = tuple(dataclasses.replace(layer, frozen=False) for layer in layers)
            done = True
        children = tuple(visit(child) for child in block.children)
        return dataclasses.replace(block, layers=layers, children=children)

    return tuple(visit(block) for block in blocks)
