"""A fixed sample of the conformance search's newer dimensions, for the ``ci``
profile, whose few drawn programs seldom reach them (the ``deep`` profile draws
them all; ``docs/reach.md`` shows which search draws what).

[Note: A fixed sample beside the drawn one]
Each scenario here is written by hand to exercise one row of the reach table
(``fsdptest.reach``): a model whose forward turns autograd off for a block,
buffers of each dtype, full precision in eval with prefetching, several
forwards before one backward, parameters the user replaces, ranks that hold
only padding, and the accelerator-only rows (``sync_module_states`` of
rank-seeded models, offloaded summons with writeback). The test that runs them
asserts first that the scenario, fitted to the target as the drawing fits its
own, still exercises its row: a fixed scenario that stopped reaching what it
names fails, or, where the reference cannot run it on these ranks, is a skip
that says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

from fsdptest.conformance import scenario as sc
from fsdptest.conformance.target import Target
from fsdptest.properties.examples import DType, Precision, Prefetch, Sharding, Wrap

_L, _A = sc.LayerKind, sc.AutogradOff
TRAIN = (sc.Forward(), sc.Backward(), sc.OptimStep(), sc.ZeroGrad())


class Fixed(NamedTuple):
    row: str  # the reach table's row it exercises
    scenario: sc.Scenario
    runs_here: Callable[[Target], bool] = lambda target: True


def _linear(width: int = 4, **kwargs: object) -> sc.Layer:
    return sc.Layer(_L.LINEAR, width=width, **kwargs)  # type: ignore[arg-type]


def _net(*blocks: sc.Block, width: int = 4) -> sc.Net:
    return sc.Net(vocab=0, width=width, blocks=blocks)


def _two_blocks(trunk: sc.AutogradOff) -> sc.Net:
    """A trunk block run with autograd off, then a trainable head block."""
    return _net(sc.Block((_linear(), _linear()), autograd=trunk), sc.Block((_linear(),)))


def _scenario(
    net: sc.Net, ops: tuple[sc.Op, ...], world_size: int = 2, **setup: object
) -> sc.Scenario:
    chosen = sc.Setup(wrap=Wrap.BLOCKS, **setup)  # type: ignore[arg-type]
    return sc.Scenario(world_size, net, chosen, (*ops, sc.Final()), seed=7)


def _autograd_off() -> list[Fixed]:
    rows = {
        _A.NO_GRAD: "model: autograd off in forward: torch.no_grad()",
        _A.DETACH: "model: autograd off in forward: .detach()",
        _A.INFERENCE: "model: autograd off in forward: torch.inference_mode()",
    }
    fixed = []
    for mode, row in rows.items():
        # torch's FSDP drops an inference-mode unit's prefetched gradients (the drawing
        # does not ask it: INFERENCE_MODE_FORWARD_PREFETCH)
        prefetches = (False,) if mode is _A.INFERENCE else (True, False)
        # FULL_SHARD and HYBRID_SHARD: under the strategies that keep a unit unsharded
        # after forward, torch never reshards a unit without backward (the target does
        # not ask it: FROZEN_FIRST_UNIT_KEEPS_UNSHARDED)
        for sharding in (Sharding.FULL_SHARD, Sharding.HYBRID_SHARD):
            for prefetch in prefetches:
                scenario = _scenario(
                    _two_blocks(mode),
                    TRAIN * 2,
                    sharding=sharding,
                    forward_prefetch=prefetch,
                    use_orig_params=prefetch,
                    backward_prefetch=Prefetch.BACKWARD_POST if prefetch else Prefetch.BACKWARD_PRE,
                )
                fixed.append(Fixed(row, scenario))
    frozen = _net(sc.Block((_linear(frozen=True), _linear(frozen=True))), sc.Block((_linear(),)))
    fixed.append(
        Fixed(
            "model: autograd off in forward: requires_grad=False",
            _scenario(frozen, TRAIN * 2, forward_prefetch=True),
        )
    )
    return fixed


def _buffers() -> list[Fixed]:
    fixed = []
    for dtype in sc.BufferDType:
        scale = sc.Layer(_L.SCALE, buffer_dtype=dtype)
        net = _net(sc.Block((_linear(), scale)), sc.Block((_linear(),)))
        precision = Precision(param_dtype=DType.BFLOAT16, buffer_dtype=DType.BFLOAT16)
        scenario = _scenario(net, TRAIN, mixed_precision=precision)
        fixed.append(Fixed(f"model: buffers: {dtype.value}", scenario))
    return fixed


def _programs() -> list[Fixed]:
    precision = Precision(param_dtype=DType.FLOAT16)
    evaluated = (*TRAIN, sc.Train(mode=False), sc.Forward(no_grad=True), sc.Train(mode=True))
    again = (sc.Forward(), sc.Forward(again=True), sc.Backward(), sc.OptimStep())
    replaced = (*TRAIN, sc.ReplaceParams(), *TRAIN)
    return [
        Fixed(
            "env FSDP_USE_FULL_PREC_IN_EVAL",
            _scenario(
                _two_blocks(_A.ON),
                evaluated,
                mixed_precision=precision,
                full_prec_in_eval=True,
                forward_prefetch=True,
            ),
        ),
        Fixed(
            # full precision decided at the reduce: a backward in eval mode after a
            # forward in training mode ([Note: Full precision decided at the reduce])
            "env FSDP_USE_FULL_PREC_IN_EVAL",
            _scenario(
                _two_blocks(_A.ON),
                (sc.Forward(), sc.Train(mode=False), sc.Backward(), sc.OptimStep()),
                sharding=Sharding.NO_SHARD,
                mixed_precision=Precision(
                    reduce_dtype=DType.FLOAT16, keep_low_precision_grads=True
                ),
                full_prec_in_eval=True,
            ),
        ),
        Fixed(
            # the backward's mode decides its unshard's dtype: forwards in training
            # and in eval mode, then a backward in training mode (torch reads
            # _force_full_precision live; FlatParamHandle.pre_backward)
            "env FSDP_USE_FULL_PREC_IN_EVAL",
            _scenario(
                _two_blocks(_A.ON),
                (
                    sc.Forward(),
                    sc.Train(mode=False),
                    sc.Forward(again=True),
                    sc.Train(mode=True),
                    sc.Backward(),
                    sc.OptimStep(),
                ),
                sharding=Sharding.NO_SHARD,
                use_orig_params=True,
                mixed_precision=Precision(param_dtype=DType.FLOAT16, reduce_dtype=DType.FLOAT16),
                full_prec_in_eval=True,
            ),
        ),
        Fixed("model: several forwards before one backward", _scenario(_two_blocks(_A.ON), again)),
        Fixed(
            "model: parameters replaced by the user (a new nn.Parameter)",
            _scenario(_two_blocks(_A.ON), replaced, use_orig_params=True),
        ),
    ]


def _padding_only() -> list[Fixed]:
    """A unit of 3 elements (a LayerNorm of width 1 and a 1-wide linear) on 3 and 4 ranks."""
    tiny = _net(sc.Block((_linear(1),)), sc.Block((sc.Layer(_L.NORM), _linear(1))), width=1)
    fixed = []
    for world_size in (3, 4):
        for uop in (False, True):
            scenario = _scenario(tiny, TRAIN * 2, world_size, use_orig_params=uop)
            fixed.append(
                Fixed(f"model: ranks that hold only padding, world size {world_size}", scenario)
            )
    return fixed


def _accelerator_only() -> list[Fixed]:
    synced = _scenario(_two_blocks(_A.ON), TRAIN, sync_module_states=True, rank_seeded=True)
    summoned = (
        *TRAIN,
        sc.EnterSummon(offload_to_cpu=True, writeback=True),
        sc.EditParams(),
        sc.Exit(),
        *TRAIN,
    )
    offloaded = _scenario(_two_blocks(_A.ON), summoned)
    return [
        Fixed(
            "FSDP(sync_module_states=True)",
            synced,
            lambda target: target.may_sync_module_states(),
        ),
        Fixed(
            "summon_full_params(offload_to_cpu=True)",
            offloaded,
            lambda target: target.may_summon_offload(),
        ),
    ]


def fixed_sample() -> dict[str, Fixed]:
    """Every fixed scenario, by a readable id."""
    every = [*_autograd_off(), *_buffers(), *_programs(), *_padding_only(), *_accelerator_only()]
    named: dict[str, Fixed] = {}
    for fixed in every:
        base = fixed.row.replace("model: ", "").replace(" ", "-")
        name, n = base, 1
        while name in named:
            n += 1
            name = f"{base}-{n}"
        named[name] = fixed
    return named


def fitted(fixed: Fixed, target: Target) -> sc.Scenario:
    """The scenario as the drawing would hand it over: its setup and model fitted to the target."""
    setup, net = target.fit(fixed.scenario.setup, fixed.scenario.net)
    return dataclasses.replace(fixed.scenario, setup=setup, net=net)
