"""Hypothesis strategies for the property search's examples (see
``fsdptest.properties.examples``).

[Note: What the strategies draw]
A configuration first, then a model that fits it, then the schedule:

- models: an optional embedding (integer token inputs) or float features,
  up to three blocks of one to three layers (Linear, LayerNorm, a Linear used
  twice, two Linears sharing a weight, a constant buffer), blocks nested up to
  two deep, widths from 1 and the primes up to 13, a head tied to the
  embedding or not, frozen layers where FSDP allows them (anywhere with
  ``use_orig_params=True``; whole blocks that are their own units otherwise:
  a flat parameter must not mix frozen and trainable parameters);
- configurations: every sharding strategy (hybrid with every replica count
  that divides the world size), ``use_orig_params``, every ``MixedPrecision``
  field (dtypes None, fp16 or bf16), CPU offload, backward and forward
  prefetch, no auto-wrap, ``ModuleWrapPolicy`` or the size-based policy with a
  threshold, ignored top-level blocks (in full precision: an ignored module
  runs in its own dtype, so mixed precision would feed it low-precision
  inputs);
- schedules: one to three steps, each with up to three ``no_sync``/synced
  microbatches in any order ending synced, ``zero_grad(set_to_none=...)``,
  ``clip_grad_norm_`` or not (not with ignored blocks: their gradients are
  each rank's own, so is the total norm, and clipping by it makes even DDP's
  replicas differ), then nothing, a state-dict round trip or a summoned edit.

Every choice lists its simplest value first, so that a failing example
shrinks towards one small block, the default configuration and one step.

[Note: What torch's FSDP is not asked]
Examples run against torch's FSDP (``--fsdp-impl torch``) leave out what it
cannot do; the suites named here assert each of these limitations:

- CPU offload on a CPU-only run (``fsdptest.api``: torch pins memory and
  synchronises accelerator streams);
- hybrid sharding with a one-rank shard group (``replicas == world_size``):
  torch switches to ``NO_SHARD`` and never reduces across the replicas
  (``suites/test_hybrid_replicas.py``);
- a flat parameter of one element with ``use_orig_params=False``: its shard
  has the unsharded size, so a second synced backward mistakes the reduced
  shard for an unsharded gradient and reduces it again
  (``suites/test_property_findings.py``).
  Linear layers of one input and one output get a bias there (every other
  module with parameters has at least two elements);
- a low-precision gradient of a tied parameter with ``use_orig_params=True``
  (``keep_low_precision_grads`` with a ``param_dtype`` or a ``reduce_dtype``,
  or accumulated under ``no_sync`` with a ``param_dtype``): torch gives the second name its gradient with
  ``param.grad = prim_param.grad``, which torch 2.13 refuses for a gradient of
  another dtype (``suites/test_property_findings.py``); such examples keep
  full-precision gradients and sync every microbatch;
- a unit whose parameters are all frozen and whose forward inputs need no
  gradient (frozen layers first in a model of float features) under a
  strategy that keeps parameters unsharded after forward (``SHARD_GRAD_OP``,
  ``_HYBRID_SHARD_ZERO2``) or never shards them (``NO_SHARD``): torch reshards
  it after backward from a hook on those inputs, which never fires, so it
  stays unsharded, and a state dict loaded into it is hidden by the stale
  unsharded copy; under ``NO_SHARD`` with ``use_orig_params=True`` its
  parameters are then plain tensors, missing from ``named_parameters()``
  (``suites/test_property_findings.py``); the first block with parameters of
  such a model is trainable;
- an inf-norm ``clip_grad_norm_`` followed, on a later step, by a clip of
  another norm, with ``use_orig_params=True`` and a frozen parameter: the
  later total norm comes out too large (``suites/test_property_findings.py``);
  such examples clip with finite norms only;
- a ``LOCAL_STATE_DICT`` round trip with ``use_orig_params=True``: the saved
  dict holds ``_flat_param``, which loading rejects as an unexpected key
  (``suites/test_property_findings.py``); such steps save a full state dict;
- a ``LOCAL_STATE_DICT`` of a hybrid unit whose shard group does not hold
  rank 0 (``replicas > 1``): torch builds its ``ShardedTensor`` with group
  ranks taken for global ones and raises "Global rank 0 does not exist in
  input process group" (``suites/test_property_findings.py``); likewise;
- with CPU offload (accelerator runs), gradient accumulation outside
  ``no_sync()``: torch documents that its FSDP then keeps only the newest
  gradient ("Limitations" in its ``FullyShardedDataParallel`` docstring;
  asserted by ``suites/test_grad_accumulation.py`` and
  ``suites/test_regressions.py``); such steps run their microbatches but the
  last under ``no_sync``.
"""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from fsdptest.properties.examples import (
    NO_SYNC,
    SYNC,
    Between,
    Block,
    Clip,
    Config,
    DType,
    Example,
    Layer,
    LayerKind,
    Model,
    Precision,
    Prefetch,
    Sharding,
    Step,
    Wrap,
    biased_one_by_one,
    first_block_trainable,
)

SIZES = (1, 2, 3, 5, 7, 11, 13)
VOCABS = (0, 2, 3, 5, 7, 11)
MAX_BLOCKS, MAX_LAYERS, MAX_DEPTH, MAX_STEPS, MAX_MICROBATCHES = 3, 3, 2, 3, 3


@dataclasses.dataclass(frozen=True)
class Target:
    """What the examples run on: the FSDP under test and where its ranks run."""

    impl: str  # "local" or "torch"
    device_type: str  # "cpu" or "cuda"
    world_size: int

    def can_offload(self) -> bool:
        return self.impl != "torch" or self.device_type != "cpu"

    def can_sync_module_states(self) -> bool:
        """Torch's FSDP refuses CPU modules (fsdptest.limitations)."""
        return self.can_offload()

    def can_summon_offloaded(self) -> bool:
        """Torch's summon_full_params(offload_to_cpu=True) on CPU ranks exposes
        freed storage (fsdptest.limitations)."""
        return self.can_offload()

    def replica_counts(self) -> list[int]:
        counts = [r for r in range(1, self.world_size + 1) if self.world_size % r == 0]
        if self.impl == "torch":
            counts.remove(self.world_size)  # a one-rank shard group: see the note
        return counts


def dtypes() -> st.SearchStrategy[DType | None]:
    return st.sampled_from([None, DType.FLOAT16, DType.BFLOAT16])


def precisions() -> st.SearchStrategy[Precision]:
    return st.builds(
        Precision,
        param_dtype=dtypes(),
        reduce_dtype=dtypes(),
        buffer_dtype=dtypes(),
        keep_low_precision_grads=st.booleans(),
        cast_forward_inputs=st.booleans(),
        cast_root_forward_inputs=st.booleans().map(lambda b: not b),
        norms_in_full_precision=st.booleans(),
    )


@st.composite
def configs(draw: st.DrawFn, target: Target) -> Config:
    sharding = draw(st.sampled_from(list(Sharding)))
    replicas = draw(st.sampled_from(target.replica_counts())) if sharding.is_hybrid() else 1
    wrap = draw(st.sampled_from(list(Wrap)))
    return Config(
        sharding=sharding,
        replicas=replicas,
        use_orig_params=draw(st.booleans()),
        mixed_precision=draw(st.none() | precisions()),
        offload_params=draw(st.booleans()) if target.can_offload() else False,
        backward_prefetch=draw(st.sampled_from(list(Prefetch))),
        forward_prefetch=draw(st.booleans()),
        wrap=wrap,
        min_num_params=draw(st.integers(1, 200)) if wrap is Wrap.SIZE else 0,
        sync_module_states=target.can_sync_module_states() and draw(st.booleans()),
    )


def _frozen_layers(config: Config) -> bool:
    return config.use_orig_params


def _frozen_blocks(config: Config) -> bool:
    """Whole blocks may be frozen when each is a unit of its own."""
    return not config.use_orig_params and config.wrap is Wrap.BLOCKS


@st.composite
def layers(draw: st.DrawFn, config: Config, frozen_block: bool) -> Layer:
    kind = draw(st.sampled_from(list(LayerKind)))
    frozen = frozen_block or (_frozen_layers(config) and draw(st.booleans()))
    return Layer(
        kind=kind,
        width=draw(st.sampled_from(SIZES)) if kind is LayerKind.LINEAR else 0,
        bias=draw(st.booleans().map(lambda b: not b)),
        frozen=frozen and kind is not LayerKind.SCALE,
        persistent=draw(st.booleans().map(lambda b: not b)) if kind is LayerKind.SCALE else True,
    )


@st.composite
def blocks(draw: st.DrawFn, config: Config, depth: int) -> Block:
    frozen = _frozen_blocks(config) and draw(st.booleans())
    drawn = draw(st.lists(layers(config, frozen), min_size=1, max_size=MAX_LAYERS))
    children: list[Block] = []
    if depth < MAX_DEPTH:
        children = draw(st.lists(blocks(config, depth + 1), max_size=2))
    return Block(tuple(drawn), tuple(children))


@st.composite
def models(draw: st.DrawFn, config: Config) -> Model:
    vocab = draw(st.sampled_from(VOCABS))
    return Model(
        vocab=vocab,
        width=draw(st.sampled_from(SIZES)),
        blocks=tuple(draw(st.lists(blocks(config, 1), min_size=1, max_size=MAX_BLOCKS))),
        tied_head=bool(vocab) and draw(st.booleans()),
        outputs=draw(st.sampled_from(SIZES)),
        batch=draw(st.integers(1, 3)),
        seq=draw(st.integers(1, 3)),
    )


@st.composite
def steps(draw: st.DrawFn) -> Step:
    prefix = draw(st.lists(st.sampled_from([SYNC, NO_SYNC]), max_size=MAX_MICROBATCHES - 1))
    return Step(
        microbatches="".join(prefix) + SYNC,
        set_to_none=draw(st.booleans().map(lambda b: not b)),
        clip=draw(st.sampled_from(list(Clip))),
        then=draw(st.sampled_from(list(Between))),
    )


def _may_summon_offloaded(target: Target, config: Config) -> bool:
    """``offload_to_cpu=True`` needs sharded units (``NO_SHARD`` refuses it, and a
    one-rank shard group is ``NO_SHARD``)."""
    shards = config.shard_size(target.world_size) > 1
    sharded = config.sharding is not Sharding.NO_SHARD and shards
    return sharded and target.can_summon_offloaded()


def _summon_on_the_device(step: Step) -> Step:
    if step.then is Between.SUMMON_EDIT_OFFLOADED:
        return dataclasses.replace(step, then=Between.SUMMON_EDIT)
    return step


def _fit_inputs(config: Config, model: Model) -> Config:
    """Float features reach a low-precision first layer only when some unit casts
    them (integer tokens are never cast)."""
    precision = config.mixed_precision
    if model.vocab or precision is None or precision.param_dtype is None:
        return config
    if precision.cast_root_forward_inputs or precision.cast_forward_inputs:
        return config
    fitted = dataclasses.replace(precision, cast_root_forward_inputs=True)
    return dataclasses.replace(config, mixed_precision=fitted)


def _without_one_element_units(model: Model) -> Model:
    """Gives a bias to every 1x1 Linear, so that no unit's flat parameter has one
    element (see [Note: What torch's FSDP is not asked])."""
    blocks = biased_one_by_one(model.blocks, model.width, _LINEAR_KINDS)
    return dataclasses.replace(model, blocks=blocks)


_LINEAR_KINDS = (LayerKind.LINEAR, LayerKind.SHARED, LayerKind.TIED)


def _for_torch(example: Example) -> Example:
    """What torch's FSDP is not asked (see [Note: What torch's FSDP is not asked])."""
    model, config, steps = example.model, example.config, list(example.steps)
    keeps_unsharded = config.sharding in (
        Sharding.SHARD_GRAD_OP,
        Sharding.HYBRID_SHARD_ZERO2,
        Sharding.NO_SHARD,
    )
    if keeps_unsharded and not model.vocab:
        model = _first_block_trainable(model)
    if config.use_orig_params and _has_frozen(model):
        steps = [_no_inf_clip(step) for step in steps]
    if config.use_orig_params or (config.sharding.is_hybrid() and config.replicas > 1):
        steps = [_no_local_state_dict(step) for step in steps]
    if config.offload_params:
        steps = [dataclasses.replace(s, microbatches=_no_sync_but_last(s)) for s in steps]
    if not config.use_orig_params:
        model = _without_one_element_units(model)
    else:
        precision = config.mixed_precision
        low = precision is not None and (
            precision.param_dtype is not None or precision.reduce_dtype is not None
        )
        if precision is not None and low and _has_ties(model):
            kept = dataclasses.replace(precision, keep_low_precision_grads=False)
            config = dataclasses.replace(config, mixed_precision=kept)
            # synced microbatches, and with offload only one (both limitations above)
            synced = SYNC if config.offload_params else None
            steps = [
                dataclasses.replace(s, microbatches=synced or _synced(s.microbatches))
                for s in steps
            ]
    return dataclasses.replace(example, model=model, config=config, steps=tuple(steps))


def _first_block_trainable(model: Model) -> Model:
    """Unfreezes the layers of the first block (in forward order) that has parameters."""
    return dataclasses.replace(model, blocks=first_block_trainable(model.blocks))


def _synced(microbatches: str) -> str:
    return SYNC * len(microbatches)


def _no_sync_but_last(step: Step) -> str:
    return NO_SYNC * (len(step.microbatches) - 1) + SYNC


def _no_local_state_dict(step: Step) -> Step:
    if step.then is not Between.LOCAL_STATE_DICT:
        return step
    return dataclasses.replace(step, then=Between.FULL_STATE_DICT)


def _has_frozen(model: Model) -> bool:
    return any(layer.frozen for block in model.blocks for layer in block.all_layers())


def _no_inf_clip(step: Step) -> Step:
    return dataclasses.replace(step, clip=Clip.NONE) if step.clip is Clip.INF else step


def _has_ties(model: Model) -> bool:
    kinds = {layer.kind for block in model.blocks for layer in block.all_layers()}
    return (model.vocab > 0 and model.tied_head) or LayerKind.TIED in kinds


@st.composite
def examples(draw: st.DrawFn, target: Target) -> Example:
    config = draw(configs(target))
    model = draw(models(config))
    config = _fit_inputs(config, model)
    if config.mixed_precision is None:
        indices = list(range(len(model.blocks)))
        ignored = draw(st.lists(st.sampled_from(indices), unique=True, max_size=len(indices)))
        config = dataclasses.replace(config, ignored_blocks=tuple(sorted(ignored)))
    schedule = draw(st.lists(steps(), min_size=1, max_size=MAX_STEPS))
    if config.ignored_blocks:
        schedule = [dataclasses.replace(step, clip=Clip.NONE) for step in schedule]
    if not _may_summon_offloaded(target, config):
        schedule = [_summon_on_the_device(step) for step in schedule]
    example = Example(
        world_size=target.world_size,
        model=model,
        config=config,
        steps=tuple(schedule),
        seed=draw(st.integers(0, 2**16)),
    )
    return _for_torch(example) if target.impl == "torch" else example
