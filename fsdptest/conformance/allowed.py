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
  does not ask it (``fsdptest.conformance.target.Target``). Each entry's ``evidence`` names the test that
  asserts the reference's behaviour.
- ``NORMALISED`` (in ``fsdptest.conformance.normalised``): observations that legitimately differ. Each is a rewrite of
  one kind of observation applied to both traces before they are compared
  (so the rest of the observation is still compared), and a count of how
  often it changed something is part of every check's statistics.
- ``PENDING``: divergences of this project's FSDP from torch's that the
  search found and that are reported for fixing (the README's "Differential
  conformance" section lists them). They are normalised like the above, for ``fsdp`` only, and their
  test asserts that the divergence is still there: fixing it makes that test
  fail until the entry is deleted.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fsdptest.conformance.normalised import NORMALISED, Normalised, Rewrite
from fsdptest.implementations import BUILTIN_MODULES

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
        "REPLACED_TIED_PARAMETERS",
        "use_orig_params: a tied parameter replaced under all its names by one new "
        "nn.Parameter, then edited inside summon_full_params: torch's FSDP raises "
        "NotImplementedError ('Changing shared parameters is not supported yet') at a later "
        "unshard on some ranks only, which leaves the others in a collective; this "
        "project's FSDP keeps the tie. Models with ties do not replace parameters where "
        "either side is torch's",
        "suites/test_replaced_parameters.py::ReplacedParameters::"
        "test_replaced_tied_parameter_stays_tied",
    ),
    Unasked(
        "INFERENCE_MODE_FORWARD_PREFETCH",
        "A block run under torch.inference_mode() with forward_prefetch=True: the unit "
        "after it is all-gathered and shown by the prefetch inside inference mode, so its "
        "views are inference tensors of which autograd makes nothing, and torch's FSDP never "
        "gives that unit a gradient (this project's FSDP leaves inference mode for the "
        "prefetch). Such blocks run under no_grad where either side is torch's",
        "suites/test_fsdp_freezing_weights.py::TestAutogradOffFamily::"
        "test_trunk_without_autograd_trains_like_ddp",
    ),
    Unasked(
        "DETACHED_UNIT_PREFETCHED_IN_BACKWARD",
        "NO_SHARD with use_orig_params and a backward prefetch: a unit whose output is "
        "detached (its backward never runs) is unsharded by a prefetch in backward and keeps "
        "its Tensor views in torch's FSDP, so its parameters vanish from parameters(). Such "
        "blocks run under no_grad where either side is torch's",
        "suites/test_fsdp_freezing_weights.py::TestAutogradOffFamily::"
        "test_trunk_without_autograd_trains_like_ddp",
    ),
    Unasked(
        "ZERO_GRAD_BETWEEN_FORWARD_AND_BACKWARD_WITHOUT_RESHARD",
        "SHARD_GRAD_OP or _HYBRID_SHARD_ZERO2 with use_orig_params: zero_grad() between a "
        "forward and its backward makes torch's FSDP train wrong from the next step on "
        "(the third step's loss differs from DDP's; this project's FSDP trains as DDP). No "
        "zero_grad comes between a forward and its backward there where either side is "
        "torch's",
        "suites/test_fsdp_freezing_weights.py::TestZeroGradBetweenForwardAndBackward::"
        "test_zero_grad_between_forward_and_backward",
    ),
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
        "other ranks wait in the next collective), and so does a FULL_STATE_DICT with "
        "FullStateDictConfig(offload_to_cpu=True), which summons so; no scenario on CPU ranks "
        "summons or saves a full state dict with offload_to_cpu when either side is torch's",
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
        "layers first in a model of float features), or a unit run without autograd "
        "(no_grad, detach, inference_mode), under SHARD_GRAD_OP, _HYBRID_SHARD_ZERO2 "
        "or NO_SHARD: torch reshards it from a hook that never fires; the first block with "
        "parameters of such a model is trainable, and such strategies' blocks run with "
        "autograd on",
        "suites/test_property_findings.py::TestPropertyFindingsWorld2::"
        "test_frozen_first_unit_is_resharded_after_backward",
    ),
    Unasked(
        "FULL_PRECISION_EVAL_COPY_KEPT",
        "FSDP_USE_FULL_PREC_IN_EVAL with a param_dtype: an eval forward all-gathers a "
        "unit in full precision, and a unit not resharded after forward (the root; every "
        "unit under SHARD_GRAD_OP) keeps that copy; torch's FSDP frees only the "
        "low-precision copy at later reshards, so its next full-precision unshard (an eval "
        "forward, summon_full_params, a full state dict) uses the kept copy, also after an "
        "optimizer step, a load or an edit changed the parameters (eval outputs and "
        "summoned values of before the step); this project's FSDP frees it at the next "
        "reshard (so a summon after a training backward all-gathers under ours only). "
        "Where either side is torch's, such setups stay in eval mode from their first "
        "eval forward on and change no parameter in eval mode (no step, load, edit, "
        "replacement or apply)",
        "suites/test_mixed_precision.py::TestFSDPTrainEval::test_eval_after_a_step_sees_the_step",
    ),
    Unasked(
        "CLIP_AFTER_INF_NORM_WITH_FROZEN",
        "clip_grad_norm_ with use_orig_params=True and a frozen parameter, or a rank whose "
        "shard of a unit holds no parameter's element (a unit smaller than the world size "
        "allows: 3 elements over 4 ranks, the eleventh deep run): after an inf-norm call "
        "torch's later norms are too large; such scenarios (use_orig_params with a frozen "
        "parameter, or sharded over 3 ranks or more) clip with finite norms",
        "suites/test_property_findings.py::TestPropertyFindingsWorld3::"
        "test_two_norm_after_an_inf_norm_clip_with_a_frozen_parameter",
    ),
    Unasked(
        "INF_NORM_OF_AN_EMPTY_USER_GRADIENT",
        "use_orig_params: gradients a user sets on every original parameter, including "
        "those outside the rank's shard (size 0), then clip_grad_norm_(norm_type=inf): "
        "torch's FSDP raises on each rank holding such an empty gradient (vector_norm has "
        "no infinity norm of an empty tensor) and the other ranks wait in its all-reduce; "
        "this project's FSDP counts empty gradients as nothing. Such scenarios clip with "
        "finite norms until a backward or zero_grad(set_to_none=True) where either side is "
        "torch's",
        "suites/test_clip_grad_norm.py::TestClipGradNormEdgeCases::"
        "test_inf_norm_with_empty_user_gradients",
    ),
    Unasked(
        "FROZEN_UNIT_USER_GRADIENT_DROPPED",
        "use_orig_params=False and a sharded unit whose parameters are all frozen: a "
        "gradient a user sets on its flat parameter is None after the next backward in "
        "torch's FSDP; this project's FSDP leaves it, as autograd leaves a parameter that "
        "needs no gradient (and as torch's NO_SHARD units do). Such setups do not set "
        "gradients where either side is torch's",
        "suites/test_regressions.py::TestWriteback::test_user_gradient_of_a_frozen_unit_stays",
    ),
    Unasked(
        "NO_SHARD_REPLACED_DATA_OF_ANOTHER_SHAPE",
        "NO_SHARD units with use_orig_params: p.data replaced by a tensor of the same "
        "number of elements and another shape (p.data = p.reshape(-1)): torch's FSDP writes "
        "the values back but keeps showing the user's shape until the next unshard, and a "
        "full state dict saved meanwhile holds that shape (it no longer loads into the "
        "unwrapped module); this project's FSDP shows each parameter in its own shape again "
        "at the writeback. NO_SHARD units replace data only of the same shape where either "
        "side is torch's",
        "suites/test_regressions.py::TestWriteback::test_no_shard_data_of_another_shape",
    ),
    Unasked(
        "LOCAL_SAVE_SKIPS_WRITEBACK",
        "use_orig_params: p.data = ... on the original parameters, then a LOCAL_STATE_DICT "
        "save before anything writes back (a forward, a summon): torch's FSDP saves its "
        "flat parameter's old data (the saved shard then changes with the next writeback, "
        "which it aliases); this project's FSDP writes back first, as its other state-dict "
        "types do. Such a save waits for a forward or summon where either side is torch's",
        "suites/test_regressions.py::TestWriteback::test_local_state_dict_holds_replaced_data",
    ),
    Unasked(
        "OPTIM_STATE_OF_SOME_PARAMETERS_OF_A_UNIT",
        "use_orig_params=True and optimizer steps while some original parameters of a unit "
        "have no gradient (a user's p.grad = None beside others' gradients): those get no "
        "optimizer state, and torch's FSDP.optim_state_dict and full_optim_state_dict raise "
        "('... is not in the optimizer state. The FSDPParamInfo has the param keys ...'); "
        "this project's FSDP saves the states there are. Such programs save no optimizer "
        "state after such a step where either side is torch's",
        "suites/test_conformance_allowed.py::TestTorchLimitations::"
        "test_optim_state_of_some_parameters_of_a_unit",
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
        "OPTIM_STATE_DICT_ALIASES_STATES_WITH_ORIG_PARAMS",
        "FSDP.optim_state_dict with use_orig_params=True (torch 2.13, CPU ranks, every sharded "
        "strategy): each parameter's state tensors all hold the values of its last one "
        "(Adam's exp_avg == exp_avg_sq); scenarios with use_orig_params=True use SGD, whose "
        "one momentum buffer per parameter is saved right",
        "suites/test_conformance_allowed.py::TestTorchLimitations::"
        "test_optim_state_dict_aliases_states_with_orig_params",
    ),
    Unasked(
        "NO_SYNC_GRADIENTS_OF_FROZEN_PARAMETERS",
        "use_orig_params=True with a frozen parameter (requires_grad=False) in a unit: after a "
        "backward under no_sync torch gives the frozen parameter a .grad (the unsharded "
        "gradient's view; in the low precision under mixed precision), where it must stay None "
        "(BUGS.md class 7); such scenarios have no no_sync windows",
        "suites/test_conformance_allowed.py::TestTorchLimitations::"
        "test_no_sync_gives_frozen_parameters_gradients",
    ),
    Unasked(
        "SUMMONED_LOW_PRECISION_GRADIENTS",
        "summon_full_params(with_grads=True) with keep_low_precision_grads: torch assigns the "
        "low-precision gradient to the fp32 flat parameter and raises (or, with a frozen "
        "parameter alone on a rank, gathers mismatched sizes and gloo aborts)",
        "suites/test_property_findings.py::TestPropertyFindingsWorld2::"
        "test_summoned_low_precision_gradients",
    ),
    Unasked(
        "WRAP_AGAIN_WITH_MIXED_PRECISION",
        "FSDP(FSDP(m)) where m's unit has a MixedPrecision: torch's first forward fails ('mat1 "
        "and mat2 must have the same dtype', or 'expected dtype float for end but got Half'); "
        "the root is wrapped again only without mixed precision",
        "suites/test_conformance_allowed.py::TestTorchLimitations::"
        "test_wrapping_a_unit_again_with_mixed_precision",
    ),
    Unasked(
        "SUMMONED_GRADIENTS_OF_FROZEN_PARAMETERS",
        "use_orig_params=True with a frozen parameter (requires_grad=False) in a unit: inside "
        "summon_full_params(with_grads=True) torch gives it a zero .grad (outside it has "
        "none), where it must stay None (BUGS.md class 7, as NO_SYNC_GRADIENTS_OF_FROZEN_"
        "PARAMETERS); such scenarios summon without with_grads",
        "suites/test_conformance_allowed.py::TestTorchLimitations::"
        "test_summon_with_grads_gives_frozen_parameters_gradients",
    ),
    Unasked(
        "WRAP_AGAIN_AFTER_INITIALISATION",
        "FSDP(root) after a call that lazily initialised the root (a forward, a state dict, a "
        "summon, apply, clip_grad_norm_, ...): torch's next call fails its root check "
        "('Non-root FSDP instance's `_is_root` should not have been set yet ...'); this "
        "project's FSDP lets the new wrapper become the root, as it does for a unit summoned "
        "or initialised before its enclosing unit (differences D6), and then checks the units "
        "agree (use_orig_params, ...); the root is wrapped again only before such a call",
        "suites/test_conformance_allowed.py::TestTorchLimitations::"
        "test_wrapping_an_initialised_root_again",
    ),
    Unasked(
        "STATE_DICT_INSIDE_SUMMON_RANK0_OR_LOCAL",
        "state_dict() inside summon_full_params: under a rank0_only summon torch's ranks != 0 "
        "fail its key check (rank 0 saves: the others would wait), under a FULL_STATE_DICT "
        "config with rank0_only they raise KeyError '_flat_param', and a LOCAL_STATE_DICT "
        "raises a ShardedTensor ValueError; inside a summon only full (without rank0_only) and "
        "sharded state dicts are saved, and not inside a rank0_only summon",
        "suites/test_conformance_allowed.py::TestTorchLimitations::"
        "test_state_dict_inside_summon_rank0_only_or_local",
    ),
    Unasked(
        "USE_DTENSOR_WITHOUT_DEVICE_MESH",
        "ShardedStateDictConfig(_use_dtensor=True) or ShardedOptimStateDictConfig(_use_dtensor="
        "True) for units built without a device_mesh: `_use_dtensor` is a private field that "
        "torch documents users must not set (torch sets it itself when a mesh is given); torch's "
        "state_dict() then fails with \"AttributeError: 'NoneType' object has no attribute "
        "'ndim'\" and its optim_state_dict with 'Expected _device_mesh to be not None', where "
        "this project's FSDP saves DTensors over the unit's group; _use_dtensor=True is drawn "
        "only with a device mesh",
        "suites/test_conformance_allowed.py::TestTorchLimitations::"
        "test_use_dtensor_without_a_device_mesh",
    ),
    Unasked(
        "NO_SHARD_HOOK_HANDED_ACCUMULATED_GRADIENT",
        "a communication hook of NO_SHARD units (any precision), on a backward onto an "
        "existing gradient (a second backward without zero_grad(set_to_none=True)): torch "
        "hands the hook the accumulated gradient, the previous, already reduced one plus the "
        "new local one (cast to a low param/reduce dtype where there is one), and so reduces "
        "the previous gradient again (its accumulation defect, BUGS.md class 1); this "
        "project's FSDP hands the hook the new local gradient and keeps the reduced one aside "
        "in full precision. With a hook, such units run each backward from no gradient",
        "suites/test_conformance_allowed.py::TestTorchLimitations::"
        "test_no_shard_hook_is_handed_the_accumulated_gradient",
    ),
    Unasked(
        "NO_SHARD_NO_SYNC_ONTO_FULL_PRECISION_GRADIENT",
        "NO_SHARD units with a param_dtype or reduce_dtype, a backward under no_sync onto an "
        "existing gradient (zero_grad(set_to_none=False), or a synced backward before): torch "
        "lets autograd add the local gradient to the existing one, a reduced gradient "
        "included, which its next synced backward reduces again (the defect of "
        "NO_SHARD_HOOK_HANDED_ACCUMULATED_GRADIENT), so .grad keeps the existing gradient's "
        "dtype (float32 after a synced backward with a param_dtype; float16 when "
        "keep_low_precision_grads kept an fp16 reduced one); this project's FSDP sets the "
        "reduced gradient aside (BUGS.md class 1) and shows the window's local sum in the "
        "dtype of the local gradients. Such units enter no_sync only without a gradient",
        "suites/test_conformance_allowed.py::TestTorchLimitations::"
        "test_no_shard_no_sync_onto_a_full_precision_gradient",
    ),
    Unasked(
        "LOCAL_LOAD_KEEPS_STALE_UNSHARDED_PARAMETER",
        "load_state_dict of a LOCAL_STATE_DICT while a unit still holds the unsharded "
        "parameter of a forward (no synced backward since: the root after a forward, every "
        "unit of SHARD_GRAD_OP after a no_grad forward): torch copies the loaded shard into the "
        "sharded flat parameter and keeps the unsharded one, so the next summon_full_params "
        "(and forward) shows the values from before the load and all-gathers nothing; this "
        "project's FSDP frees the stale copy (FlatParamHandle.load_local_shard). LOCAL_STATE_DICT "
        "loads are drawn only where no forward ran since the last synced backward",
        "suites/test_conformance_allowed.py::TestTorchLimitations::"
        "test_local_load_keeps_a_stale_unsharded_parameter",
    ),
    Unasked(
        "REPLACED_DATA_WITH_STALE_UNSHARDED_PARAMETER",
        "use_orig_params=True: `p.data = ...` of original parameters while a unit still holds "
        "the unsharded parameter of a forward (no synced backward since: the root after a "
        "forward, every unit of SHARD_GRAD_OP after a no_grad forward): torch's writeback "
        "returns early while the flat parameter is unsharded, so the next summon_full_params "
        "shows the values from before the replacement, all-gathers nothing, and the "
        "replacement is lost when the unit reshards; this project's FSDP writes it back and "
        "frees the stale copy (as for LOCAL_LOAD_KEEPS_STALE_UNSHARDED_PARAMETER). Data is "
        "replaced only where no forward ran since the last synced backward",
        "suites/test_conformance_allowed.py::TestTorchLimitations::"
        "test_replaced_data_is_lost_while_unsharded_is_kept",
    ),
    Unasked(
        "OFFLOAD_ACCUMULATION_OUTSIDE_NO_SYNC",
        "CPUOffload(offload_params=True) (accelerator ranks): a backward onto an existing "
        "gradient outside no_sync() (a second synced microbatch, a step without zero_grad, "
        "gradients a user set) keeps only the newest reduced gradient in torch's FSDP, a "
        "limitation its FullyShardedDataParallel docstring states; this project's FSDP "
        "accumulates. With parameter offload, every backward starts from no gradient "
        "(zero_grad(set_to_none=True) first; one microbatch a step)",
        "suites/test_regressions.py::TestGradientAccumulation::"
        "test_no_sync_microbatches_equal_one_big_batch",
    ),
    Unasked(
        "HYBRID_SYNC_ORDER_BEFORE_TORCH_2_13",
        "sync_module_states=True with a hybrid strategy, torch before 2.13 (accelerator "
        "ranks): torch broadcasts the buffers and parameters over the shard group first, "
        "then the parameters alone over the replicate group, so a shard group whose first "
        "rank is not the source keeps that rank's values; torch 2.13 broadcasts over the "
        "replicate group first, then everything over the shard group, as this project's "
        "FSDP does (fsdp/_sync_states.py). Hybrid units sync module states only where the "
        "torch side is 2.13 or later",
        "suites/test_conformance_allowed.py::TestTorchLimitationsAnywhere::"
        "test_hybrid_sync_module_states_order",
    ),
    Unasked(
        "OFFLOADED_LOW_PRECISION_GRADIENT_SECOND_BACKWARD",
        "SHARD_GRAD_OP with CPUOffload(offload_params=True) and MixedPrecision("
        "keep_low_precision_grads=True) with a param_dtype, accelerator ranks (torch 2.11): "
        "the second backward fails in torch's FSDP ('attempting to assign a gradient with "
        "dtype ... to a tensor with grad_dtype Float'): it assigns the low-precision "
        "gradient to the offloaded full-precision flat parameter. Offloaded units keep "
        "full-precision gradients where either side is torch's",
        "suites/test_conformance_allowed.py::TestTorchLimitationsAnywhere::"
        "test_offloaded_low_precision_gradient_second_backward",
    ),
    Unasked(
        "USER_GRADIENTS_WITH_KEPT_LOW_PRECISION",
        "MixedPrecision(keep_low_precision_grads=True) with a param_dtype, or NO_SHARD with a "
        "reduce_dtype alone (the gradients kept in it): gradients a user sets in full precision (p.grad = ...) make torch's FSDP raise at its next gradient "
        "writeback or showing ('attempting to assign a gradient with dtype ... to a tensor "
        "with grad_dtype Float'); this project's FSDP keeps them. Such setups do not set "
        "gradients where either side is torch's",
        "suites/test_conformance_allowed.py::TestTorchLimitations::"
        "test_user_gradients_with_kept_low_precision_gradients",
    ),
    Unasked(
        "SUMMON_WITH_GRADS_AFTER_NO_SYNC_BACKWARD",
        "summon_full_params(with_grads=True) of a sharded unit after a backward inside "
        "no_sync(): torch's FSDP asserts ('Expects tensor to be sharded with size ... but "
        "got ...': the gradient accumulated under no_sync is unsharded); this project's "
        "FSDP shows it. Not drawn where torch is a side",
        "suites/test_conformance_allowed.py::TestTorchLimitations::"
        "test_summon_with_grads_after_a_no_sync_backward",
    ),
    Unasked(
        "ZERO_GRAD_KEEPS_GRADIENT_SET_ASIDE_BY_NO_SYNC",
        "A sharded unit's gradient (from a synced backward, or set by a user), then a "
        "backward inside no_sync(), then zero_grad(set_to_none=True) before the next synced "
        "backward: torch's FSDP keeps the first gradient hidden (_saved_grad_shard, kept "
        "through the window by design), shows it again as the original parameters' .grad "
        "after the next forward and adds it to the next synced backward's gradient; DDP, "
        "and this project's FSDP, give that backward's gradient alone "
        "(suites/test_regressions.py::TestGradientAccumulation::"
        "test_zero_grad_between_microbatches_discards_them). Such a zero_grad keeps the "
        "gradients (set_to_none=False) where either side is torch's",
        "suites/test_conformance_allowed.py::TestTorchLimitations::"
        "test_zero_grad_after_a_no_sync_backward_keeps_the_set_aside_gradient",
    ),
    Unasked(
        "USER_GRADIENT_HIDDEN_AFTER_A_NONE_WRITEBACK",
        "use_orig_params: gradients a user sets on some parameters of a unit only "
        "(p.grad = ... on the first, or None on the first), a forward or summon (torch "
        "writes the gradients back and marks each parameter whose .grad was None in its "
        "_is_grad_none_mask, cleared only by a backward), then gradients the user sets on "
        "every parameter: after the next forward torch's FSDP shows such a parameter's .grad "
        "as None and the next backward's gradient lacks the user's value; this project's "
        "FSDP keeps it. Every strategy, NO_SHARD too (a summon's reshard of the gradient "
        "hides it as well, at once on ranks other than 0 under rank0_only). After gradients "
        "set on some parameters only, no gradients are set again before a synced backward "
        "where either side is torch's",
        "suites/test_conformance_allowed.py::TestTorchLimitations::"
        "test_user_gradient_hidden_after_a_none_writeback",
    ),
    Unasked(
        "LOCAL_STATE_DICT_OFFLOAD_ON_ACCELERATOR",
        "LOCAL_STATE_DICT with LocalStateDictConfig(offload_to_cpu=True) on accelerator ranks: "
        "torch's save hook calls ShardedTensor.cpu() under no_grad, whose CPU copies of the "
        "local shards do not require grad while the metadata (from the flat parameter) says "
        "they do, and ShardedTensor refuses them ('Local shards' tensor requires_grad property "
        "is incompatible with tensor property'); on CPU ranks .cpu() returns the shard itself "
        "and the save works. No scenario on accelerator ranks saves a LOCAL_STATE_DICT with "
        "offload_to_cpu when either side is torch's",
        "suites/test_conformance_allowed.py::TestTorchLimitationsAnywhere::"
        "test_local_state_dict_offload",
    ),
    Unasked(
        "OFFLOADED_ORIG_PARAMS_SHOW_ZERO_GRADIENTS",
        "use_orig_params=True with CPUOffload(offload_params=True) on accelerator ranks: when "
        "torch's unit reshards before any backward (after a forward; again after "
        "zero_grad(set_to_none=True)), the original parameters of the rank's shard get .grad "
        "views of zeros: its sharded_grad is the offloaded gradient buffer (_cpu_grad, zeros "
        "from the lazy initialisation on), whether a gradient was computed or not. A gradient "
        "nobody computed is None (ours; BUGS.md class 7). No scenario on accelerator ranks "
        "offloads with use_orig_params when either side is torch's",
        "suites/test_conformance_allowed.py::TestTorchLimitationsAnywhere::"
        "test_offloaded_orig_params_before_backward",
    ),
    Unasked(
        "OFFLOADED_EDITS_BEFORE_FIRST_RESHARD",
        "CPUOffload(offload_params=True) on accelerator ranks: torch's lazy initialisation "
        "keeps a pinned copy of each flat parameter's shard (_local_shard) while the flat "
        "parameter still holds the unpinned one; in-place edits of the parameters from "
        "then until the unit first reshards (p.mul_(...) after a no_sync(), a state-dict "
        "or optimizer-state save, fsdp_modules ...) go to the unpinned tensor, which the "
        "next forward gathers, and are lost when the reshard points the flat parameter at "
        "the pinned copy; this project's FSDP keeps them. With parameter offload, in-place "
        "edits are drawn only after a backward (which reshards every unit) where either "
        "side is torch's",
        "suites/test_conformance_allowed.py::TestTorchLimitationsAnywhere::"
        "test_offloaded_edits_before_the_first_reshard",
    ),
    Unasked(
        "CAST_BUFFERS_SAVED_ON_THE_DEVICE",
        "MixedPrecision(buffer_dtype=...) and a FULL_STATE_DICT or SHARDED_STATE_DICT config "
        "with offload_to_cpu=True on accelerator ranks: torch's save hook moves the unit's "
        "buffers to the CPU, then casts them back to their original dtype with "
        "_cast_buffers_to_dtype_and_device(..., compute_device), which moves them back to the "
        "accelerator, so the state dict holds them there; this project's FSDP saves them on "
        "the CPU, as asked. Such setups save model state dicts without offload_to_cpu where "
        "either side is torch's",
        "suites/test_conformance_allowed.py::TestTorchLimitationsAnywhere::"
        "test_cast_buffers_saved_on_the_device",
    ),
    Unasked(
        "UNSHARDED_ORIG_PARAM_OPTIM_STATE_NOT_OFFLOADED",
        "use_orig_params=True, a unit whose shard group is one rank or NO_SHARD, on "
        "accelerator ranks: torch's FSDP.optim_state_dict (and full_optim_state_dict) "
        "returns that unit's states as the optimizer holds them, on the device, whatever "
        "the config's offload_to_cpu (its flat-parameter path and sharded units move them "
        "to the CPU as asked; ours does so for every unit). No scenario on accelerator ranks "
        "saves an optimizer state dict of such a setup when either side is torch's",
        "suites/test_conformance_allowed.py::TestTorchLimitationsAnywhere::"
        "test_unsharded_orig_param_optim_state_offload",
    ),
)


def _pending(name: str, reason: str, rewrite: Rewrite) -> Normalised:
    return Normalised(name, reason, rewrite, impls=(OURS,), pending=True)


PENDING: dict[str, Normalised] = {}  # none at present: every divergence found is fixed or reasoned

# none at present: every divergence of ours found is fixed or reasoned
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
