"""The scenario's model and constructor arguments, drawn by hypothesis strategies
(the property search's, extended: ``fsdptest.properties.strategies``); the
program is ``fsdptest.conformance.drawing``'s."""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from fsdptest.conformance import scenario as sc
from fsdptest.conformance.target import Target
from fsdptest.properties.examples import Prefetch, Sharding, Wrap
from fsdptest.properties.strategies import precisions

SIZES = (1, 2, 3, 5, 7, 11)
VOCABS = (0, 2, 3, 5, 7)
MAX_BLOCKS, MAX_LAYERS, MAX_DEPTH = 3, 3, 2
# Adam twice as often as SGD: its scalar ``step`` and two states per parameter are
# what optimizer state dicts get wrong, and with use_orig_params it becomes SGD
# (``Target.fit``: OPTIM_STATE_DICT_ALIASES_STATES_WITH_ORIG_PARAMS).
OPTIMIZERS = (sc.Optimizer.SGD, sc.Optimizer.ADAM, sc.Optimizer.ADAM)
# A block runs with autograd half the time: a frozen trunk is one block without it.
_A = sc.AutogradOff
AUTOGRAD = (_A.ON, _A.ON, _A.ON, _A.NO_GRAD, _A.DETACH, _A.INFERENCE)

# -- models and constructor arguments ----------------------------------------------------------


@st.composite
def setups(draw: st.DrawFn, target: Target) -> sc.Setup:
    sharding = draw(st.sampled_from(list(Sharding)))
    replicas = draw(st.sampled_from(target.replica_counts())) if sharding.is_hybrid() else 1
    wrap = draw(st.sampled_from(list(Wrap)))
    precision = draw(st.none() | precisions())
    sync = (
        target.may_sync_module_states()
        and (not sharding.is_hybrid() or target.may_sync_hybrid())
        and draw(st.booleans())
    )
    return sc.Setup(
        sharding=sharding,
        replicas=replicas,
        mesh=draw(st.booleans()),
        use_orig_params=draw(st.booleans()),
        mixed_precision=precision,
        offload_params=draw(st.booleans()) if target.can_offload() else False,
        backward_prefetch=draw(st.sampled_from(list(Prefetch))),
        forward_prefetch=draw(st.booleans()),
        limit_all_gathers=draw(st.booleans().map(lambda b: not b)),
        wrap=wrap,
        min_num_params=draw(st.integers(1, 200)) if wrap is Wrap.SIZE else 0,
        init=draw(st.sampled_from(list(sc.Init))),
        sync_module_states=sync,
        rank_seeded=sync and draw(st.booleans()),
        optimizer=draw(st.sampled_from(OPTIMIZERS)),
        full_prec_in_eval=draw(st.booleans()),
    )


def _frozen_layers(setup: sc.Setup) -> bool:
    return setup.use_orig_params


def _frozen_blocks(setup: sc.Setup) -> bool:
    """Whole blocks may be frozen when each is a unit of its own (a flat
    parameter must not mix frozen and trainable parameters)."""
    return not setup.use_orig_params and setup.wrap is Wrap.BLOCKS


@st.composite
def layers(draw: st.DrawFn, frozen_layers: bool, frozen_block: bool) -> sc.Layer:
    """``frozen_layers``: the model has frozen layers, each layer is frozen or not."""
    kind = draw(st.sampled_from(list(sc.LayerKind)))
    frozen = frozen_block or (frozen_layers and draw(st.booleans()))
    changes_width = kind in (sc.LayerKind.LINEAR, sc.LayerKind.CHECKPOINTED)
    has_buffers = kind in (sc.LayerKind.SCALE, sc.LayerKind.COUNTER)
    scale = kind is sc.LayerKind.SCALE
    return sc.Layer(
        kind=kind,
        width=draw(st.sampled_from(SIZES)) if changes_width else 0,
        bias=draw(st.booleans().map(lambda b: not b)),
        frozen=frozen and not has_buffers,
        persistent=draw(st.booleans().map(lambda b: not b)) if has_buffers else True,
        buffer_dtype=draw(st.sampled_from(list(sc.BufferDType)))
        if scale
        else sc.BufferDType.FLOAT32,
    )


@st.composite
def blocks(draw: st.DrawFn, setup: sc.Setup, depth: int, frozen_layers: bool) -> sc.Block:
    frozen = _frozen_blocks(setup) and draw(st.booleans())
    drawn = draw(st.lists(layers(frozen_layers, frozen), min_size=1, max_size=MAX_LAYERS))
    children: list[sc.Block] = []
    if depth < MAX_DEPTH:
        children = draw(st.lists(blocks(setup, depth + 1, frozen_layers), max_size=2))
    autograd = draw(st.sampled_from(AUTOGRAD))
    return sc.Block(tuple(drawn), tuple(children), autograd)


@st.composite
def nets(draw: st.DrawFn, setup: sc.Setup) -> sc.Net:
    """Whether a model (with ``use_orig_params``) has frozen layers at all is one
    draw: per layer alone, a model of several layers would nearly always have
    one, and what only a model without (``summon_full_params(with_grads=True)``,
    ``no_sync``) may do would be rare."""
    vocab = draw(st.sampled_from(VOCABS))
    frozen_layers = _frozen_layers(setup) and draw(st.sampled_from((False, False, True)))
    drawn = st.lists(blocks(setup, 1, frozen_layers), min_size=1, max_size=MAX_BLOCKS)
    net = sc.Net(
        vocab=vocab,
        width=draw(st.sampled_from(SIZES)),
        blocks=tuple(draw(drawn)),
        tied_head=bool(vocab) and draw(st.booleans()),
        outputs=draw(st.sampled_from(SIZES)),
        batch=draw(st.integers(1, 3)),
        seq=draw(st.integers(1, 2)),
    )
    if any(layer.kind is sc.LayerKind.BATCHNORM for layer in net.layers()):
        net = dataclasses.replace(net, batch=max(net.batch, 2))  # batch statistics need two rows
    return net


def fit_inputs(setup: sc.Setup, net: sc.Net) -> sc.Setup:
    """Float features reach a low-precision first layer only when some unit casts
    them (integer tokens are never cast)."""
    precision = setup.mixed_precision
    if net.vocab or precision is None or precision.param_dtype is None:
        return setup
    if precision.cast_root_forward_inputs or precision.cast_forward_inputs:
        return setup
    fitted = dataclasses.replace(precision, cast_root_forward_inputs=True)
    return dataclasses.replace(setup, mixed_precision=fitted)


@st.composite
def ignored(draw: st.DrawFn, setup: sc.Setup, net: sc.Net) -> sc.Setup:
    """Ignored top-level blocks, in full precision only: an ignored module runs in
    its own dtype, so mixed precision would feed it low-precision inputs."""
    if setup.mixed_precision is not None or setup.init is sc.Init.META:
        return setup
    indices = list(range(len(net.blocks)))
    chosen = draw(st.lists(st.sampled_from(indices), unique=True, max_size=len(indices)))
    return dataclasses.replace(
        setup,
        ignored_blocks=tuple(sorted(chosen)),
        ignored_as_states=bool(chosen) and draw(st.booleans()),
    )
