"""The rows of the reach table a drawn conformance scenario or property example
exercises, read off its plain data (see [Note: How reach is measured] in
fsdptest.reach). A method's rows follow what the search's runner passes: its
required arguments, the booleans it passes or leaves at their defaults, and
the other arguments it passes."""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Iterator

from fsdptest.conformance import scenario as sc
from fsdptest.conformance.run_env import UNIT_ATTRIBUTES
from fsdptest.properties import examples as ex
from fsdptest.reach.surface import public_methods

_A = sc.AutogradOff


def call_rows(method: str, passed: dict[str, object] | None = None) -> set[str]:
    """The rows of one call of ``method`` with ``passed`` (name -> value)."""
    passed = passed or {}
    rows = {f"{method}()"}
    signature = public_methods()[method]
    for parameter in signature.parameters.values():
        if parameter.name == "self" or parameter.kind in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        ):
            continue
        if isinstance(parameter.default, bool):
            value = passed.get(parameter.name, parameter.default)
            rows |= {f"{method}({parameter.name}={value})", f"{method}({parameter.name})"}
        elif parameter.default is inspect.Parameter.empty or parameter.name in passed:
            rows.add(f"{method}({parameter.name})")
    return rows


# -- the constructor and the configs ----------------------------------------------------------


def _precision_rows(precision: ex.Precision | None) -> set[str]:
    if precision is None:
        return {"FSDP(mixed_precision=None)"}
    rows = {"FSDP(mixed_precision=MixedPrecision)"}
    for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
        dtype = getattr(precision, field)
        rows.add(f"MixedPrecision.{field}={'None' if dtype is None else dtype.value}")
    for field in ("keep_low_precision_grads", "cast_forward_inputs", "cast_root_forward_inputs"):
        rows.add(f"MixedPrecision.{field}={getattr(precision, field)}")
    ignored = "(_BatchNorm, LayerNorm)" if precision.norms_in_full_precision else "(_BatchNorm,)"
    rows.add(f"MixedPrecision._module_classes_to_ignore={ignored}")
    return rows


def _common_rows(
    sharding: ex.Sharding,
    use_orig_params: bool,
    precision: ex.Precision | None,
    offload: bool,
    prefetch: ex.Prefetch,
    forward_prefetch: bool,
    wrap: ex.Wrap,
) -> set[str]:
    policy = {ex.Wrap.NONE: "None", ex.Wrap.BLOCKS: "ModuleWrapPolicy"}.get(
        wrap, "size_based_auto_wrap_policy"
    )
    return {
        "FSDP(module=an nn.Module)",
        f"FSDP(sharding_strategy={sharding.value})",
        f"ShardingStrategy.{sharding.value}",
        f"FSDP(use_orig_params={use_orig_params})",
        f"FSDP(cpu_offload=CPUOffload(offload_params={offload}))",
        f"CPUOffload.offload_params={offload}",
        f"FSDP(backward_prefetch={'None' if prefetch is ex.Prefetch.NONE else prefetch.value})",
        *([f"BackwardPrefetch.{prefetch.value}"] if prefetch is not ex.Prefetch.NONE else []),
        f"FSDP(forward_prefetch={forward_prefetch})",
        f"FSDP(auto_wrap_policy={policy})",
        *_precision_rows(precision),
    }


def _setup_rows(setup: sc.Setup) -> set[str]:
    rows = _common_rows(
        setup.sharding,
        setup.use_orig_params,
        setup.mixed_precision,
        setup.offload_params,
        setup.backward_prefetch,
        setup.forward_prefetch,
        setup.wrap,
    )
    hybrid = setup.sharding.is_hybrid()
    if setup.mesh:
        rows |= {f"FSDP(device_mesh={'2-D' if hybrid else '1-D'})", "FSDP(process_group=None)"}
    else:
        group = "(shard group, replicate group)" if hybrid else "None"
        rows |= {f"FSDP(process_group={group})", "FSDP(device_mesh=None)"}
    ignored = bool(setup.ignored_blocks)
    rows.add(
        f"FSDP(ignored_modules={'modules' if ignored and not setup.ignored_as_states else 'None'})"
    )
    rows.add(
        f"FSDP(ignored_states={'parameters' if ignored and setup.ignored_as_states else 'None'})"
    )
    meta = setup.init is sc.Init.META
    rows.add(f"FSDP(param_init_fn={'a callable' if meta else 'None'})")
    rows |= {
        "FSDP(device_id=torch.device)",
        f"FSDP(sync_module_states={setup.sync_module_states})",
        f"FSDP(limit_all_gathers={setup.limit_all_gathers})",
    }
    if setup.full_prec_in_eval:
        rows.add("env FSDP_USE_FULL_PREC_IN_EVAL")
    return rows


def _settings_rows(settings: sc.Settings) -> set[str]:
    kind = settings.kind
    rows = {f"StateDictType.{kind.value}", f"StateDictSettings.state_dict_type={kind.value}"}
    if not settings.configs:
        return rows
    name = {sc.StateDictKind.FULL: "Full", sc.StateDictKind.SHARDED: "Sharded"}.get(kind, "Local")
    rows.add(f"{name}StateDictConfig.offload_to_cpu={settings.offload_to_cpu}")
    rows.add(f"{name}OptimStateDictConfig.offload_to_cpu={settings.optim_offload}")
    if kind is sc.StateDictKind.FULL:
        rows.add(f"FullStateDictConfig.rank0_only={settings.rank0_only}")
        rows.add(f"FullOptimStateDictConfig.rank0_only={settings.optim_rank0_only}")
    if kind is sc.StateDictKind.SHARDED:
        rows.add(f"ShardedStateDictConfig._use_dtensor={settings.dtensor}")
        rows.add(f"ShardedOptimStateDictConfig._use_dtensor={settings.dtensor}")
    return rows


# -- the program --------------------------------------------------------------------------------


def _op_rows(op: sc.Op, saved_apis: list[sc.SaveOptimState]) -> set[str]:
    if isinstance(op, sc.Forward):
        return {"forward()"}
    if isinstance(op, sc.EnterNoSync):
        return call_rows("no_sync")
    if isinstance(op, sc.EnterSummon):
        passed = {f: getattr(op, f) for f in ("recurse", "writeback", "rank0_only")}
        passed |= {"offload_to_cpu": op.offload_to_cpu, "with_grads": op.with_grads}
        return call_rows("summon_full_params", passed)
    if isinstance(op, sc.ClipGradNorm):
        norm = "inf" if math.isinf(op.norm_type) else str(op.norm_type)
        return call_rows("clip_grad_norm_", {"norm_type": norm}) | {
            f"clip_grad_norm_(norm_type={norm})"
        }
    if isinstance(op, (sc.SetStateDictType, sc.EnterStateDictType)):
        method = "set_state_dict_type" if isinstance(op, sc.SetStateDictType) else "state_dict_type"
        passed = (
            {"state_dict_config": 1, "optim_state_dict_config": 1} if op.settings.configs else {}
        )
        rows = call_rows(method, passed) | _settings_rows(op.settings)
        return rows | {
            "StateDictSettings.state_dict_config=read",
            "StateDictSettings.optim_state_dict_config=read",
        }
    if isinstance(op, sc.SaveStateDict):
        return call_rows("get_state_dict_type") | {"state_dict()"}
    if isinstance(op, sc.LoadStateDict):
        return {"load_state_dict()", f"load_state_dict(strict={op.strict})"}
    if isinstance(op, sc.SaveOptimState):
        saved_apis.append(op)
        return _save_optim_rows(op)
    if isinstance(op, sc.LoadOptimState):
        save = saved_apis[op.slot] if op.slot < len(saved_apis) else sc.SaveOptimState()
        return _load_optim_rows(save, op.scatter)
    if isinstance(op, sc.RekeyOptimState):
        return call_rows("rekey_optim_state_dict", {"optim": 1}) | {"OptimStateKeyType.PARAM_ID"}
    if isinstance(op, sc.Apply):
        return call_rows("apply")
    if isinstance(op, sc.RegisterCommHook):
        return call_rows("register_comm_hook")
    if isinstance(op, sc.FsdpModules):
        return call_rows("fsdp_modules", {"root_only": op.root_only})
    if isinstance(op, sc.ReplaceParams):
        return {"model: parameters replaced by the user (a new nn.Parameter)"}
    if isinstance(op, sc.ReplaceData):
        return {"model: parameter data replaced by the user (p.data = ...)"}
    if isinstance(op, sc.Final):
        return call_rows("summon_full_params") | {"state_dict()"}
    return set()


def _save_optim_rows(save: sc.SaveOptimState) -> set[str]:
    if save.api is sc.OptimApi.FULL:
        return call_rows("full_optim_state_dict", {"rank0_only": save.rank0_only})
    if save.api is sc.OptimApi.SHARDED:
        return call_rows("sharded_optim_state_dict")
    return call_rows("optim_state_dict") | call_rows("get_state_dict_type")


def _load_optim_rows(save: sc.SaveOptimState, scatter: bool) -> set[str]:
    """The loader ``_op_LoadOptimState`` calls (a full dict only rank 0 holds is scattered)."""
    passed: dict[str, object] = {"optim": 1}
    if save.api is sc.OptimApi.FULL:
        scattered = scatter or save.rank0_only
        method = "scatter_full_optim_state_dict" if scattered else "shard_full_optim_state_dict"
        return call_rows(method, passed)
    if save.api is sc.OptimApi.SHARDED:
        return call_rows("flatten_sharded_optim_state_dict", passed)
    return call_rows("optim_state_dict_to_load")


# -- the model ----------------------------------------------------------------------------------


def _layer_rows(layers: Iterable[sc.Layer]) -> set[str]:
    rows: set[str] = set()
    kinds = {
        sc.LayerKind.SHARED: "model: shared parameters (a module used twice)",
        sc.LayerKind.TIED: "model: tied parameters (one parameter, two modules)",
        sc.LayerKind.CHECKPOINTED: "model: activation checkpointing",
        sc.LayerKind.NORM: "model: buffers: float32",
    }
    for layer in layers:
        if layer.kind in kinds and layer.kind is not sc.LayerKind.NORM:
            rows.add(kinds[layer.kind])
        if layer.kind is sc.LayerKind.SCALE:
            rows.add(f"model: buffers: {layer.buffer_dtype.value}")
        if layer.kind is sc.LayerKind.COUNTER:
            rows |= {"model: buffers: float64", "model: buffers: int64"}
        if layer.kind is sc.LayerKind.BATCHNORM:
            rows |= {"model: buffers: float32", "model: buffers: int64"}
        if layer.kind in (sc.LayerKind.SCALE, sc.LayerKind.COUNTER) and not layer.persistent:
            rows.add("model: buffers: non-persistent")
    return rows


def _block_rows(blocks: Iterable[sc.Block]) -> set[str]:
    rows: set[str] = set()
    names = {
        _A.NO_GRAD: "model: autograd off in forward: torch.no_grad()",
        _A.DETACH: "model: autograd off in forward: .detach()",
        _A.INFERENCE: "model: autograd off in forward: torch.inference_mode()",
    }
    for block in blocks:
        if block.autograd in names:
            rows.add(names[block.autograd])
        with_params = [layer for layer in block.layers if layer.has_params()]
        frozen = [layer for layer in with_params if layer.frozen]
        if frozen:
            rows.add("model: autograd off in forward: requires_grad=False")
            whole = len(frozen) == len(with_params)
            rows.add(
                "model: frozen subtree (a whole unit)"
                if whole
                else "model: frozen parameters beside trainable ones in one unit"
            )
    return rows


def padding_only(numels: Iterable[int], world_size: int) -> bool:
    """Whether some rank holds only padding of one of flat parameters of these sizes."""
    for numel in numels:
        shard = math.ceil(numel / world_size)
        if numel and shard * (world_size - 1) >= numel:
            return True
    return False


def _unit_numels(blocks: Iterable[sc.Block], width: int) -> Iterator[int]:
    """Every block's own parameters' numel, its input width carried along (the
    units of ``ModuleWrapPolicy``; of the other policies roughly)."""
    for block in blocks:
        numel, w = 0, width
        for layer in block.layers:
            out = layer.out_width(w)
            if layer.kind in (sc.LayerKind.LINEAR, sc.LayerKind.CHECKPOINTED):
                numel += w * out + (out if layer.bias else 0)
            elif layer.kind in (sc.LayerKind.SHARED, sc.LayerKind.TIED):
                numel += w * w + (w if layer.bias else 0) * (
                    2 if layer.kind is sc.LayerKind.TIED else 1
                )
            elif layer.kind in (sc.LayerKind.NORM, sc.LayerKind.BATCHNORM) and layer.bias:
                numel += 2 * w
            w = out
        yield numel
        yield from _unit_numels(block.children, w)
        width = block.out_width(width)


def _net_rows(net: sc.Net, setup: sc.Setup, world_size: int) -> set[str]:
    rows = _layer_rows(net.layers()) | _block_rows(net.all_blocks())
    if net.vocab:
        rows.add("model: integer inputs (an embedding)")
        if net.tied_head:
            rows.add("model: tied parameters (one parameter, two modules)")
    if setup.ignored_blocks:
        rows.add("model: parameters no unit manages (ignored)")
    if world_size in (3, 4) and padding_only(_unit_numels(net.blocks, net.width), world_size):
        rows.add(f"model: ranks that hold only padding, world size {world_size}")
    return rows


def scenario_rows(scenario: sc.Scenario) -> set[str]:
    """Every row one conformance scenario exercises."""
    rows = _setup_rows(scenario.setup) | _net_rows(
        scenario.net, scenario.setup, scenario.world_size
    )
    rows |= {"named_parameters()", "named_buffers()"}  # every op's snapshot
    # what the run observes of every unit, at construction and at the end
    rows |= {f"attribute {name}" for name in UNIT_ATTRIBUTES if not name.startswith("_")}
    saved: list[sc.SaveOptimState] = []
    for op in scenario.ops:
        rows |= _op_rows(op, saved)
        if isinstance(op, sc.Forward) and op.no_grad:
            rows.add("model: a forward under torch.no_grad()")
        if isinstance(op, sc.Forward) and op.again:
            rows.add("model: several forwards before one backward")
    return rows


# -- property examples --------------------------------------------------------------------------

_BETWEEN = {
    ex.Between.FULL_STATE_DICT: "FULL_STATE_DICT",
    ex.Between.SHARDED_STATE_DICT: "SHARDED_STATE_DICT",
    ex.Between.LOCAL_STATE_DICT: "LOCAL_STATE_DICT",
}


def example_rows(example: ex.Example) -> set[str]:
    """Every row one property example exercises."""
    config = example.config
    rows = _common_rows(
        config.sharding,
        config.use_orig_params,
        config.mixed_precision,
        config.offload_params,
        config.backward_prefetch,
        config.forward_prefetch,
        config.wrap,
    )
    group = "(shard group, replicate group)" if config.sharding.is_hybrid() else "None"
    ignored = "modules" if config.ignored_blocks else "None"
    rows |= {f"FSDP(process_group={group})", f"FSDP(ignored_modules={ignored})"}
    rows |= {f"FSDP(sync_module_states={config.sync_module_states})", "forward()"}
    rows |= call_rows("summon_full_params")  # the full parameters, checked after every step
    if config.use_orig_params and not config.offload_params:
        rows |= call_rows("summon_full_params", {"with_grads": True})
    if config.ignored_blocks:
        rows.add("model: parameters no unit manages (ignored)")
    for step in example.steps:
        rows |= _step_rows(step)
    return rows


def _step_rows(step: ex.Step) -> set[str]:
    rows: set[str] = set()
    if ex.NO_SYNC in step.microbatches:
        rows |= call_rows("no_sync")
    arguments = step.clip.arguments()
    if arguments is not None:
        norm = "inf" if math.isinf(arguments[1]) else str(arguments[1])
        rows |= call_rows("clip_grad_norm_", {"norm_type": norm}) | {
            f"clip_grad_norm_(norm_type={norm})"
        }
    if step.then in _BETWEEN:
        kind = _BETWEEN[step.then]
        rows |= call_rows("state_dict_type") | {"state_dict()", "load_state_dict(strict=True)"}
        rows |= {f"StateDictType.{kind}"}
    elif step.then in (ex.Between.SUMMON_EDIT, ex.Between.SUMMON_EDIT_OFFLOADED):
        offload = step.then is ex.Between.SUMMON_EDIT_OFFLOADED
        rows |= call_rows("summon_full_params", {"writeback": True, "offload_to_cpu": offload})
    return rows
