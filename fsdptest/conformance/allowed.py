"""Allowed differences: what the reference is not asked, and which observations
may differ, each named, with its reason and the test that asserts it.

[Note: Nothing is silently skipped]
Three lists, each entry with a name, the implementations it applies to and a
reason; ``suites/test_conformance_allowed.py`` asserts every entry, so that an
entry whose reason no longer holds (torch fixed a defect, our FSDP fixed a
divergence) fails there and must be removed:

- ``UNASKED``: what the reference cannot do or does wrong in a way that breaks
  the comparison itself (a raise on some ranks only hangs the others; a
  defect pinned down in ``suites/test_property_findings.py``): the drawing
  does not ask it (``Target``). Each entry's ``evidence`` names the test that
  asserts the reference's behaviour.
- ``NORMALISED``: observations that legitimately differ. Each is a rewrite of
  one kind of observation applied to both traces before they are compared
  (so the rest of the observation is still compared), and a count of how
  often it changed something is part of every check's statistics.
- ``PENDING``: divergences of this project's FSDP from torch's that the
  search found and that are reported for fixing (``/work/notes`` is not part
  of the project; the README's "Differential conformance" section lists
  them). They are normalised like the above, for ``fsdp`` only, and their
  test asserts that the divergence is still there: fixing it makes that test
  fail until the entry is deleted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from fsdptest.conformance.scenario import Block, LayerKind, Net, Setup, StateDictKind
from fsdptest.implementations import BUILTIN_MODULES
from fsdptest.properties.examples import Sharding

TORCH = BUILTIN_MODULES["torch"]
OURS = BUILTIN_MODULES["local"]


@dataclasses.dataclass(frozen=True)
class Unasked:
    """What scenarios do not ask when the reference is one of ``references`` and
    (``impls`` empty: any) the implementation under test one of ``impls``."""

    name: str
    reason: str
    evidence: str  # the test asserting the behaviour
    references: tuple[str, ...] = (TORCH,)
    impls: tuple[str, ...] = ()
    pending: bool = False  # a divergence of ours, reported for fixing

    def applies(self, impl: str, reference: str) -> bool:
        return reference in self.references and (not self.impls or impl in self.impls)


def _entries(*entries: Unasked) -> dict[str, Unasked]:
    return {entry.name: entry for entry in entries}


UNASKED = _entries(
    Unasked(
        "CPU_OFFLOAD_WITHOUT_ACCELERATOR",
        "torch's FSDP cannot offload parameters on a CPU-only machine: it pins memory and "
        "synchronises accelerator streams ('Cannot access accelerator device when none is "
        "available'); no scenario on CPU ranks offloads when either side is torch's",
        "suites/test_core.py (fsdptest.api.assert_torch_refuses_cpu_offload)",
    ),
    Unasked(
        "SUMMON_OFFLOAD_TO_CPU_WITHOUT_ACCELERATOR",
        "summon_full_params(offload_to_cpu=True) on CPU ranks: torch raises 'setStorage: ... "
        "out of bounds for storage of size 0' (on rank 0 only under rank0_only=True, so the "
        "other ranks wait in the next collective); no scenario on CPU ranks summons with "
        "offload_to_cpu when either side is torch's",
        "suites/test_conformance_allowed.py::TestTorchLimitations::"
        "test_summon_offload_to_cpu_on_cpu_ranks",
    ),
    Unasked(
        "SYNC_MODULE_STATES_WITHOUT_ACCELERATOR",
        "sync_module_states=True on CPU ranks: torch raises 'The module has CPU parameters or "
        "buffers when `sync_module_states=True`, which requires them to be on GPU' even with "
        "device_id=cpu; no scenario on CPU ranks syncs module states when either side is "
        "torch's",
        "suites/test_conformance_allowed.py::TestTorchLimitations::"
        "test_sync_module_states_on_cpu_ranks",
    ),
    Unasked(
        "HYBRID_ONE_RANK_SHARD_GROUP",
        "hybrid sharding whose shard group is one rank: torch switches to NO_SHARD and "
        "never reduces across the replicas",
        "suites/test_hybrid_replicas.py",
    ),
    Unasked(
        "ONE_ELEMENT_FLAT_PARAMETER",
        "a one-element flat parameter (use_orig_params=False): torch mistakes a reduced "
        "shard for an unsharded gradient on the next synced backward; 1x1 Linears get a bias",
        "suites/test_property_findings.py::TestPropertyFindingsWorld2::"
        "test_one_element_flat_parameter_accumulates_across_synced_backwards",
    ),
    Unasked(
        "TIED_LOW_PRECISION_GRADIENTS",
        "a tied parameter with use_orig_params=True and low-precision gradients "
        "(keep_low_precision_grads, or accumulated under no_sync with a param_dtype): torch "
        "assigns param.grad = prim_param.grad, which torch 2.13 refuses for another dtype; such "
        "scenarios keep full-precision gradients and have no no_sync windows",
        "suites/test_property_findings.py::TestPropertyFindingsWorld2::"
        "test_tied_parameter_with_low_precision_gradients",
    ),
    Unasked(
        "FROZEN_FIRST_UNIT_KEEPS_UNSHARDED",
        "a unit whose parameters are all frozen and whose inputs need no gradient (frozen "
        "layers first in a model of float features) under SHARD_GRAD_OP, _HYBRID_SHARD_ZERO2 "
        "or NO_SHARD: torch reshards it from a hook that never fires; the first block with "
        "parameters of such a model is trainable",
        "suites/test_property_findings.py::TestPropertyFindingsWorld2::"
        "test_frozen_first_unit_is_resharded_after_backward",
    ),
    Unasked(
        "CLIP_AFTER_INF_NORM_WITH_FROZEN",
        "clip_grad_norm_ with use_orig_params=True and a frozen parameter: after an inf-norm "
        "call torch's later 2-norm is too large; such scenarios clip with finite norms",
        "suites/test_property_findings.py::TestPropertyFindingsWorld3::"
        "test_two_norm_after_an_inf_norm_clip_with_a_frozen_parameter",
    ),
    Unasked(
        "LOCAL_STATE_DICT_LOAD_WITH_ORIG_PARAMS",
        "loading a LOCAL_STATE_DICT with use_orig_params=True: torch saves '_flat_param' and "
        "rejects it as an unexpected key when loading",
        "suites/test_property_findings.py::TestPropertyFindingsWorld2::"
        "test_local_state_dict_with_use_orig_params",
    ),
    Unasked(
        "LOCAL_STATE_DICT_OF_HYBRID_GROUPS",
        "a LOCAL_STATE_DICT of hybrid units with more than one replica: torch takes shard-group "
        "ranks for global ones and raises on the shard groups without rank 0 (the others "
        "would wait for them)",
        "suites/test_property_findings.py::TestPropertyFindingsWorld4::"
        "test_local_state_dict_of_hybrid_shard_groups",
    ),
    Unasked(
        "SUMMONED_LOW_PRECISION_GRADIENTS",
        "summon_full_params(with_grads=True) with keep_low_precision_grads: torch assigns the "
        "low-precision gradient to the fp32 flat parameter and raises (or, with a frozen "
        "parameter alone on a rank, gathers mismatched sizes and gloo aborts)",
        "suites/test_property_findings.py::TestPropertyFindingsWorld2::"
        "test_summoned_low_precision_gradients",
    ),
)


_ACCELERATOR_ONLY = (
    "CPU_OFFLOAD_WITHOUT_ACCELERATOR",
    "SUMMON_OFFLOAD_TO_CPU_WITHOUT_ACCELERATOR",
    "SYNC_MODULE_STATES_WITHOUT_ACCELERATOR",
)


@dataclasses.dataclass(frozen=True)
class Target:
    """What scenarios for ``world_size`` ranks may ask of the two implementations
    (their modules) on ``device_type`` ranks: the ``UNASKED`` entries that apply."""

    impl: str  # the module of the implementation under test
    reference: str  # the reference's module
    device_type: str
    world_size: int

    def asks(self, name: str) -> bool:
        """Whether the entry ``name`` of ``UNASKED`` does not apply here."""
        if name in _ACCELERATOR_ONLY:
            torch_side = TORCH in (self.impl, self.reference)
            return not (torch_side and self.device_type == "cpu")
        entry = UNASKED.get(name) or PENDING_UNASKED[name]
        return not entry.applies(self.impl, self.reference)

    def can_offload(self) -> bool:
        return self.asks("CPU_OFFLOAD_WITHOUT_ACCELERATOR")

    def may_sync_module_states(self) -> bool:
        return self.asks("SYNC_MODULE_STATES_WITHOUT_ACCELERATOR")

    def may_summon_offload(self) -> bool:
        return self.asks("SUMMON_OFFLOAD_TO_CPU_WITHOUT_ACCELERATOR")

    def replica_counts(self) -> list[int]:
        counts = [r for r in range(1, self.world_size + 1) if self.world_size % r == 0]
        if not self.asks("HYBRID_ONE_RANK_SHARD_GROUP"):
            counts.remove(self.world_size)
        return counts

    def fit(self, setup: Setup, net: Net) -> tuple[Setup, Net]:
        """The setup and model, changed where the reference is not asked."""
        if not setup.use_orig_params and not self.asks("ONE_ELEMENT_FLAT_PARAMETER"):
            net = _without_one_element_units(net)
        keeps_unsharded = setup.sharding in (
            Sharding.SHARD_GRAD_OP,
            Sharding.HYBRID_SHARD_ZERO2,
            Sharding.NO_SHARD,
        )
        if keeps_unsharded and not net.vocab and not self.asks("FROZEN_FIRST_UNIT_KEEPS_UNSHARDED"):
            net = _first_block_trainable(net)
        if self._tied_low_precision(setup, net):
            precision = dataclasses.replace(setup.mixed_precision, keep_low_precision_grads=False)  # type: ignore[arg-type]
            setup = dataclasses.replace(setup, mixed_precision=precision)
        return setup, net

    def _tied_low_precision(self, setup: Setup, net: Net) -> bool:
        precision = setup.mixed_precision
        low = precision is not None and (
            precision.param_dtype is not None or precision.reduce_dtype is not None
        )
        return (
            setup.use_orig_params
            and low
            and _has_ties(net)
            and not self.asks("TIED_LOW_PRECISION_GRADIENTS")
        )

    def may_accumulate(self, setup: Setup, net: Net | None) -> bool:
        """Whether the program may run backwards under ``no_sync``."""
        return net is None or not self._tied_low_precision(setup, net)

    def may_clip_inf(self, setup: Setup, net: Net | None) -> bool:
        frozen = net is not None and any(layer.frozen for layer in net.layers())
        return not (setup.use_orig_params and frozen) or self.asks(
            "CLIP_AFTER_INF_NORM_WITH_FROZEN"
        )

    def state_dict_kinds(self, setup: Setup) -> list[StateDictKind]:
        kinds = list(StateDictKind)
        hybrid_groups = setup.sharding.is_hybrid() and setup.replicas > 1
        if hybrid_groups and not self.asks("LOCAL_STATE_DICT_OF_HYBRID_GROUPS"):
            kinds.remove(StateDictKind.LOCAL)
        return kinds

    def may_load(self, setup: Setup, kind: StateDictKind) -> bool:
        local_orig = kind is StateDictKind.LOCAL and setup.use_orig_params
        return not local_orig or self.asks("LOCAL_STATE_DICT_LOAD_WITH_ORIG_PARAMS")

    def may_summon_grads(self, setup: Setup) -> bool:
        if not setup.use_orig_params:
            return False  # with_grads needs use_orig_params in both: a documented refusal
        precision = setup.mixed_precision
        low_grads = precision is not None and precision.keep_low_precision_grads
        return not low_grads or self.asks("SUMMONED_LOW_PRECISION_GRADIENTS")


def _has_ties(net: Net) -> bool:
    kinds = {layer.kind for layer in net.layers()}
    return (net.vocab > 0 and net.tied_head) or LayerKind.TIED in kinds


_LINEAR_KINDS = (LayerKind.LINEAR, LayerKind.CHECKPOINTED, LayerKind.SHARED, LayerKind.TIED)


def _without_one_element_units(net: Net) -> Net:
    def fix(block: Block, width: int) -> Block:
        fixed = []
        for layer in block.layers:
            out = layer.out_width(width)
            one_by_one = width == 1 and out == 1 and layer.kind in _LINEAR_KINDS
            fixed.append(dataclasses.replace(layer, bias=True) if one_by_one else layer)
            width = out
        children = []
        for child in block.children:
            children.append(fix(child, width))
            width = child.out_width(width)
        return Block(tuple(fixed), tuple(children))

    blocks, width = [], net.width
    for block in net.blocks:
        blocks.append(fix(block, width))
        width = block.out_width(width)
    return dataclasses.replace(net, blocks=tuple(blocks))


def _first_block_trainable(net: Net) -> Net:
    done = False

    def visit(block: Block) -> Block:
        nonlocal done
        layers = block.layers
        if not done and any(layer.has_params() for layer in layers):
            layers = tuple(dataclasses.replace(layer, frozen=False) for layer in layers)
            done = True
        return Block(layers, tuple(visit(child) for child in block.children))

    return dataclasses.replace(net, blocks=tuple(visit(block) for block in net.blocks))


# -- observations that may differ ----------------------------------------------------------------

Rewrite = Callable[[str, str, Any], tuple[str, Any]]
"""(op, key, value) -> (key, value): ``op`` is the op's text ("construct" for the
construction), ``key`` and ``value`` one observation of it."""


@dataclasses.dataclass(frozen=True)
class Normalised:
    """A rewrite of observations (key, value) -> (key, value), applied to the
    traces of the implementations it is for (see [Note: Nothing is silently
    skipped])."""

    name: str
    reason: str
    rewrite: Rewrite
    references: tuple[str, ...] = (TORCH,)
    impls: tuple[str, ...] = ()  # empty: any implementation under test
    pending: bool = False  # a divergence of ours, reported for fixing

    def applies(self, impl: str, reference: str) -> bool:
        return reference in self.references and (not self.impls or impl in self.impls)


def _unreadable_attribute(op: str, key: str, value: Any) -> tuple[str, Any]:
    from fsdptest.conformance.observe import TensorView

    if key.startswith("attribute ") and isinstance(value, TensorView):
        if value.values in ("unreadable", "freed storage"):
            return key, value._replace(values="no data outside forward")
    return key, value


NORMALISED: dict[str, Normalised] = {
    entry.name: entry
    for entry in (
        Normalised(
            "SHARDED_ATTRIBUTE_HAS_NO_DATA",
            "with use_orig_params=False an original parameter's attribute on its module "
            "(model.layer.weight) has no data outside forward, backward and summons: torch "
            "leaves a view of the freed unsharded storage (reading it reads freed memory), "
            "this project's FSDP a placeholder that raises when read; both are observed as "
            "'no data', their kind, dtype, shape and device are compared",
            _unreadable_attribute,
            references=(TORCH, OURS),
        ),
    )
}

PENDING: dict[str, Normalised] = {}

PENDING_UNASKED: dict[str, Unasked] = {}


def normalisations(impl: str, reference: str) -> list[Normalised]:
    """The entries of ``NORMALISED`` and ``PENDING`` for this pair."""
    entries = [*NORMALISED.values(), *PENDING.values()]
    return [e for e in entries if e.applies(impl, reference)]


def normalise(
    op: str, observed: dict[str, Any], entries: list[Normalised], counts: dict[str, int]
) -> dict[str, Any]:
    """``observed`` (of the op ``op``) rewritten by every entry (in order);
    ``counts`` gets +1 per entry and observation it changed."""
    result: dict[str, Any] = {}
    for key, value in observed.items():
        for entry in entries:
            new_key, new_value = entry.rewrite(op, key, value)
            if new_key != key or new_value is not value:
                counts[entry.name] = counts.get(entry.name, 0) + 1
                key, value = new_key, new_value
        result[key] = value
    return result
