"""FSDP2 programs as plain data: the model, how ``fully_shard`` is applied, and
the calls made on it (pytest-process side: imports no FSDP implementation).

[Note: What an FSDP2 program draws]
A ``Program`` names a model of ``NETS`` (each lists the submodules
``fully_shard`` may be applied to, children before their parents), which of
them are sharded (the root always is, last), each sharded module's
``reshard_after_forward`` (True, False, or a factor of the shard group's size),
a mixed-precision policy of ``MIXED_PRECISION``, an offload policy, a 1-D mesh
or a 2-D (replicate, shard) mesh, whether the first candidate's parameters are
frozen, and the optimizer. Then its calls: ``Op`` s of ``OP_NAMES``, each a
name and its arguments (``train``: the gradient-sync toggles set on the root,
several forwards before one backward; ``step``; ``unshard``/``reshard``;
explicit prefetching; the state dicts: ``state_dict``/``load_state_dict``,
``get_model_state_dict``/``get_optimizer_state_dict``, a DCP round trip;
``clip_grad_norm_``; ``set_reshard_after_forward``; a forward without
autograd). ``fsdptest.fsdp2search.run`` runs one on the ranks.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from fsdptest.properties.examples import decode_replay_id, encode_replay_id

NETS: dict[str, tuple[str, ...]] = {
    # The submodules fully_shard may be applied to (children before parents).
    "stack": ("0", "1", "2"),
    "nested": ("0.0", "0.2", "0", "1.0", "1.2", "1"),
    "uneven": ("0", "2", "4"),
    "tied": ("mid",),
    "buffers": ("0", "1"),
}
MIXED_PRECISION: dict[str, tuple[str | None, str | None, str | None, bool]] = {
    # name: (param_dtype, reduce_dtype, output_dtype, cast_forward_inputs)
    "none": (None, None, None, True),
    "bf16": ("bfloat16", None, None, True),
    "bf16-fp32": ("bfloat16", "float32", None, True),
    "fp16-fp32-out": ("float16", "float32", "float32", True),
    "fp32-bf16": (None, "bfloat16", None, False),
}
OPTIMIZERS = ("sgd", "adam")
OP_NAMES = (
    "train",
    "step",
    "zero_grad",
    "eval",
    "unshard",
    "reshard",
    "prefetch",
    "set_reshard_after_forward",
    "state_dict",
    "load_state_dict",
    "get_state_dicts",
    "dcp_round_trip",
    "clip_grad_norm",
)
_PREFIX = "fsdp2:"


@dataclasses.dataclass(frozen=True)
class Op:
    """One call of a program: its name (``OP_NAMES``) and its arguments."""

    name: str
    args: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if self.name not in OP_NAMES:
            raise ValueError(f"{self.name!r} is not an FSDP2 program's call: {OP_NAMES}")

    def describe(self) -> str:
        return f"{self.name}({', '.join(repr(a) for a in self.args)})"


@dataclasses.dataclass(frozen=True)
class Program:
    """A model sharded with ``fully_shard`` and the calls made on it (see
    [Note: What an FSDP2 program draws])."""

    world_size: int
    net: str
    sharded: tuple[str, ...]
    """The candidates of ``NETS[net]`` given their own ``fully_shard`` (in order)."""
    reshard_after_forward: tuple[bool | int, ...]
    """One per sharded candidate, then the root's."""
    mixed_precision: str = "none"
    offload: bool = False
    replicas: int = 1
    """1: a 1-D mesh; more: a (replicas, world_size // replicas) HSDP mesh."""
    frozen: bool = False
    optimizer: str = "sgd"
    ops: tuple[Op, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError(f"not an FSDP2 program: {'; '.join(problems)}")

    def problems(self) -> list[str]:
        found = []
        if self.net not in NETS:
            found.append(f"net {self.net!r} is not one of {sorted(NETS)}")
        elif not set(self.sharded) <= set(NETS[self.net]):
            found.append(f"{self.sharded} are not all candidates of {self.net}: {NETS[self.net]}")
        if len(self.reshard_after_forward) != len(self.sharded) + 1:
            found.append("reshard_after_forward needs one value per sharded module and the root")
        if self.mixed_precision not in MIXED_PRECISION:
            found.append(f"mixed precision {self.mixed_precision!r}: {sorted(MIXED_PRECISION)}")
        if self.replicas < 1 or self.world_size % self.replicas:
            found.append(f"{self.replicas} replicas do not divide world size {self.world_size}")
        if self.optimizer not in OPTIMIZERS:
            found.append(f"optimizer {self.optimizer!r}: {OPTIMIZERS}")
        return found

    @property
    def shard_size(self) -> int:
        return self.world_size // self.replicas

    def describe(self) -> str:
        sharded = ", ".join(
            f"{name} (reshard_after_forward={r})"
            for name, r in zip((*self.sharded, "<root>"), self.reshard_after_forward, strict=True)
        )
        lines = [
            f"world size {self.world_size}, mesh "
            + (f"{self.replicas}x{self.shard_size} (HSDP)" if self.replicas > 1 else "1-D"),
            f"net {self.net} (seed {self.seed}){', first candidate frozen' if self.frozen else ''}",
            f"fully_shard: {sharded}",
            f"mixed precision {self.mixed_precision}, offload {self.offload}, "
            f"optimizer {self.optimizer}",
            *(f"  op {i}: {op.describe()}" for i, op in enumerate(self.ops)),
        ]
        return "\n".join(lines)

    def replay_id(self) -> str:
        data = dataclasses.asdict(self)
        data["ops"] = [[op.name, list(op.args)] for op in self.ops]
        return _PREFIX + encode_replay_id(json.loads(json.dumps(data)))

    @classmethod
    def from_replay_id(cls, replay_id: str) -> Program:
        if not replay_id.startswith(_PREFIX):
            raise ValueError(f"not an FSDP2 program's replay id (no {_PREFIX!r}): {replay_id!r}")
        data = decode_replay_id(replay_id[len(_PREFIX) :])
        data["ops"] = tuple(Op(name, tuple(args)) for name, args in data["ops"])
        data["sharded"] = tuple(data["sharded"])
        data["reshard_after_forward"] = tuple(data["reshard_after_forward"])
        return cls(**data)
