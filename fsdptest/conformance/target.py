"""What a drawn scenario may ask of the two implementations: ``Target`` reads
the ``UNASKED`` and ``PENDING_UNASKED`` entries of ``fsdptest.conformance.allowed``
that apply to the implementation under test, the reference and the ranks'
device (see [Note: Nothing is silently skipped])."""

from __future__ import annotations

import dataclasses
import functools

import torch

from fsdptest.api import PublicAPI
from fsdptest.conformance.allowed import PENDING_UNASKED, TORCH, UNASKED
from fsdptest.conformance.scenario import (
    AutogradOff,
    Block,
    LayerKind,
    Net,
    Optimizer,
    Settings,
    Setup,
    StateDictKind,
)
from fsdptest.implementations import resolve
from fsdptest.properties.examples import (
    Prefetch,
    Sharding,
    biased_one_by_one,
    first_block_trainable,
)

_ACCELERATOR_ONLY = (
    "CPU_OFFLOAD_WITHOUT_ACCELERATOR",
    "SUMMON_OFFLOAD_TO_CPU_WITHOUT_ACCELERATOR",
    "SYNC_MODULE_STATES_WITHOUT_ACCELERATOR",
)
_BEFORE_TORCH_2_13 = ("HYBRID_SYNC_ORDER_BEFORE_TORCH_2_13",)


def torch_before_2_13() -> bool:
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) < (2, 13)


_ACCELERATOR_DEFECTS = (
    "OFFLOADED_LOW_PRECISION_GRADIENT_SECOND_BACKWARD",
    "LOCAL_STATE_DICT_OFFLOAD_ON_ACCELERATOR",
    "OFFLOADED_ORIG_PARAMS_SHOW_ZERO_GRADIENTS",
    "UNSHARDED_ORIG_PARAM_OPTIM_STATE_NOT_OFFLOADED",
    "OFFLOADED_EDITS_BEFORE_FIRST_RESHARD",
    "CAST_BUFFERS_SAVED_ON_THE_DEVICE",
)


@functools.cache
def _provides(module: str, name: str) -> bool:
    return name in PublicAPI(resolve(module)).found


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
        if name in _ACCELERATOR_DEFECTS:
            torch_side = TORCH in (self.impl, self.reference)
            return not (torch_side and self.device_type != "cpu")
        if name in _BEFORE_TORCH_2_13:
            torch_side = TORCH in (self.impl, self.reference)
            return not (torch_side and torch_before_2_13())
        entry = UNASKED.get(name) or PENDING_UNASKED[name]
        return not entry.applies(self.impl, self.reference)

    def may_sync_hybrid(self) -> bool:
        return self.asks("HYBRID_SYNC_ORDER_BEFORE_TORCH_2_13")

    def may_scale_gradients(self) -> bool:
        """Both implementations have a ``ShardedGradScaler``."""
        return all(_provides(m, "ShardedGradScaler") for m in (self.impl, self.reference))

    def can_offload(self) -> bool:
        return self.asks("CPU_OFFLOAD_WITHOUT_ACCELERATOR")

    def may_sync_module_states(self) -> bool:
        return self.asks("SYNC_MODULE_STATES_WITHOUT_ACCELERATOR")

    def may_summon_offload(self) -> bool:
        return self.asks("SUMMON_OFFLOAD_TO_CPU_WITHOUT_ACCELERATOR")

    def fit_settings(self, settings: Settings, setup: Setup) -> Settings:
        """A full state dict offloads by summoning with offload_to_cpu (and torch's local
        one fails to offload on accelerators); the private
        ``_use_dtensor`` is set by users only with a device mesh."""
        if settings.kind is StateDictKind.FULL and not self.may_summon_offload():
            settings = dataclasses.replace(settings, offload_to_cpu=False)
        local_offload = settings.kind is StateDictKind.LOCAL and settings.offload_to_cpu
        if local_offload and not self.asks("LOCAL_STATE_DICT_OFFLOAD_ON_ACCELERATOR"):
            settings = dataclasses.replace(settings, offload_to_cpu=False)
        precision = setup.mixed_precision
        buffers_cast = precision is not None and precision.buffer_dtype is not None
        offload = settings.offload_to_cpu and settings.kind is not StateDictKind.LOCAL
        if buffers_cast and offload and not self.asks("CAST_BUFFERS_SAVED_ON_THE_DEVICE"):
            settings = dataclasses.replace(settings, offload_to_cpu=False)
        if settings.dtensor and not setup.mesh and not self.asks("USE_DTENSOR_WITHOUT_DEVICE_MESH"):
            settings = dataclasses.replace(settings, dtensor=False)
        return settings

    def replica_counts(self) -> list[int]:
        counts = [r for r in range(1, self.world_size + 1) if self.world_size % r == 0]
        if not self.asks("HYBRID_ONE_RANK_SHARD_GROUP"):
            counts.remove(self.world_size)
        return counts

    def fit(self, setup: Setup, net: Net) -> tuple[Setup, Net]:
        """The setup and model, changed where the reference is not asked."""
        offloaded_orig = setup.use_orig_params and setup.offload_params
        if offloaded_orig and not self.asks("OFFLOADED_ORIG_PARAMS_SHOW_ZERO_GRADIENTS"):
            setup = dataclasses.replace(setup, offload_params=False)
        precision = setup.mixed_precision
        kept_low = precision is not None and precision.keep_low_precision_grads
        if (
            setup.offload_params
            and kept_low
            and not self.asks("OFFLOADED_LOW_PRECISION_GRADIENT_SECOND_BACKWARD")
        ):
            kept = dataclasses.replace(precision, keep_low_precision_grads=False)  # type: ignore[arg-type]
            setup = dataclasses.replace(setup, mixed_precision=kept)
        if not setup.use_orig_params and not self.asks("ONE_ELEMENT_FLAT_PARAMETER"):
            net = _without_one_element_units(net)
        keeps_unsharded = setup.sharding in (
            Sharding.SHARD_GRAD_OP,
            Sharding.HYBRID_SHARD_ZERO2,
            Sharding.NO_SHARD,
        )
        if keeps_unsharded and not net.vocab and not self.asks("FROZEN_FIRST_UNIT_KEEPS_UNSHARDED"):
            net = _first_block_trainable(net)
        multi_state = setup.optimizer is not Optimizer.SGD
        if (
            setup.use_orig_params
            and multi_state
            and not self.asks("OPTIM_STATE_DICT_ALIASES_STATES_WITH_ORIG_PARAMS")
        ):
            setup = dataclasses.replace(setup, optimizer=Optimizer.SGD)
        if self._tied_low_precision(setup, net):
            precision = dataclasses.replace(setup.mixed_precision, keep_low_precision_grads=False)  # type: ignore[arg-type]
            setup = dataclasses.replace(setup, mixed_precision=precision)
        return setup, self._fit_autograd(setup, net)

    def _fit_autograd(self, setup: Setup, net: Net) -> Net:
        """Blocks without autograd, but where the reference is not asked
        (``INFERENCE_MODE_FORWARD_PREFETCH``, ``DETACHED_UNIT_PREFETCHED_IN_BACKWARD``,
        and ``FROZEN_FIRST_UNIT_KEEPS_UNSHARDED``: a unit run without autograd has no
        backward, so a strategy that keeps it unsharded after forward never reshards
        it under torch's FSDP)."""
        changed: dict[AutogradOff, AutogradOff] = {}
        keeps = setup.sharding in (
            Sharding.SHARD_GRAD_OP,
            Sharding.HYBRID_SHARD_ZERO2,
            Sharding.NO_SHARD,
        )
        if keeps and not self.asks("FROZEN_FIRST_UNIT_KEEPS_UNSHARDED"):
            changed = {mode: AutogradOff.ON for mode in AutogradOff}
        elif setup.forward_prefetch and not self.asks("INFERENCE_MODE_FORWARD_PREFETCH"):
            changed[AutogradOff.INFERENCE] = AutogradOff.NO_GRAD
        prefetches = setup.backward_prefetch is not Prefetch.NONE
        no_shard = setup.sharding is Sharding.NO_SHARD and setup.use_orig_params
        if no_shard and prefetches and not self.asks("DETACHED_UNIT_PREFETCHED_IN_BACKWARD"):
            changed.setdefault(AutogradOff.DETACH, AutogradOff.NO_GRAD)
        if not changed:
            return net

        def visit(block: Block) -> Block:
            children = tuple(visit(child) for child in block.children)
            mode = changed.get(block.autograd, block.autograd)
            return dataclasses.replace(block, children=children, autograd=mode)

        return dataclasses.replace(net, blocks=tuple(visit(b) for b in net.blocks))

    def may_replace_parameters(self, net: Net | None) -> bool:
        """``REPLACED_TIED_PARAMETERS``."""
        return net is None or not _has_ties(net) or self.asks("REPLACED_TIED_PARAMETERS")

    def may_zero_grad_before_backward(self, setup: Setup) -> bool:
        """``zero_grad`` between a forward and its backward
        (``ZERO_GRAD_BETWEEN_FORWARD_AND_BACKWARD_WITHOUT_RESHARD``)."""
        keeps = setup.sharding in (Sharding.SHARD_GRAD_OP, Sharding.HYBRID_SHARD_ZERO2)
        return not (keeps and setup.use_orig_params) or self.asks(
            "ZERO_GRAD_BETWEEN_FORWARD_AND_BACKWARD_WITHOUT_RESHARD"
        )

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
        if net is None:
            return True
        frozen = setup.use_orig_params and any(layer.frozen for layer in net.layers())
        if frozen and not self.asks("NO_SYNC_GRADIENTS_OF_FROZEN_PARAMETERS"):
            return False
        return not self._tied_low_precision(setup, net)

    def _no_shard_low_precision(self, setup: Setup) -> bool:
        precision = setup.mixed_precision
        if setup.sharding is not Sharding.NO_SHARD or precision is None:
            return False
        return precision.param_dtype is not None or precision.reduce_dtype is not None

    def keeps_stale_full_precision(self, setup: Setup) -> bool:
        """Whether an eval forward leaves full-precision copies the reference reuses
        after parameters change (``FULL_PRECISION_EVAL_COPY_KEPT``)."""
        precision = setup.mixed_precision
        low = precision is not None and precision.param_dtype is not None
        return setup.full_prec_in_eval and low and not self.asks("FULL_PRECISION_EVAL_COPY_KEPT")

    def may_accumulate_hooked(self, setup: Setup) -> bool:
        """Whether a backward with a communication hook may start from an existing gradient."""
        return setup.sharding is not Sharding.NO_SHARD or self.asks(
            "NO_SHARD_HOOK_HANDED_ACCUMULATED_GRADIENT"
        )

    def may_no_sync_onto_gradient(self, setup: Setup) -> bool:
        """Whether a ``no_sync`` window may start while the parameters have gradients."""
        return not self._no_shard_low_precision(setup) or self.asks(
            "NO_SHARD_NO_SYNC_ONTO_FULL_PRECISION_GRADIENT"
        )

    def may_load_local_after_forward(self) -> bool:
        """Whether a LOCAL_STATE_DICT may be loaded while a forward's unsharded
        parameters may still be kept (no synced backward since)."""
        return self.asks("LOCAL_LOAD_KEEPS_STALE_UNSHARDED_PARAMETER")

    def may_edit_parameters(self, setup: Setup, resharded: bool) -> bool:
        """Whether parameters may be edited in place now (``resharded``: a backward
        ran); see ``OFFLOADED_EDITS_BEFORE_FIRST_RESHARD``."""
        offloaded = setup.offload_params and not resharded
        return not offloaded or self.asks("OFFLOADED_EDITS_BEFORE_FIRST_RESHARD")

    def offload_keeps_newest_gradient(self, setup: Setup) -> bool:
        """Whether a backward must start from no gradient (see
        ``OFFLOAD_ACCUMULATION_OUTSIDE_NO_SYNC``)."""
        return setup.offload_params and not self.asks("OFFLOAD_ACCUMULATION_OUTSIDE_NO_SYNC")

    def may_set_gradients(self, setup: Setup) -> bool:
        """See ``USER_GRADIENTS_WITH_KEPT_LOW_PRECISION``."""
        precision = setup.mixed_precision
        kept_low = (
            precision is not None
            and precision.keep_low_precision_grads
            and (
                precision.param_dtype is not None
                or (precision.reduce_dtype is not None and setup.sharding is Sharding.NO_SHARD)
            )
        )
        return not kept_low or self.asks("USER_GRADIENTS_WITH_KEPT_LOW_PRECISION")

    def may_replace_data_of_another_shape(self, setup: Setup) -> bool:
        no_shard = setup.sharding is Sharding.NO_SHARD
        return not no_shard or self.asks("NO_SHARD_REPLACED_DATA_OF_ANOTHER_SHAPE")

    def may_clear_set_aside_gradient(self) -> bool:
        """See ``ZERO_GRAD_KEEPS_GRADIENT_SET_ASIDE_BY_NO_SYNC``."""
        return self.asks("ZERO_GRAD_KEEPS_GRADIENT_SET_ASIDE_BY_NO_SYNC")

    def may_set_gradients_after_some(self) -> bool:
        """See ``USER_GRADIENT_HIDDEN_AFTER_A_NONE_WRITEBACK``."""
        return self.asks("USER_GRADIENT_HIDDEN_AFTER_A_NONE_WRITEBACK")

    def may_summon_grads_after_no_sync_backward(self) -> bool:
        return self.asks("SUMMON_WITH_GRADS_AFTER_NO_SYNC_BACKWARD")

    def may_replace_data_after_forward(self) -> bool:
        """Whether original parameters' data may be replaced while a forward's
        unsharded parameters may still be kept (no synced backward since)."""
        return self.asks("REPLACED_DATA_WITH_STALE_UNSHARDED_PARAMETER")

    def may_clip_inf(self, setup: Setup, net: Net | None) -> bool:
        """See ``CLIP_AFTER_INF_NORM_WITH_FROZEN``: at 2 ranks every rank holds part
        of a parameter (no unit has one element), at 3 or more a small unit may not."""
        frozen = net is not None and any(layer.frozen for layer in net.layers())
        sharded = setup.sharding is not Sharding.NO_SHARD and self.world_size >= 3
        return not (setup.use_orig_params and (frozen or sharded)) or self.asks(
            "CLIP_AFTER_INF_NORM_WITH_FROZEN"
        )

    def may_set_gradients_of_frozen_units(self, setup: Setup, net: Net | None) -> bool:
        """See ``FROZEN_UNIT_USER_GRADIENT_DROPPED``."""
        frozen = net is not None and any(layer.frozen for layer in net.layers())
        flat_frozen = frozen and not setup.use_orig_params
        sharded = setup.sharding is not Sharding.NO_SHARD
        return not (flat_frozen and sharded) or self.asks("FROZEN_UNIT_USER_GRADIENT_DROPPED")

    def may_save_local_before_writeback(self) -> bool:
        """See ``LOCAL_SAVE_SKIPS_WRITEBACK``."""
        return self.asks("LOCAL_SAVE_SKIPS_WRITEBACK")

    def may_save_optim_state(self, setup: Setup) -> bool:
        """See ``UNSHARDED_ORIG_PARAM_OPTIM_STATE_NOT_OFFLOADED``."""
        unsharded = setup.sharding is Sharding.NO_SHARD or setup.sharding.is_hybrid()
        return not (setup.use_orig_params and unsharded) or self.asks(
            "UNSHARDED_ORIG_PARAM_OPTIM_STATE_NOT_OFFLOADED"
        )

    def may_save_optim_state_of_some(self) -> bool:
        """See ``OPTIM_STATE_OF_SOME_PARAMETERS_OF_A_UNIT``."""
        return self.asks("OPTIM_STATE_OF_SOME_PARAMETERS_OF_A_UNIT")

    def may_clip_inf_of_user_gradients(self) -> bool:
        """See ``INF_NORM_OF_AN_EMPTY_USER_GRADIENT``."""
        return self.asks("INF_NORM_OF_AN_EMPTY_USER_GRADIENT")

    def state_dict_kinds(self, setup: Setup) -> list[StateDictKind]:
        kinds = list(StateDictKind)
        hybrid_groups = setup.sharding.is_hybrid() and setup.replicas > 1
        if hybrid_groups and not self.asks("LOCAL_STATE_DICT_OF_HYBRID_GROUPS"):
            kinds.remove(StateDictKind.LOCAL)
        return kinds

    def may_load(self, setup: Setup, kind: StateDictKind) -> bool:
        local_orig = kind is StateDictKind.LOCAL and setup.use_orig_params
        return not local_orig or self.asks("LOCAL_STATE_DICT_LOAD_WITH_ORIG_PARAMS")

    def may_wrap_again(self, setup: Setup, initialised: bool) -> bool:
        """Whether the root may be wrapped again (``initialised``: after a call that
        lazily initialised it)."""
        if initialised and not self.asks("WRAP_AGAIN_AFTER_INITIALISATION"):
            return False
        return setup.mixed_precision is None or self.asks("WRAP_AGAIN_WITH_MIXED_PRECISION")

    def may_save_inside_summon(self, settings: Settings, rank0_only_summon: bool) -> bool:
        """Whether ``state_dict()`` may be called inside the open summons."""
        if self.asks("STATE_DICT_INSIDE_SUMMON_RANK0_OR_LOCAL"):
            return True
        full_rank0 = (
            settings.kind is StateDictKind.FULL and settings.configs and settings.rank0_only
        )
        return not (rank0_only_summon or full_rank0 or settings.kind is StateDictKind.LOCAL)

    def may_summon_grads(self, setup: Setup, net: Net | None = None) -> bool:
        if not setup.use_orig_params:
            return False  # with_grads needs use_orig_params in both: a documented refusal
        frozen = net is not None and any(layer.frozen for layer in net.layers())
        if frozen and not self.asks("SUMMONED_GRADIENTS_OF_FROZEN_PARAMETERS"):
            return False
        precision = setup.mixed_precision
        low_grads = precision is not None and precision.keep_low_precision_grads
        return not low_grads or self.asks("SUMMONED_LOW_PRECISION_GRADIENTS")


def _has_ties(net: Net) -> bool:
    kinds = {layer.kind for layer in net.layers()}
    return (net.vocab > 0 and net.tied_head) or LayerKind.TIED in kinds


_LINEAR_KINDS = (LayerKind.LINEAR, LayerKind.CHECKPOINTED, LayerKind.SHARED, LayerKind.TIED)


def _without_one_element_units(net: Net) -> Net:
    blocks = biased_one_by_one(net.blocks, net.width, _LINEAR_KINDS)
    return dataclasses.replace(net, blocks=blocks)


def _first_block_trainable(net: Net) -> Net:
    return dataclasses.replace(net, blocks=first_block_trainable(net.blocks))


# -- divergences of ours, reported for fixing ------------------------------------------------------
