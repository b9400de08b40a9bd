"""The scenarios of the differential conformance search: plain data that every
rank turns into the same model, the same FSDP constructor arguments and the same
program of API calls, for either implementation.

[Note: A scenario is plain data]
As the property search's examples (``fsdptest.properties.examples``), a
scenario is a tree of frozen dataclasses of ints, bools, strings and enums: a
model (``Net``), the constructor's arguments (``Setup``) and a program
(``ops``: one ``Op`` per API call). Hypothesis draws and shrinks it in the
pytest process, it is pickled to the ranks, and ``replay_id()`` encodes it as
one token that ``Scenario.from_replay_id`` decodes, so that a failure can be
replayed alone from the line its report prints. Nothing here names an
implementation: the ranks build the same scenario once with the implementation
under test and once with the reference.
"""

from __future__ import annotations

import dataclasses
import enum
import zlib
from typing import Any, ClassVar

from fsdptest.properties.examples import (
    Precision,
    Prefetch,
    Sharding,
    Wrap,
    _plain,
    _rebuild,
    decode_replay_id,
    encode_replay_id,
)

# -- the model -----------------------------------------------------------------------------------


class LayerKind(enum.Enum):
    """A layer of a block. Every kind keeps the width but ``LINEAR`` and ``CHECKPOINTED``."""

    LINEAR = "linear"  # Linear(width_in, width), then tanh
    NORM = "norm"  # LayerNorm(width_in), affine when ``bias``
    SHARED = "shared"  # one Linear(w, w) applied twice
    TIED = "tied"  # two Linear(w, w) holding one weight
    SCALE = "scale"  # multiplies by a constant float buffer (persistent when ``persistent``)
    BATCHNORM = "batchnorm"  # BatchNorm1d over the last dimension (running stats, an int64 counter)
    COUNTER = "counter"  # adds a float64 buffer, counts its training forwards in an int64 buffer
    CHECKPOINTED = "checkpointed"  # LINEAR inside an activation-checkpointing wrapper


class BufferDType(enum.Enum):
    """The dtype of a ``SCALE`` layer's buffer."""

    FLOAT32 = "float32"
    FLOAT64 = "float64"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class AutogradOff(enum.Enum):
    """How a block's forward runs without autograd (``ON``: with it): under
    ``torch.no_grad()``, with its output detached, or under
    ``torch.inference_mode()`` with its output cloned (an inference tensor cannot
    be saved for the backward of what follows)."""

    ON = "on"
    NO_GRAD = "no_grad"
    DETACH = "detach"
    INFERENCE = "inference_mode"


@dataclasses.dataclass(frozen=True)
class Layer:
    kind: LayerKind
    width: int = 0  # LINEAR's and CHECKPOINTED's output width
    bias: bool = True
    frozen: bool = False
    persistent: bool = True  # SCALE, COUNTER: whether the buffers are in the state dict
    buffer_dtype: BufferDType = BufferDType.FLOAT32  # SCALE's buffer

    def out_width(self, width_in: int) -> int:
        changes = self.kind in (LayerKind.LINEAR, LayerKind.CHECKPOINTED)
        return self.width if changes else width_in

    def has_params(self) -> bool:
        if self.kind in (LayerKind.SCALE, LayerKind.COUNTER):
            return False
        return self.kind not in (LayerKind.NORM, LayerKind.BATCHNORM) or self.bias

    def describe(self, width_in: int) -> str:
        flags = [f for f, on in (("no-bias", not self.bias), ("frozen", self.frozen)) if on]
        if self.kind in (LayerKind.SCALE, LayerKind.COUNTER) and not self.persistent:
            flags = ["non-persistent"]
        if self.kind is LayerKind.SCALE and self.buffer_dtype is not BufferDType.FLOAT32:
            flags.append(self.buffer_dtype.value)
        shape = f"{width_in}->{self.out_width(width_in)}"
        return f"{self.kind.value}({', '.join([shape, *flags])})"


@dataclasses.dataclass(frozen=True)
class Block:
    """A submodule: its layers in order, then its child blocks in order."""

    layers: tuple[Layer, ...]
    children: tuple[Block, ...] = ()
    autograd: AutogradOff = AutogradOff.ON

    def out_width(self, width_in: int) -> int:
        for layer in self.layers:
            width_in = layer.out_width(width_in)
        for child in self.children:
            width_in = child.out_width(width_in)
        return width_in

    def all_layers(self) -> tuple[Layer, ...]:
        return self.layers + tuple(layer for c in self.children for layer in c.all_layers())

    def all_blocks(self) -> tuple[Block, ...]:
        return (self, *(b for c in self.children for b in c.all_blocks()))

    def describe(self, width_in: int) -> str:
        parts = []
        for layer in self.layers:
            parts.append(layer.describe(width_in))
            width_in = layer.out_width(width_in)
        for child in self.children:
            parts.append(child.describe(width_in))
            width_in = child.out_width(width_in)
        off = "" if self.autograd is AutogradOff.ON else f" under {self.autograd.value}"
        return f"[{', '.join(parts)}]{off}"


@dataclasses.dataclass(frozen=True)
class Net:
    """``vocab > 0``: token ids -> Embedding(vocab, width) -> blocks -> a head to
    ``vocab`` logits (tied to the embedding when ``tied_head``, through a
    projection when the blocks change the width), cross-entropy; ``vocab == 0``:
    features of ``width`` -> blocks -> a head to ``outputs``, mean squared error."""

    vocab: int
    width: int
    blocks: tuple[Block, ...]
    tied_head: bool = False
    outputs: int = 1
    batch: int = 2
    seq: int = 2

    def out_width(self) -> int:
        width = self.width
        for block in self.blocks:
            width = block.out_width(width)
        return width

    def needs_projection(self) -> bool:
        return self.vocab > 0 and self.tied_head and self.out_width() != self.width

    def layers(self) -> tuple[Layer, ...]:
        return tuple(layer for block in self.blocks for layer in block.all_layers())

    def all_blocks(self) -> tuple[Block, ...]:
        return tuple(b for block in self.blocks for b in block.all_blocks())

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


# -- the constructor's arguments ---------------------------------------------------------------


class Init(enum.Enum):
    """How the model's parameters come to be."""

    DEVICE = "device"  # built on the rank's device
    META = "meta"  # built on the meta device, materialised by ``param_init_fn``


class Optimizer(enum.Enum):
    SGD = "sgd"  # momentum: one state tensor per parameter
    ADAM = "adam"  # a scalar ``step`` tensor and two state tensors per parameter


@dataclasses.dataclass(frozen=True)
class Setup:
    """FSDP's constructor arguments, and the optimizer. ``replicas``: the hybrid
    replica count (1 otherwise); ``mesh``: pass a ``device_mesh`` (2-D for hybrid
    strategies) instead of process groups; ``ignored_blocks`` index the top-level
    blocks, passed as ``ignored_modules`` or, with ``ignored_as_states``, as
    ``ignored_states`` (their parameters); ``rank_seeded``: each rank builds its
    model from its own seed (what ``sync_module_states`` makes equal)."""

    sharding: Sharding = Sharding.FULL_SHARD
    replicas: int = 1
    mesh: bool = False
    use_orig_params: bool = False
    mixed_precision: Precision | None = None
    offload_params: bool = False
    backward_prefetch: Prefetch = Prefetch.BACKWARD_PRE
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    wrap: Wrap = Wrap.NONE
    min_num_params: int = 0
    ignored_blocks: tuple[int, ...] = ()
    ignored_as_states: bool = False
    init: Init = Init.DEVICE
    sync_module_states: bool = False
    rank_seeded: bool = False
    optimizer: Optimizer = Optimizer.SGD
    full_prec_in_eval: bool = False  # FSDP_USE_FULL_PREC_IN_EVAL=1 while the units are built

    def describe(self) -> str:
        parts = [self.sharding.name]
        if self.sharding.is_hybrid():
            parts.append(f"replicas={self.replicas}")
        if self.mesh:
            parts.append("device_mesh")
        parts.append(f"use_orig_params={self.use_orig_params}")
        if self.mixed_precision is not None:
            parts.append(self.mixed_precision.describe())
        if self.offload_params:
            parts.append("CPUOffload(offload_params=True)")
        parts.append(f"backward_prefetch={self.backward_prefetch.name}")
        for flag in ("forward_prefetch", "sync_module_states"):
            if getattr(self, flag):
                parts.append(f"{flag}=True")
        if not self.limit_all_gathers:
            parts.append("limit_all_gathers=False")
        wrap = {Wrap.NONE: "no auto-wrap", Wrap.BLOCKS: "ModuleWrapPolicy({Block})"}
        parts.append(wrap.get(self.wrap, f"size_based(min_num_params={self.min_num_params})"))
        if self.ignored_blocks:
            what = "ignored_states=params of" if self.ignored_as_states else "ignored_modules="
            parts.append(f"{what}blocks{list(self.ignored_blocks)}")
        if self.init is Init.META:
            parts.append("meta device + param_init_fn")
        if self.rank_seeded:
            parts.append("each rank its own initial values")
        if self.full_prec_in_eval:
            parts.append("FSDP_USE_FULL_PREC_IN_EVAL=1")
        parts.append(f"optimizer={self.optimizer.name}")
        return ", ".join(parts)


# -- the program ---------------------------------------------------------------------------------


class StateDictKind(enum.Enum):
    FULL = "FULL_STATE_DICT"
    SHARDED = "SHARDED_STATE_DICT"
    LOCAL = "LOCAL_STATE_DICT"


@dataclasses.dataclass(frozen=True)
class Settings:
    """A state-dict type and its configs; ``configs=False`` passes none (the
    defaults). ``rank0_only`` is the full configs' field, ``dtensor`` the sharded
    configs' ``_use_dtensor``; ``optim_offload`` is the optimizer config's
    ``offload_to_cpu``."""

    kind: StateDictKind = StateDictKind.FULL
    configs: bool = True
    offload_to_cpu: bool = False
    rank0_only: bool = False
    dtensor: bool = False
    optim_offload: bool = True
    optim_rank0_only: bool = False

    def describe(self) -> str:
        if not self.configs:
            return self.kind.value
        fields = {"offload_to_cpu": self.offload_to_cpu}
        if self.kind is StateDictKind.FULL:
            fields["rank0_only"] = self.rank0_only
        if self.kind is StateDictKind.SHARDED:
            fields["_use_dtensor"] = self.dtensor
        optim = {"offload_to_cpu": self.optim_offload}
        if self.kind is StateDictKind.FULL:
            optim["rank0_only"] = self.optim_rank0_only
        text = ", ".join(f"{k}={v}" for k, v in fields.items())
        optim_text = ", ".join(f"{k}={v}" for k, v in optim.items())
        return f"{self.kind.value}, config({text}), optim_config({optim_text})"


class LoadEdit(enum.Enum):
    """How a saved state dict is changed before it is loaded."""

    NONE = "as saved"
    DROP = "without its first key"
    EXTRA = "with an extra key"


class OptimApi(enum.Enum):
    """How an optimizer state dict is saved (and so how it is loaded back)."""

    OPTIM_STATE_DICT = "optim_state_dict"  # under the current state-dict settings
    FULL = "full_optim_state_dict"  # deprecated
    SHARDED = "sharded_optim_state_dict"  # deprecated


class HookKind(enum.Enum):
    """A communication hook: ``RECORDING`` records what it is handed and reduces
    (sums, then divides by the group size); ``LOCAL`` records it and keeps each
    rank's own gradient (no communication); ``FP16_COMPRESS`` and
    ``BF16_COMPRESS`` are torch's low-precision hooks
    (``torch.distributed.algorithms._comm_hooks.default_hooks``), registered
    with a ``LowPrecisionState`` of the root's process group."""

    RECORDING = "recording"
    LOCAL = "local"
    FP16_COMPRESS = "fp16_compress_hook"
    BF16_COMPRESS = "bf16_compress_hook"


class ApplyFn(enum.Enum):
    """What ``FSDP.apply(fn)`` applies to every module."""

    SCALE_LINEARS = "scale every Linear's weight by 0.5"
    FILL_BUFFERS = "add 1 to every floating-point buffer"


@dataclasses.dataclass(frozen=True)
class Op:
    """One API call of a program; ``NAME`` is its name in replay ids."""

    NAME: ClassVar[str] = ""

    def describe(self) -> str:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        args = ", ".join(f"{k}={_text(v)}" for k, v in fields.items())
        return f"{self.NAME}({args})"


@dataclasses.dataclass(frozen=True)
class Forward(Op):
    """``loss = loss_fn(model(batch))``; ``no_grad``: under ``torch.no_grad()``;
    ``again``: another forward before the waiting one's backward, whose loss is
    added to the waiting one (one backward through both)."""

    NAME: ClassVar[str] = "forward"
    no_grad: bool = False
    again: bool = False


@dataclasses.dataclass(frozen=True)
class Backward(Op):
    NAME: ClassVar[str] = "backward"


@dataclasses.dataclass(frozen=True)
class OptimStep(Op):
    NAME: ClassVar[str] = "optim.step"


@dataclasses.dataclass(frozen=True)
class ZeroGrad(Op):
    """``optim.zero_grad`` or, ``on_model``, ``model.zero_grad``."""

    NAME: ClassVar[str] = "zero_grad"
    set_to_none: bool = True
    on_model: bool = False


@dataclasses.dataclass(frozen=True)
class Train(Op):
    NAME: ClassVar[str] = "train"
    mode: bool = True


@dataclasses.dataclass(frozen=True)
class EnterNoSync(Op):
    NAME: ClassVar[str] = "enter no_sync"


@dataclasses.dataclass(frozen=True)
class Exit(Op):
    """Leaves the innermost open context (``no_sync``, ``summon_full_params``,
    ``state_dict_type``)."""

    NAME: ClassVar[str] = "exit"


@dataclasses.dataclass(frozen=True)
class ClipGradNorm(Op):
    NAME: ClassVar[str] = "clip_grad_norm_"
    max_norm: float = 0.05
    norm_type: float = 2.0


@dataclasses.dataclass(frozen=True)
class SetStateDictType(Op):
    NAME: ClassVar[str] = "set_state_dict_type"
    settings: Settings = Settings()


@dataclasses.dataclass(frozen=True)
class EnterStateDictType(Op):
    NAME: ClassVar[str] = "enter state_dict_type"
    settings: Settings = Settings()


@dataclasses.dataclass(frozen=True)
class SaveStateDict(Op):
    """``model.state_dict()`` under the current settings, kept as the next slot."""

    NAME: ClassVar[str] = "state_dict"


@dataclasses.dataclass(frozen=True)
class LoadStateDict(Op):
    NAME: ClassVar[str] = "load_state_dict"
    slot: int = 0
    strict: bool = True
    edit: LoadEdit = LoadEdit.NONE


@dataclasses.dataclass(frozen=True)
class SaveOptimState(Op):
    NAME: ClassVar[str] = "save optimizer state"
    api: OptimApi = OptimApi.OPTIM_STATE_DICT
    rank0_only: bool = True  # full_optim_state_dict's (the FULL api's) argument


@dataclasses.dataclass(frozen=True)
class LoadOptimState(Op):
    """Loads an optimizer slot into the optimizer by the loader that fits how it
    was saved (``optim_state_dict_to_load``, ``shard_full_optim_state_dict``,
    ``scatter_full_optim_state_dict`` with ``scatter``, or
    ``flatten_sharded_optim_state_dict``)."""

    NAME: ClassVar[str] = "load optimizer state"
    slot: int = 0
    scatter: bool = False


@dataclasses.dataclass(frozen=True)
class RekeyOptimState(Op):
    """``rekey_optim_state_dict`` of a full optimizer slot, by parameter IDs."""

    NAME: ClassVar[str] = "rekey_optim_state_dict"
    slot: int = 0


@dataclasses.dataclass(frozen=True)
class EnterSummon(Op):
    NAME: ClassVar[str] = "enter summon_full_params"
    recurse: bool = True
    writeback: bool = True
    rank0_only: bool = False
    offload_to_cpu: bool = False
    with_grads: bool = False


@dataclasses.dataclass(frozen=True)
class EditParams(Op):
    """``p.mul_(0.75).add_(0.01)`` under ``no_grad`` for every parameter the model
    lists (``grads``: for every gradient there is instead)."""

    NAME: ClassVar[str] = "edit parameters"
    grads: bool = False


@dataclasses.dataclass(frozen=True)
class SetGrads(Op):
    """``p.grad = torch.full_like(p, value)`` for every parameter the model lists
    (``none_first``: the first one's ``.grad = None``; ``only_first``: the first
    one alone, as another optimizer's ``zero_grad`` over it does): gradients a
    user sets."""

    NAME: ClassVar[str] = "set gradients"
    value: float = 0.25
    none_first: bool = False
    only_first: bool = False  # the others keep their gradients


@dataclasses.dataclass(frozen=True)
class ReplaceData(Op):
    """``p.data = <new storage>`` for every parameter the model lists (the values
    scaled by 0.5; ``flatten``: of shape ``(numel,)`` instead of the parameter's)."""

    NAME: ClassVar[str] = "replace parameter data"
    flatten: bool = False


@dataclasses.dataclass(frozen=True)
class ReplaceParams(Op):
    """``setattr(module, name, nn.Parameter(...))`` for every original parameter
    (its values scaled by 0.5, its shape and ``requires_grad`` kept), then a new
    optimizer over ``model.parameters()``, as a user who replaces parameters
    writes it (``use_orig_params``)."""

    NAME: ClassVar[str] = "replace parameters"


@dataclasses.dataclass(frozen=True)
class ScaledBackward(Op):
    """``scaler.scale(loss).backward()`` with the implementation's
    ``ShardedGradScaler``, made at the program's first scaled backward as a user
    writes it: ``ShardedGradScaler(device=<the ranks' device type>)``, with
    ``growth_interval`` when it is not None."""

    NAME: ClassVar[str] = "scaled backward"
    growth_interval: int | None = None


@dataclasses.dataclass(frozen=True)
class ScalerStep(Op):
    """``scaler.unscale_(optim)`` then ``model.clip_grad_norm_(0.05)`` when
    ``clip``; ``scaler.step(optim)``; ``scaler.update()``. The collectives of the
    unscaling are observed apart from the op's others."""

    NAME: ClassVar[str] = "scaler step"
    clip: bool = False


@dataclasses.dataclass(frozen=True)
class Apply(Op):
    NAME: ClassVar[str] = "apply"
    fn: ApplyFn = ApplyFn.SCALE_LINEARS


@dataclasses.dataclass(frozen=True)
class RegisterCommHook(Op):
    NAME: ClassVar[str] = "register_comm_hook"
    kind: HookKind = HookKind.RECORDING


@dataclasses.dataclass(frozen=True)
class FsdpModules(Op):
    NAME: ClassVar[str] = "fsdp_modules"
    root_only: bool = False


@dataclasses.dataclass(frozen=True)
class WrapAgain(Op):
    """``FSDP(model)`` of the root, which is already FSDP (a misuse); on success
    the new wrapper is the model from then on."""

    NAME: ClassVar[str] = "wrap the root again"


@dataclasses.dataclass(frozen=True)
class Final(Op):
    """The closing observation: every full parameter (summoned) and a full state
    dict under default settings."""

    NAME: ClassVar[str] = "final"


OPS: dict[str, type[Op]] = {
    cls.NAME: cls
    for cls in (
        Forward,
        Backward,
        OptimStep,
        ZeroGrad,
        Train,
        EnterNoSync,
        Exit,
        ClipGradNorm,
        SetStateDictType,
        EnterStateDictType,
        SaveStateDict,
        LoadStateDict,
        SaveOptimState,
        LoadOptimState,
        RekeyOptimState,
        EnterSummon,
        EditParams,
        SetGrads,
        ReplaceData,
        ReplaceParams,
        ScaledBackward,
        ScalerStep,
        Apply,
        RegisterCommHook,
        FsdpModules,
        WrapAgain,
        Final,
    )
}


# -- the scenario ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Scenario:
    world_size: int
    net: Net
    setup: Setup
    ops: tuple[Op, ...]
    seed: int = 0

    def describe(self) -> str:
        ops = "\n".join(f"    {i}: {op.describe()}" for i, op in enumerate(self.ops))
        return (
            f"world_size={self.world_size}, seed={self.seed}\n"
            f"  model:  {self.net.describe()}\n"
            f"  fsdp:   {self.setup.describe()}\n"
            f"  program:\n{ops}"
        )

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(f"Scenario({self.describe()})")

    def replay_id(self) -> str:
        data = {
            "world_size": self.world_size,
            "seed": self.seed,
            "net": _plain(self.net),
            "setup": _plain(self.setup),
            "ops": [[op.NAME, _plain(op)] for op in self.ops],
        }
        return encode_replay_id(data)

    @classmethod
    def from_replay_id(cls, replay_id: str) -> Scenario:
        try:
            data = decode_replay_id(replay_id)
            ops = tuple(_rebuild(OPS[name], fields) for name, fields in data["ops"])
            return cls(
                world_size=data["world_size"],
                net=_rebuild(Net, data["net"]),
                setup=_rebuild(Setup, data["setup"]),
                ops=ops,
                seed=data.get("seed", 0),
            )
        except (ValueError, KeyError, TypeError, zlib.error) as error:
            raise ValueError(f"not a conformance scenario's replay id: {replay_id!r}") from error


def _text(value: object) -> str:
    if isinstance(value, enum.Enum):
        return value.name
    if dataclasses.is_dataclass(value) and hasattr(value, "describe"):
        return str(value.describe())
    return str(value)


class ProgramNotAsDrawn(BaseException):
    """[Note: A program that is not what was drawn]
    The drawing keeps a model of the program's state (the state dict type in
    effect, what each slot was saved under) and draws only what that model says is
    valid. Where the model is wrong, both implementations may refuse the program
    alike, and a refusal both make is an observation, not a difference: the
    search would pass while checking less than it drew. The trace checks the
    model where it can read the truth (a load's slot against the type in effect)
    and raises this, which no ``catching()`` swallows (it is not an
    ``Exception``), so the scenario fails as a defect of the search."""
