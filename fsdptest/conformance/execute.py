"""One scenario run by one implementation on one rank, observed (rank side).

[Note: What a run observes]
A run builds the scenario's model from its seed, registers forward hooks on
every module of it (before wrapping, so the hooks see what each module's own
forward receives and returns, after FSDP's casts), wraps it with the
scenario's constructor arguments and runs the program one op at a time. For
the construction and for every op it records:

- what the call returned, observed (``fsdptest.conformance.observe``): the
  loss and the output of a forward, the total norm of ``clip_grad_norm_``, the
  state dict and the settings in effect for ``state_dict()``, the missing and
  unexpected keys of ``load_state_dict``, optimizer state dicts (saved,
  converted for loading, and the optimizer's own after loading), the answer of
  ``fsdp_modules``, the previous settings ``set_state_dict_type`` returns;
- the inputs and outputs of every module's forward (dtype, device, shape,
  values), what a registered communication hook is handed, which modules
  ``param_init_fn`` is called on;
- every collective, every warning and the exception, if one was raised;
- then a snapshot that no call changes: ``named_parameters()`` and their
  ``.grad``, ``named_buffers()``, the attributes the original modules hold
  under their parameters' names (what ``model.layer.weight`` gives a user)
  and their ``.grad``, and whether each state dict and optimizer state dict
  saved earlier has changed since it was returned.

An op that raises ends the run: the exception is the last observation (its
type and message), the open contexts are closed, and the other implementation
must stop at the same op with the same exception. A rank's two runs share
nothing but the seed.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from fsdptest.conformance import scenario as sc
from fsdptest.conformance.implementation import FsdpApi, as_a_user_writes
from fsdptest.conformance.nets import APPLY_FNS, batch, build, materialize
from fsdptest.conformance.observe import (
    EXACT,
    Collectives,
    Observer,
    catching,
    first_difference,
    sharing_with,
)
from fsdptest.conformance.run_env import (
    STATE_DICT_TYPES,
    UNIT_ATTRIBUTES,
    drop_parameter_hooks,
    full_prec_in_eval,
    own_group,
    unit_attribute,
)

LR = 1e-2
ADAM_EPS = 1e-3  # a large epsilon: near-zero gradients do not turn into whole steps
EDIT_SCALE, EDIT_SHIFT = 0.75, 0.01


class OpRecord(NamedTuple):
    index: int  # -1: the construction
    op: str
    observed: dict[str, Any]


class Trace(NamedTuple):
    implementation: str
    records: tuple[OpRecord, ...]
    ended: str  # "completed" or "stopped at op N by ExceptionType"


LOW_PRECISION_HOOKS = (sc.HookKind.FP16_COMPRESS, sc.HookKind.BF16_COMPRESS)


class HookState:
    """The state handed to ``register_comm_hook``: the group to reduce over."""

    def __init__(self, group: Any) -> None:
        self.process_group = group


class Run:
    """The scenario under one implementation on this rank (see the module note)."""

    scenario: sc.Scenario
    api: FsdpApi
    rank: int
    device: torch.device
    observe: Observer
    model: Any
    optim: torch.optim.Optimizer | None
    loss: torch.Tensor | None

    def __init__(self, scenario: sc.Scenario, api: FsdpApi, device: torch.device) -> None:
        self.scenario = scenario
        self.api = api
        self.rank = dist.get_rank()
        self.device = device
        self.observe = Observer(device)
        self.model = None
        self.optim = None
        self.loss = None
        self._records: list[OpRecord] = []
        self._current: dict[str, Any] = {}
        # (name, context, the state-dict settings a state_dict_type context restores)
        self._contexts: list[tuple[str, contextlib.AbstractContextManager[Any], sc.Settings]] = []
        self._saved: list[tuple[Any, Any, Any]] = []  # (state dict, observed, its type)
        self._saved_optim: list[tuple[Any, Any, sc.Settings | None, sc.OptimApi, bool]] = []
        self._names: dict[int, str] = {}  # module id -> name in the unwrapped model
        self._attributes: list[tuple[str, nn.Module, str]] = []
        self._hook_state: Any = None  # what register_comm_hook was given
        self._scaler: Any = None  # the ShardedGradScaler of scaled steps
        self._collectives = Collectives()  # recording while the trace runs
        self._settings = sc.Settings(configs=False)

    # -- the run -------------------------------------------------------------------------

    def trace(self) -> Trace:
        ended = "completed"
        with self._collectives as collectives, self._low_precision_hooks_observed():
            try:
                if not self._step(-1, "construct", self._construct, collectives):
                    ended = "stopped at construction"
                else:
                    for index, op in enumerate(self.scenario.ops):
                        if not self._step(index, op.describe(), self._handler(op), collectives):
                            error = self._records[-1].observed["exception"][0]
                            ended = f"stopped at op {index} by {error}"
                            break
            finally:
                self._close_contexts()
        records = tuple(self._records)
        self._release()
        return Trace(self.api.describe(), records, ended)

    def _step(
        self, index: int, text: str, fn: Callable[[], None], collectives: Collectives
    ) -> bool:
        self._current = {}
        with catching() as caught:
            fn()
        observed = self._current
        observed["collectives"] = collectives.take()
        observed["warnings"] = caught[0].warnings
        if caught[0].error is not None:
            observed["exception"] = caught[0].error
        else:
            with catching() as snapshot_caught:
                observed.update(self._snapshot())
            if snapshot_caught[0].error is not None:
                observed["exception"] = ("while observing",) + snapshot_caught[0].error
            observed["collectives while observing"] = collectives.take()
        self._records.append(OpRecord(index, text, observed))
        return "exception" not in observed

    def _note(self, key: str, value: Any) -> None:
        """Records an observation of the current op (a list per key when repeated)."""
        self._current.setdefault(key, []).append(self.observe(value))

    def _close_contexts(self) -> None:
        while self._contexts:
            _, context, _ = self._contexts.pop()
            with contextlib.suppress(Exception):
                context.__exit__(None, None, None)

    def _release(self) -> None:
        if self.model is not None:
            drop_parameter_hooks(self.model)
        self.model = self.optim = self.loss = None
        self._saved.clear()
        self._saved_optim.clear()
        self._attributes.clear()
        self._hook_state = None
        self._scaler = None

    # -- construction ----------------------------------------------------------------------

    def _construct(self) -> None:
        setup = self.scenario.setup
        meta = setup.init is sc.Init.META
        seed = self.scenario.seed + (7919 * self.rank if setup.rank_seeded else 0)
        model = build(self.scenario.net, seed, torch.device("meta") if meta else self.device)
        self._names = {id(m): name for name, m in model.named_modules()}
        self._register_forward_hooks(model)
        self._attributes = [
            (f"{owner}.{name}".lstrip("."), module, name)
            for owner, module in model.named_modules()
            for name, _ in module.named_parameters(recurse=False)
        ]
        kwargs = self._fsdp_kwargs(model)
        if meta:
            kwargs["param_init_fn"] = self._param_init_fn()
        with full_prec_in_eval(setup.full_prec_in_eval):
            self.model = self.api.FSDP(model, **kwargs)
        self._note("modules", self._structure())
        self._note_units()
        self.optim = self._optimizer()

    def _fsdp_kwargs(self, model: nn.Module) -> dict[str, Any]:
        setup, api = self.scenario.setup, self.api
        kwargs: dict[str, Any] = {
            "sharding_strategy": api.ShardingStrategy[setup.sharding.value],
            "use_orig_params": setup.use_orig_params,
            "mixed_precision": api.mixed_precision(setup.mixed_precision),
            "cpu_offload": api.CPUOffload(offload_params=setup.offload_params),
            "backward_prefetch": api.prefetch(setup.backward_prefetch),
            "forward_prefetch": setup.forward_prefetch,
            "limit_all_gathers": setup.limit_all_gathers,
            "auto_wrap_policy": api.policy(setup.wrap, setup.min_num_params),
            "sync_module_states": setup.sync_module_states,
            "device_id": self.device,
        }
        ignored = [model.blocks[i] for i in setup.ignored_blocks]  # type: ignore[index]
        if ignored and setup.ignored_as_states:
            kwargs["ignored_states"] = [p for m in ignored for p in m.parameters()]
        elif ignored:
            kwargs["ignored_modules"] = ignored
        kwargs.update(self._groups())
        return as_a_user_writes("FullyShardedDataParallel", kwargs)

    def _groups(self) -> dict[str, Any]:
        """The process groups or device mesh of the scenario (every rank creates every group)."""
        setup, world = self.scenario.setup, self.scenario.world_size
        if setup.mesh:
            from torch.distributed.device_mesh import init_device_mesh

            if setup.sharding.is_hybrid():
                shape = (setup.replicas, world // setup.replicas)
                return {
                    "device_mesh": init_device_mesh(
                        self.device.type, shape, mesh_dim_names=("replicate", "shard")
                    )
                }
            return {"device_mesh": init_device_mesh(self.device.type, (world,))}
        if not setup.sharding.is_hybrid():
            return {}
        shards = world // setup.replicas
        shard_layout = [list(range(r * shards, (r + 1) * shards)) for r in range(setup.replicas)]
        replicate_layout = [list(range(s, world, shards)) for s in range(shards)]
        return {
            "process_group": (
                own_group(shard_layout, self.rank),
                own_group(replicate_layout, self.rank),
            )
        }

    def _param_init_fn(self) -> Callable[[nn.Module], None]:
        init = functools.partial(materialize, names=self._names, device=self.device)

        def param_init_fn(module: nn.Module) -> None:
            self._note("param_init_fn called on", self._names.get(id(module), "?"))
            init(module)

        return param_init_fn

    def _optimizer(self) -> torch.optim.Optimizer:
        params = self.model.parameters()
        if self.scenario.setup.optimizer is sc.Optimizer.ADAM:
            return torch.optim.Adam(params, lr=LR, eps=ADAM_EPS, foreach=False)
        return torch.optim.SGD(params, lr=LR, momentum=0.9, foreach=False)

    def _register_forward_hooks(self, model: nn.Module) -> None:
        for name, module in model.named_modules():
            module.register_forward_pre_hook(self._forward_hook(name, "input"), with_kwargs=True)
            module.register_forward_hook(self._forward_hook(name, "output"), with_kwargs=True)

    def _forward_hook(self, name: str, what: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, *output: Any) -> None:
            value = output[0] if output else (args, kwargs)
            self._note(f"forward {name or '(root)'} {what}", value)

        return hook

    def _structure(self) -> tuple[tuple[str, str], ...]:
        """Every module of the wrapped model: its name and whether it is an FSDP unit."""
        return tuple(
            (name, "FSDP" if self.api.is_fsdp(m) else type(m).__name__)
            for name, m in self.model.named_modules()
        )

    # -- the snapshot --------------------------------------------------------------------

    def _snapshot(self) -> dict[str, Any]:
        model, observed = self.model, {}
        if model is None:
            return observed
        for name, param in model.named_parameters():
            observed[f"parameter {name}"] = self.observe(param)
            observed[f"parameter {name} .grad"] = self.observe(param.grad)
        for name, buffer in model.named_buffers():
            observed[f"buffer {name}"] = self.observe(buffer)
        for path, module, name in self._attributes:
            value = getattr(module, name, None)
            observed[f"attribute {path}"] = self.observe(value)
            if isinstance(value, torch.Tensor):
                observed[f"attribute {path} .grad"] = self.observe(value.grad)
        for slot, (saved, when_saved, _) in enumerate(self._saved):
            observed[f"state dict {slot} changed since saved"] = self._changed(saved, when_saved)
        for slot, (saved, when_saved, *_) in enumerate(self._saved_optim):
            changed = self._changed(saved, when_saved)
            observed[f"optimizer state dict {slot} changed since saved"] = changed
        observed["training"] = bool(model.training)
        return observed

    def _changed(self, saved: Any, when_saved: Any) -> bool:
        return first_difference(self.observe(saved), when_saved, EXACT) is not None

    # -- the ops ---------------------------------------------------------------------------

    def _handler(self, op: sc.Op) -> Callable[[], None]:
        method = getattr(self, "_op_" + type(op).__name__)
        return functools.partial(method, op)

    def _op_Forward(self, op: sc.Forward) -> None:
        index = len(self._records) - 1
        data = batch(self.scenario.net, self.scenario.seed, self.rank, index, self.device)
        grad = torch.no_grad() if op.no_grad else contextlib.nullcontext()
        with grad:
            output = self.model(data.inputs)
            loss = data.loss(output)
        self._note("output", output)
        self._note("loss", float(loss.detach().float().cpu()))
        if op.again and self.loss is not None:  # one backward through both forwards
            loss = self.loss + loss
        self.loss = None if op.no_grad else loss

    def _op_Backward(self, op: sc.Backward) -> None:
        loss, self.loss = self.loss, None
        assert loss is not None, "a drawn program runs backward after a forward"
        loss.backward()

    def _op_OptimStep(self, op: sc.OptimStep) -> None:
        assert self.optim is not None
        self.optim.step()
        self._note("optimizer state", self.optim.state_dict())

    def _op_ZeroGrad(self, op: sc.ZeroGrad) -> None:
        target = self.model if op.on_model else self.optim
        target.zero_grad(set_to_none=op.set_to_none)

    def _op_Train(self, op: sc.Train) -> None:
        self.model.train(op.mode)
        self._note(
            "modules in training mode",
            tuple(n for n, m in self.model.named_modules() if m.training),
        )

    def _op_EnterNoSync(self, op: sc.EnterNoSync) -> None:
        self._enter("no_sync", self.model.no_sync())

    def _op_Exit(self, op: sc.Exit) -> None:
        name, context, settings = self._contexts.pop()
        self._note("left", name)
        context.__exit__(None, None, None)
        if name == "state_dict_type":  # what persists after leaving the context
            self._settings = settings  # a summon or no_sync leaves a type set inside it
            self._note("settings after leaving", self.api.FSDP.get_state_dict_type(self.model))

    def _enter(self, name: str, context: contextlib.AbstractContextManager[Any]) -> None:
        previous = self._settings
        context.__enter__()
        self._contexts.append((name, context, previous))

    def _op_ClipGradNorm(self, op: sc.ClipGradNorm) -> None:
        options = as_a_user_writes("clip_grad_norm_", {"norm_type": op.norm_type})
        self._note("total norm", self.model.clip_grad_norm_(op.max_norm, **options))

    def _op_SetStateDictType(self, op: sc.SetStateDictType) -> None:
        config, optim_config = self.api.configs(op.settings)
        kind = self.api.state_dict_type(op.settings)
        previous = self.api.FSDP.set_state_dict_type(self.model, kind, config, optim_config)
        self._settings = op.settings
        self._note("previous settings", previous)

    def _op_EnterStateDictType(self, op: sc.EnterStateDictType) -> None:
        config, optim_config = self.api.configs(op.settings)
        kind = self.api.state_dict_type(op.settings)
        self._enter(
            "state_dict_type", self.api.FSDP.state_dict_type(self.model, kind, config, optim_config)
        )
        self._settings = op.settings

    def _op_SaveStateDict(self, op: sc.SaveStateDict) -> None:
        settings = self.api.FSDP.get_state_dict_type(self.model)
        self._note("settings", settings)
        saved = self.model.state_dict()
        observed = self.observe(saved)
        self._current["state dict"] = [observed]
        self._saved.append((saved, observed, settings.state_dict_type))

    def _type_in_effect(self) -> Any:  # None where the units disagree (torch raises)
        try:
            return self.api.FSDP.get_state_dict_type(self.model).state_dict_type
        except Exception:
            return None

    def _op_LoadStateDict(self, op: sc.LoadStateDict) -> None:
        saved_under, now = self._saved[op.slot][2], self._type_in_effect()
        if None not in (saved_under, now) and now != saved_under:  # see sc.ProgramNotAsDrawn
            raise sc.ProgramNotAsDrawn(f"slot {op.slot}: {saved_under} at save, {now} now")
        saved = dict(self._saved[op.slot][0])
        if op.edit is sc.LoadEdit.DROP and saved:
            saved.pop(next(iter(saved)))
        elif op.edit is sc.LoadEdit.EXTRA:
            saved["extra.key"] = torch.zeros(1, device=self.device)
        self._note("incompatible keys", self.model.load_state_dict(saved, strict=op.strict))

    def _op_SaveOptimState(self, op: sc.SaveOptimState) -> None:
        FSDP, optim = self.api.FSDP, self.optim
        settings: sc.Settings | None = None
        rank0_only = False
        if op.api is sc.OptimApi.OPTIM_STATE_DICT:
            saved = FSDP.optim_state_dict(self.model, optim)
            settings = self._settings
            rank0_only = settings.kind is sc.StateDictKind.FULL and settings.optim_rank0_only
        elif op.api is sc.OptimApi.FULL:
            saved = FSDP.full_optim_state_dict(self.model, optim, rank0_only=op.rank0_only)
            rank0_only = op.rank0_only
        else:
            saved = FSDP.sharded_optim_state_dict(self.model, optim)
        observed = self.observe(saved)
        self._current["optimizer state dict"] = [observed]
        self._current["optimizer state dict shares the live state at"] = sharing_with(saved, optim)
        self._saved_optim.append((saved, observed, settings, op.api, rank0_only))

    def _op_LoadOptimState(self, op: sc.LoadOptimState) -> None:
        FSDP, model, optim = self.api.FSDP, self.model, self.optim
        saved, _, _, api, rank0_only = self._saved_optim[op.slot]
        saved = copy.copy(saved)
        if api is sc.OptimApi.OPTIM_STATE_DICT:
            loadable = FSDP.optim_state_dict_to_load(model, optim, saved)
        elif api is sc.OptimApi.SHARDED:
            loadable = FSDP.flatten_sharded_optim_state_dict(saved, model, optim)
        elif op.scatter or rank0_only:
            loadable = FSDP.scatter_full_optim_state_dict(
                saved if self.rank == 0 else None, model, optim=optim
            )
        else:
            loadable = FSDP.shard_full_optim_state_dict(saved, model, optim=optim)
        self._note("to load", loadable)
        optim.load_state_dict(loadable)
        self._note("optimizer state", optim.state_dict())

    def _op_RekeyOptimState(self, op: sc.RekeyOptimState) -> None:
        saved = self._saved_optim[op.slot][0]
        key_type = self.api.OptimStateKeyType.PARAM_ID
        self._note(
            "rekeyed",
            self.api.FSDP.rekey_optim_state_dict(saved, key_type, self.model, optim=self.optim),
        )

    def _op_EnterSummon(self, op: sc.EnterSummon) -> None:
        options = {
            "recurse": op.recurse,
            "writeback": op.writeback,
            "rank0_only": op.rank0_only,
            "offload_to_cpu": op.offload_to_cpu,
            "with_grads": op.with_grads,
        }
        summon = self.api.FSDP.summon_full_params(
            self.model, **as_a_user_writes("summon_full_params", options)
        )
        self._enter("summon_full_params", summon)

    @torch.no_grad()
    def _op_EditParams(self, op: sc.EditParams) -> None:
        for _, param in self.model.named_parameters():
            tensor = param.grad if op.grads else param
            if tensor is not None and tensor.numel():
                tensor.mul_(EDIT_SCALE).add_(EDIT_SHIFT)

    def _op_SetGrads(self, op: sc.SetGrads) -> None:
        for i, (_, param) in enumerate(self.model.named_parameters()):
            if op.only_first and i > 0:
                break
            none = op.none_first and i == 0
            param.grad = None if none else torch.full_like(param, op.value * (i + 1))

    def _op_ReplaceData(self, op: sc.ReplaceData) -> None:
        for _, param in self.model.named_parameters():
            data = param.detach().clone().mul_(0.5)
            param.data = data.reshape(-1) if op.flatten else data

    def _op_ReplaceParams(self, op: sc.ReplaceParams) -> None:
        replaced: dict[int, nn.Parameter] = {}  # a tied parameter stays one object
        for _, module, name in self._attributes:
            old = getattr(module, name, None)
            if isinstance(old, nn.Parameter):
                if id(old) not in replaced:
                    new = old.detach().clone().mul_(0.5)
                    replaced[id(old)] = nn.Parameter(new, requires_grad=old.requires_grad)
                setattr(module, name, replaced[id(old)])
        self.optim = self._optimizer()

    def _op_ScaledBackward(self, op: sc.ScaledBackward) -> None:
        loss, self.loss = self.loss, None
        assert loss is not None, "a drawn program runs a scaled backward after a forward"
        if self._scaler is None:
            kwargs: dict[str, Any] = {"device": self.device.type}
            if op.growth_interval is not None:
                kwargs["growth_interval"] = op.growth_interval
            self._scaler = self.api.ShardedGradScaler(**kwargs)
        self._scaler.scale(loss).backward()

    def _op_ScalerStep(self, op: sc.ScalerStep) -> None:
        scaler, optim = self._scaler, self.optim
        assert scaler is not None and optim is not None
        if op.clip:
            scaler.unscale_(optim)
            self._note_found_inf_agreement()
            self._note("total norm", self.model.clip_grad_norm_(0.05))
            scaler.step(optim)
        else:
            scaler.step(optim)  # unscales first
            self._note_found_inf_agreement()
        scaler.update()
        self._note("scale", scaler.get_scale())
        self._note("scaler state", scaler.state_dict())
        self._note("optimizer state", optim.state_dict())

    def _note_found_inf_agreement(self) -> None:
        """The collectives of ``unscale_`` (the ranks agreeing whether any found
        inf/nan), apart from the op's others (a clip's): see the allowed difference
        SCALER_FOUND_INF_AGREEMENT."""
        self._current["found-inf agreement"] = self._collectives.take()

    def _op_Apply(self, op: sc.Apply) -> None:
        returned = self.model.apply(APPLY_FNS[op.fn])
        self._note("returned the model", returned is self.model)

    def _op_RegisterCommHook(self, op: sc.RegisterCommHook) -> None:
        if op.kind in LOW_PRECISION_HOOKS:
            # as torch's docs and tests register them: the state of the unit's group
            from torch.distributed.algorithms._comm_hooks import default_hooks

            state = default_hooks.LowPrecisionState(process_group=self.model.process_group)
            self._hook_state = state
            self.model.register_comm_hook(state, getattr(default_hooks, op.kind.value))
            return
        self._hook_state = HookState(dist.group.WORLD)
        hook = self._recording_hook if op.kind is sc.HookKind.RECORDING else self._local_hook
        self.model.register_comm_hook(self._hook_state, hook)

    def _recording_hook(
        self, state: Any, grad: torch.Tensor, output: torch.Tensor | None = None
    ) -> None:
        self._note_hook(state, grad, output)
        group = state.process_group
        size = dist.get_world_size(group)
        if output is None:
            dist.all_reduce(grad, group=group)
            grad.div_(size)
        else:
            dist.reduce_scatter_tensor(output, grad.contiguous(), group=group)
            output.div_(size)

    def _local_hook(
        self, state: Any, grad: torch.Tensor, output: torch.Tensor | None = None
    ) -> None:
        """Keeps each rank's own gradient (no communication)."""
        self._note_hook(state, grad, output)
        if output is not None:
            size = dist.get_world_size(state.process_group)
            output.copy_(grad.flatten().chunk(size)[dist.get_rank(state.process_group)])

    @contextlib.contextmanager
    def _low_precision_hooks_observed(self) -> Iterator[None]:
        """While a scenario with one of torch's low-precision hooks runs, what the
        hook is handed is observed (its dtype matters: torch hands these hooks
        the gradient uncast), through ``default_hooks._low_precision_hook``, which
        both hooks call by its module name: the registered hook stays torch's own
        function, which both FSDPs recognise by identity or name. On CPU ranks
        ``Tensor.record_stream`` is a no-op for CPU tensors meanwhile: the hooks'
        ``_decompress`` records the low-precision gradient on
        ``torch.cpu.current_stream()``, which CPU tensors reject whichever FSDP
        calls the hook ([Note: Low-precision hooks on the CPU] in
        ``suites/test_fsdp_comm_hooks.py``, which asserts that it still does);
        recording only tells the CUDA caching allocator when memory may be reused."""
        if not any(
            isinstance(op, sc.RegisterCommHook) and op.kind in LOW_PRECISION_HOOKS
            for op in self.scenario.ops
        ):
            yield
            return
        from torch.distributed.algorithms._comm_hooks import default_hooks

        low_precision_hook = default_hooks._low_precision_hook
        record_stream = torch.Tensor.record_stream

        def observed(prec: torch.dtype, state: Any, grad: Any, output: Any) -> None:
            self._note_hook(state, grad, output, prec)
            low_precision_hook(prec, state, grad, output)

        def record_unless_cpu(tensor: torch.Tensor, stream: Any) -> None:
            if tensor.device.type != "cpu":
                record_stream(tensor, stream)

        default_hooks._low_precision_hook = observed
        if self.device.type == "cpu":
            torch.Tensor.record_stream = record_unless_cpu  # type: ignore[method-assign]
        try:
            yield
        finally:
            default_hooks._low_precision_hook = low_precision_hook
            torch.Tensor.record_stream = record_stream  # type: ignore[method-assign]

    def _note_hook(
        self, state: Any, grad: torch.Tensor, output: torch.Tensor | None, prec: Any = None
    ) -> None:
        """The output shard is observed without values: it is empty memory to fill;
        ``prec``: the dtype a low-precision hook compresses to."""
        shard = None if output is None else self.observe(output)._replace(values="to be written")
        handed = (type(state).__name__, state is self._hook_state, grad, shard)
        self._note("comm hook called with", handed if prec is None else (*handed, prec))

    def _op_FsdpModules(self, op: sc.FsdpModules) -> None:
        names = {id(m): name for name, m in self.model.named_modules()}
        options = as_a_user_writes("fsdp_modules", {"root_only": op.root_only})
        found = self.api.FSDP.fsdp_modules(self.model, **options)
        self._note("fsdp modules", tuple(names.get(id(m), "(not in the model)") for m in found))

    def _op_WrapAgain(self, op: sc.WrapAgain) -> None:
        self.model = self.api.FSDP(self.model, device_id=self.device)
        self._note("modules", self._structure())

    def _op_Final(self, op: sc.Final) -> None:
        FSDP = self.api.FSDP
        with FSDP.summon_full_params(self.model):
            self._note("full parameters", dict(self.model.named_parameters()))
            self._op_EditParams(sc.EditParams())  # what a summon with its defaults writes back
        with FSDP.state_dict_type(self.model, self.api.StateDictType.FULL_STATE_DICT):
            self._note("full state dict", self.model.state_dict())
        self._note_default_settings()
        self._note_units()
        if self._saved_optim and self.optim is not None:
            # one more optimizer step: whether the optimizer state dicts saved before
            # it change with it (observed after every op), for programs that saved
            # last (the gradients there, if any, are stepped on)
            self.optim.step()

    def _note_units(self) -> None:
        """Every unit's instance attributes that torch's FSDP documents by use
        (``UNIT_ATTRIBUTES``): its process groups by their ranks, its options as it
        holds them. A missing attribute is observed as ``None``."""
        for name, module in self.model.named_modules():
            if self.api.is_fsdp(module):
                values = tuple((a, unit_attribute(module, a)) for a in UNIT_ATTRIBUTES)
                self._note(f"unit {name or '(root)'} attributes", values)

    def _note_default_settings(self) -> None:
        """The settings (configs included) each state-dict type gets when entered
        without configs: the configs' defaults and fields, which a program that
        passes its own configs, or draws no such type, never shows."""
        FSDP = self.api.FSDP
        for kind in STATE_DICT_TYPES:
            with catching() as caught:  # an exception is an observation, not the end
                with FSDP.state_dict_type(self.model, self.api.StateDictType[kind]):
                    settings = FSDP.get_state_dict_type(self.model)
                    self._note(f"default settings of {kind}", settings)
            if caught[0].error is not None:
                self._note(f"default settings of {kind} raised", caught[0].error)
