"""Rows of the reach table that no search draws: why, and the fixed test that
covers each (``path::Class::test`` or ``path::test``; tests/conformance/test_reach.py
checks that each exists). See [Note: How reach is measured] in fsdptest.reach."""

from __future__ import annotations

from typing import NamedTuple


class Undrawn(NamedTuple):
    reason: str
    test: str


_OPTIM = "suites/test_fsdp_optim_state.py::TestFSDPOptimState::"
_SAME_GROUP = (
    "the searches pass no group: the default (the world) is the group a caller would pass, "
    "and a subgroup is a hybrid strategy's, which is drawn"
)
_OPTIM_INPUT = "deprecated in torch (a list of parameters instead of the optimizer); it warns"

UNDRAWN: dict[str, Undrawn] = {
    "FSDP(process_group=a ProcessGroup)": Undrawn(
        _SAME_GROUP,
        "suites/test_fsdp_hybrid_shard.py::TestFSDPHybridShard::test_invalid_pg_specification_raises",
    ),
    "FSDP(cpu_offload=None)": Undrawn(
        "the searches pass CPUOffload(offload_params=False), which None means",
        "suites/test_fsdp_freezing_weights.py::TestFreezingWeights::test_freezing_weights",
    ),
    "FSDP(auto_wrap_policy=transformer_auto_wrap_policy)": Undrawn(
        "a policy decides which units exist, which the drawn policies vary already; each policy's "
        "choices are pinned down module by module",
        "tests/fsdp/test_wrap_policies.py",
    ),
    "FSDP(auto_wrap_policy=lambda_auto_wrap_policy)": Undrawn(
        "as transformer_auto_wrap_policy", "tests/fsdp/test_wrap_policies.py"
    ),
    "FSDP(auto_wrap_policy=CustomPolicy)": Undrawn(
        "as transformer_auto_wrap_policy (with per-module arguments)",
        "suites/test_wrap.py::TestAutoWrap::test_custom_policy",
    ),
    "FSDP(auto_wrap_policy=_or_policy)": Undrawn(
        "as transformer_auto_wrap_policy",
        "suites/test_wrap.py::TestFSDPWrap::test_wrap_batchnorm_individually",
    ),
    "FSDP(device_id=None)": Undrawn(
        "the searches build every model on the ranks' device and say so; None and an index "
        "decide where a module is moved, pinned down with their errors",
        "suites/test_fsdp_misc.py::TestFSDPMiscMultiThread::test_device_id_auto_wrap",
    ),
    "FSDP(device_id=int)": Undrawn(
        "an accelerator index (a CPU run has none); as device_id=None",
        "suites/test_fsdp_misc.py::TestFSDPMiscMultiThread::test_no_params",
    ),
    "FSDP(ignored_states=modules)": Undrawn(
        "modules given as ignored_states mean ignored_modules, which is drawn",
        "suites/test_construction.py::_DifferentIgnoredPerRank::test_root_inherits_children_ignored_modules",
    ),
    "OptimStateDictConfig.offload_to_cpu=False": Undrawn(
        "the base class: set_state_dict_type refuses it for every type (asserted)",
        "suites/test_fsdp_state_dict.py::TestFSDPStateDict::test_wrong_state_dict_config",
    ),
    "OptimStateDictConfig.offload_to_cpu=True": Undrawn(
        "as OptimStateDictConfig.offload_to_cpu=False",
        "suites/test_fsdp_state_dict.py::TestFSDPStateDict::test_wrong_state_dict_config",
    ),
    "StateDictConfig.offload_to_cpu=False": Undrawn(
        "the base class: set_state_dict_type refuses it for every type (asserted)",
        "suites/test_fsdp_state_dict.py::TestFSDPStateDict::test_wrong_state_dict_config",
    ),
    "StateDictConfig.offload_to_cpu=True": Undrawn(
        "as StateDictConfig.offload_to_cpu=False",
        "suites/test_fsdp_state_dict.py::TestFSDPStateDict::test_wrong_state_dict_config",
    ),
    "OptimStateKeyType.PARAM_NAME": Undrawn(
        "the conformance search rekeys a full optimizer state dict by parameter ids to load it; "
        "back to names is pinned down",
        _OPTIM + "test_rekey_optim_state_dict_to_names",
    ),
    "env FSDP_SKIP_WRITEBACK_CHECK": Undrawn(
        "with it, changes a user makes are not written back: a program that changes nothing "
        "shows nothing, one that does trains on stale data by design",
        "suites/test_use_orig_params.py::TestFSDPUseOrigParamsMultipleParamGroups::"
        "test_diff_hyperparams_cpu_offload",
    ),
    "env FSDP_USE_UNSAFE_SETATTR": Undrawn(
        "changes how the names are set, not what they hold; pinned down on a module whose "
        "__setattr__ is overridden",
        "suites/test_fsdp_misc.py::TestFSDPMiscWorldSize1::test_unsafe_setattr",
    ),
    "env TORCH_DISTRIBUTED_DEBUG": Undrawn(
        "DETAIL adds the forward-order check, whose errors need ranks that run different "
        "forwards: pinned down by the exec-order suite",
        "suites/test_fsdp_exec_order.py::TestFSDPExecOrder::test_invalid_first_iter_order",
    ),
    "env FSDP_USE_FAKE_ALL_GATHER": Undrawn(
        "a profiling switch of torch's FSDP: its all-gathers run on a fake process group and "
        "training is wrong by design (torch's own warning); this project's FSDP warns that it "
        "does not implement it",
        "tests/fsdp/test_env_switches.py::TestProfilingSwitches::test_fake_collectives",
    ),
    "env FSDP_USE_FAKE_REDUCE": Undrawn(
        "as FSDP_USE_FAKE_ALL_GATHER, for the reduce-scatters",
        "tests/fsdp/test_env_switches.py::TestProfilingSwitches::test_fake_collectives",
    ),
    "check_is_root()": Undrawn(
        "an internal check torch made public: it lazily initialises the root, which every "
        "drawn forward does",
        "suites/test_fsdp_comm_hooks.py::TestCommunicationHooks::test_default_communication_hook_behavior",
    ),
    "optim_state_dict(optim_state_dict)": Undrawn(
        "the optimizer's own state dict, passed for optimizers whose state_dict() differs: "
        "the drawn optimizers' do not",
        _OPTIM + "test_interface_arguments",
    ),
    "optim_state_dict(group)": Undrawn(_SAME_GROUP, _OPTIM + "test_use_orig_params"),
    "optim_state_dict_to_load(is_named_optimizer=True)": Undrawn(
        "for torchrec's keyed optimizers, which no drawn model uses",
        _OPTIM + "test_compatible_with_trec",
    ),
    "optim_state_dict_to_load(load_directly=True)": Undrawn(
        "loads into the optimizer itself instead of returning the dict: the same conversion",
        _OPTIM + "test_interface_arguments",
    ),
    "optim_state_dict_to_load(group)": Undrawn(_SAME_GROUP, _OPTIM + "test_use_orig_params"),
    "full_optim_state_dict(optim_input)": Undrawn(
        _OPTIM_INPUT, _OPTIM + "test_optim_input_warning"
    ),
    "full_optim_state_dict(group)": Undrawn(_SAME_GROUP, _OPTIM + "test_use_orig_params"),
    "sharded_optim_state_dict(group)": Undrawn(_SAME_GROUP, _OPTIM + "test_use_orig_params"),
    "shard_full_optim_state_dict(optim_input)": Undrawn(
        _OPTIM_INPUT, _OPTIM + "test_optim_input_warning"
    ),
    "scatter_full_optim_state_dict(optim_input)": Undrawn(
        _OPTIM_INPUT, _OPTIM + "test_optim_input_warning"
    ),
    "scatter_full_optim_state_dict(group)": Undrawn(_SAME_GROUP, _OPTIM + "test_use_orig_params"),
    "rekey_optim_state_dict(optim_input)": Undrawn(
        _OPTIM_INPUT, _OPTIM + "test_optim_input_warning"
    ),
    "attribute module": Undrawn(
        "the wrapped module, which every call goes through; read by the suites",
        "suites/test_clip_grad_norm.py::_ClipGradNorm::test_non_root_instance_raises",
    ),
    "attribute params": Undrawn(
        "this project's FSDP only (torch's keeps them in a private attribute): its flat parameters",
        "suites/test_apply_and_access.py",
    ),
    "attribute training_state": Undrawn(
        "this project's FSDP only: the unit's lifecycle, which the seams observe",
        "suites/test_fsdp_backward_prefetch.py::TestBackwardPrefetch",
    ),
}
