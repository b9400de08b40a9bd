"""Hypothesis strategies for FSDP2 programs (pytest-process side).

[Note: Drawing FSDP2 programs]
``programs(world_size, mode)`` draws a ``Program``: a net, a subset of its
candidates for ``fully_shard`` (applied children first, then the root), each
one's ``reshard_after_forward`` (True, False, or an int that divides the shard
group's size: 1 means False, the size means True, anything between reshards to
a smaller group), a mesh (1-D, or any (replicas, shard) split of the world
size), a mixed-precision policy, CPU offload, a frozen first candidate, the
optimizer, and up to ``max_ops`` calls. ``train`` calls set the root's
gradient-sync toggles: ``set_requires_gradient_sync`` (on three times in four),
``set_is_last_backward`` (left alone, or set to the same value as the sync, as
gradient accumulation sets it) and ``set_reshard_after_backward``, with one or
two forwards summed before the backward. The ``parity`` mode pairs Adam only
with full precision: Adam's first steps move each element by about the
learning rate whatever the gradient's size, so a gradient that a bf16
reduction rounds across zero moves a parameter by twice the learning rate, which
no tolerance of the compared values' scale allows. It also reshards every
module before a call that changes or reads the sharded parameters through the
module (``USE_SHARDED``):
a module left unsharded (by ``unshard``, ``set_reshard_after_backward(False)``,
``reshard_after_forward=False`` or the root after a forward without backward)
keeps the values of its last all-gather, and its next forward, which gathers
nothing, computes with them, and ``model.parameters()`` gives its unsharded
parameters, whose gradients are not the sharded ones: FSDP2's design, which the replicated reference
does not model (the conformance mode compares it with torch's).
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from fsdptest.fsdp2search.program import MIXED_PRECISION, NETS, OPTIMIZERS, Op, Program

MODES = ("conformance", "parity")

_OP_ARGS: dict[str, st.SearchStrategy[tuple[Any, ...]]] = {
    "train": st.tuples(
        st.sampled_from([True, True, True, False]),
        st.sampled_from(["keep", "same"]),
        st.sampled_from([None, True, False]),
        st.sampled_from([1, 1, 2]),
    ),
    "step": st.tuples(st.booleans()),
    "zero_grad": st.tuples(st.booleans()),
    "eval": st.just(()),
    "unshard": st.tuples(st.booleans()),
    "reshard": st.just(()),
    "prefetch": st.tuples(st.booleans(), st.booleans()),
    "set_reshard_after_forward": st.tuples(st.booleans()),
    "state_dict": st.just(()),
    "load_state_dict": st.just(()),
    "get_state_dicts": st.tuples(st.booleans(), st.booleans()),
    "dcp_round_trip": st.just(()),
    "clip_grad_norm": st.tuples(st.sampled_from([0.1, 1.0, 100.0]), st.sampled_from([1.0, 2.0])),
}
_WEIGHTS = {"train": 4, "step": 3}  # the other calls once each


def _op_names() -> list[str]:
    return [name for name in _OP_ARGS for _ in range(_WEIGHTS.get(name, 1))]


@st.composite
def ops(draw: st.DrawFn, max_ops: int) -> tuple[Op, ...]:
    names = draw(st.lists(st.sampled_from(_op_names()), min_size=1, max_size=max_ops))
    drawn = []
    for name in names:
        args = draw(_OP_ARGS[name])
        if name == "train":
            sync, last, rab, forwards = args
            args = (sync, None if last == "keep" else sync, rab, forwards)
        drawn.append(Op(name, args))
    return tuple(drawn)


USE_SHARDED = ("step", "load_state_dict", "dcp_round_trip", "clip_grad_norm")


def _resharded(drawn: tuple[Op, ...]) -> tuple[Op, ...]:
    """``drawn`` with a ``reshard`` before each call that uses the sharded
    parameters (see [Note: Drawing FSDP2 programs])."""
    out: list[Op] = []
    for op in drawn:
        if op.name in USE_SHARDED and (not out or out[-1].name != "reshard"):
            out.append(Op("reshard"))
        out.append(op)
    return tuple(out)


def reshard_values(shard_size: int) -> list[bool | int]:
    return [True, False, *(n for n in range(1, shard_size + 1) if shard_size % n == 0)]


@st.composite
def programs(draw: st.DrawFn, world_size: int, mode: str, max_ops: int) -> Program:
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: {MODES}")
    net = draw(st.sampled_from(sorted(NETS)))
    candidates = NETS[net]
    sharded = tuple(c for c in candidates if draw(st.booleans()))
    replicas = draw(
        st.sampled_from([1, 1, *(r for r in range(2, world_size + 1) if world_size % r == 0)])
    )
    values = reshard_values(world_size // replicas)
    reshard = tuple(draw(st.sampled_from(values)) for _ in range(len(sharded) + 1))
    mixed = draw(st.sampled_from(sorted(MIXED_PRECISION)))
    optimizers = OPTIMIZERS if mode == "conformance" or mixed == "none" else ("sgd",)
    return Program(
        world_size=world_size,
        net=net,
        sharded=sharded,
        reshard_after_forward=reshard,
        mixed_precision=mixed,
        offload=draw(st.booleans()),
        replicas=replicas,
        frozen=draw(st.booleans()),
        optimizer=draw(st.sampled_from(optimizers)),
        ops=_resharded(draw(ops(max_ops))) if mode == "parity" else draw(ops(max_ops)),
        seed=draw(st.integers(0, 3)),
    )
