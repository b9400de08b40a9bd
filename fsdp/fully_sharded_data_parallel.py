"""FullyShardedDataParallel: the module wrapper."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

from fsdp import _state_dict as _osd
from fsdp._clip_grad import clip_grad_norm
from fsdp._common import (
    FLAT_PARAM,
    FSDP_PREFIX,
    HYBRID_SHARDING_STRATEGIES,
    TrainingState,
    profiler_label,
)
from fsdp._flat_param import FlatParameter, FlatParamHandle
from fsdp._ignored import Ignored
from fsdp._init import UnitArgs, build_unit, resolve_groups
from fsdp._reduce import CommHook
from fsdp._runtime import FSDPState
from fsdp._state_dict import StateDictHooks, optim_settings_with_mesh
from fsdp._streams import UnshardHandle
from fsdp._unshard_params import ensure_initialized, states_in
from fsdp._unshard_params import summon_full_params as _summon
from fsdp.api import (
    STATE_DICT_CONFIGS,
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from fsdp.wrap import _auto_wrap


class FullyShardedDataParallel(nn.Module):
    """Shards a module's parameters across ranks (see the package README).

    Construction applies ``auto_wrap_policy`` to the module's children, then
    flattens and shards the parameters that remain. The arguments mean what
    they mean for ``torch.distributed.fsdp.FullyShardedDataParallel``.
    """

    _fsdp_wrapped_module: nn.Module
    _state: FSDPState

    def __init__(
        self,
        module: nn.Module,
        process_group: Any = None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Any = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: int | torch.device | str | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Iterable[nn.Parameter] | Iterable[nn.Module] | None = None,
        device_mesh: Any = None,
    ) -> None:
        super().__init__()
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            warnings.warn(
                "FSDP will not all-gather parameters for containers that do not implement "
                f"forward: {module}",
                stacklevel=2,
            )
        ignored = Ignored.resolve(module, ignored_modules, ignored_states)
        strategy = sharding_strategy or ShardingStrategy.FULL_SHARD
        groups = resolve_groups(process_group, device_mesh, strategy, auto_wrap_policy is not None)
        args = UnitArgs(
            sharding_strategy=strategy,
            cpu_offload=cpu_offload,
            backward_prefetch=backward_prefetch,
            mixed_precision=mixed_precision,
            param_init_fn=param_init_fn,
            device_id=device_id,
            sync_module_states=sync_module_states,
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
            use_orig_params=use_orig_params,
        )
        if auto_wrap_policy is not None:
            child_kwargs = {
                **args._asdict(),
                "sharding_strategy": sharding_strategy,
                "process_group": None if device_mesh is not None else groups.as_argument(),
                "device_mesh": device_mesh,
                "ignored_states": ignored.params,
            }
            _auto_wrap(
                module, auto_wrap_policy, ignored.modules, ignored.params, child_kwargs, FSDP
            )
        self._fsdp_wrapped_module = module
        self._state = build_unit(self, module, args, ignored, groups, device_mesh)
        self._state.own_flat_param(self.module)
        StateDictHooks(self._state).register(self)

    # -- what the wrapper exposes -----------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped module; inside an activation-checkpointing wrapper, the
        module that wrapper wraps (as in torch)."""
        wrapped = self._fsdp_wrapped_module
        if isinstance(wrapped, ActivationWrapper):
            return wrapped._checkpoint_wrapped_module
        return wrapped

    @property
    def _flat_param(self) -> FlatParameter | None:
        handle = self._state.handle
        return handle.flat_param if handle is not None else None

    @property
    def _handle(self) -> FlatParamHandle | None:
        return self._state.handle

    @property
    def params(self) -> list[FlatParameter]:
        return [self._state.handle.flat_param] if self._state.handle is not None else []

    @property
    def rank(self) -> int:
        return self._state.rank

    @property
    def world_size(self) -> int:
        return self._state.world_size

    @property
    def process_group(self) -> Any:
        return self._state.process_group

    @property
    def _inter_node_pg(self) -> Any:
        """The replicate group of hybrid sharding. A unit that is not hybrid has
        none: the name is then looked up on the wrapped module (``__getattr__``), as
        for torch's, whose attribute exists on hybrid units only."""
        group = self._state.replicate_group
        if group is None:
            raise AttributeError("_inter_node_pg")
        return group

    def check_is_root(self) -> bool:
        """Whether this unit is the root of its tree (initialises the tree lazily)."""
        ensure_initialized(self)
        return bool(self._state.is_root)

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self._state.config.sharding_strategy

    @property
    def cpu_offload(self) -> CPUOffload:
        return self._state.config.cpu_offload

    @property
    def backward_prefetch(self) -> BackwardPrefetch | None:
        return self._state.config.backward_prefetch

    @property
    def forward_prefetch(self) -> bool:
        return self._state.config.forward_prefetch

    @property
    def mixed_precision(self) -> MixedPrecision:
        return self._state.config.mixed_precision

    @property
    def _use_orig_params(self) -> bool:
        return self._state.config.use_orig_params

    @property
    def limit_all_gathers(self) -> bool:
        return self._state.config.limit_all_gathers

    @property
    def _use_full_prec_in_eval(self) -> bool:
        return self._state.config.env.use_full_prec_in_eval

    @property
    def compute_device(self) -> torch.device:
        return self._state.compute_device

    @property
    def _is_root(self) -> bool | None:
        return self._state.is_root

    @property
    def _state_dict_type(self) -> StateDictType:
        return self._state.state_dict_type

    @property
    def training_state(self) -> TrainingState:
        return self._state.training_state

    @property
    def _comm_hook(self) -> CommHook | None:
        """The registered communication hook (None: FSDP's own reduction)."""
        spec = self._state.comm_hook
        return None if spec is None else spec.hook

    @_comm_hook.setter
    def _comm_hook(self, hook: CommHook | None) -> None:
        self._state.set_comm_hook(hook, self._comm_hook_state)

    @property
    def _comm_hook_state(self) -> object:
        spec = self._state.comm_hook
        return None if spec is None else spec.state

    @_comm_hook_state.setter
    def _comm_hook_state(self, state: object) -> None:
        self._state.set_comm_hook(self._comm_hook, state)

    def _assert_state(self, state: TrainingState | list[TrainingState]) -> None:
        for unit in states_in(self, recurse=True):
            unit.assert_state(state)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: int) -> Any:
        return self._fsdp_wrapped_module.__getitem__(key)  # type: ignore[operator]

    # -- module methods that touch parameters -------------------------------------------------

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """``nn.Module.apply`` with this unit's full parameters gathered (and
        written back to the shards afterwards); nested units gather their own
        as ``apply`` reaches them. Not allowed inside ``summon_full_params``."""
        uninitialized = self._state.is_root is None
        self._assert_state(TrainingState.IDLE)
        with _summon(self, recurse=False, writeback=True):
            super().apply(fn)
        if uninitialized and self._state.is_root:
            self._state.reset_lazy_init()  # this unit may not be the real root
        return self

    # -- forward -------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state = self._state
        with profiler_label("FullyShardedDataParallel.forward"):
            args, kwargs = state.root_pre_forward(args, kwargs)
            args, kwargs = state.pre_forward(args, kwargs)
            output = self._fsdp_wrapped_module(*args, **kwargs)
            return state.post_forward(output)

    # -- names ---------------------------------------------------------------------------------

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """Inside summon_full_params the names are the unwrapped module's."""
        clean = self._state.training_state is TrainingState.SUMMON_FULL_PARAMS
        for name, param in super().named_parameters(*args, **kwargs):
            yield (name.replace(FSDP_PREFIX, "") if clean else name), param

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, Tensor]]:
        clean = self._state.training_state is TrainingState.SUMMON_FULL_PARAMS
        for name, buffer in super().named_buffers(*args, **kwargs):
            yield (name.replace(FSDP_PREFIX, "") if clean else name), buffer

    # -- moving and casting ---------------------------------------------------------------------

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:  # type: ignore[override]
        """``.to()`` / ``.cuda()`` / ``.half()`` reach the flat parameter; with
        ``use_orig_params`` the original parameters (views) are rebuilt after."""
        handle = self._state.handle
        if handle is None:
            return super()._apply(fn, recurse)
        use_orig = self._state.config.use_orig_params
        if use_orig:
            handle.views.release()
            self._parameters[FLAT_PARAM] = handle.flat_param
        try:
            return super()._apply(fn, recurse)
        finally:
            if use_orig:
                self._parameters.pop(FLAT_PARAM, None)
            handle.rebind_local_shard()

    # -- static API --------------------------------------------------------------------------------

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """The FSDP wrappers in ``module`` (itself included), outermost first.
        ``root_only``: those that are roots, each initialised lazily first (as in
        torch, a wrapper initialised before its enclosing unit is a root until
        that unit runs; one below an initialised root is not)."""
        wrappers = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        if not root_only:
            return wrappers
        roots = []
        for wrapper in wrappers:
            wrapper._state.lazy_init()
            if wrapper._state.is_root:
                roots.append(wrapper)
        return roots

    @staticmethod
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> contextlib.AbstractContextManager[None]:
        """Exposes the full, original parameters of ``module``'s units (see
        ``fsdp._unshard_params``)."""
        return _summon(module, recurse, writeback, rank0_only, offload_to_cpu, with_grads)

    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> StateDictSettings:
        """Sets the state-dict type and configs of every unit under ``module``
        (which need not be a unit itself); returns the previous settings (see
        ``_previous_settings``)."""
        config_type, optim_config_type = STATE_DICT_CONFIGS[state_dict_type]
        config = state_dict_config or config_type()
        optim_config = optim_state_dict_config or optim_config_type()
        if type(config) is not config_type:
            raise RuntimeError(
                f"Expected state_dict_config of type {config_type} but got {type(config)}"
            )
        if type(optim_config) is not optim_config_type:
            raise RuntimeError(
                f"Expected optim_state_dict_config of type {optim_config_type} "
                f"but got {type(optim_config)}"
            )
        states = states_in(module, recurse=True)
        previous = _previous_settings(states)
        settings = StateDictSettings(state_dict_type, config, optim_config)
        for state in states:
            state.set_state_dict_settings(settings)
        return previous

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings | None:
        """The settings of the units under ``module`` (all units share them; None
        when there is no unit, as in torch); see [Note: _use_dtensor follows the
        device mesh] for units with a mesh."""
        states = states_in(module, recurse=True)
        if not states:
            return None
        return optim_settings_with_mesh(states, _shared_settings(states))

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> Iterator[None]:
        """``set_state_dict_type`` for the duration of the context."""
        previous = FullyShardedDataParallel.set_state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        )
        try:
            yield
        finally:
            FullyShardedDataParallel.set_state_dict_type(
                module,
                previous.state_dict_type,
                previous.state_dict_config,
                previous.optim_state_dict_config,
            )

    # -- optimizer state dicts (see fsdp._state_dict) -------------------------------------------

    @staticmethod
    def optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any] | None = None,
        group: Any = None,
    ) -> dict[str, Any]:
        """The state of ``optim`` (``model``'s optimizer; ``optim_state_dict``, if
        given, in place of ``optim.state_dict()``) keyed by parameter names, in the
        form the units' state-dict settings ask for: ``FULL_STATE_DICT`` gives full
        tensors (CPU unless the optimizer config says ``offload_to_cpu=False``; only
        rank 0 gets them under ``rank0_only``), other types give rows of each tensor
        sharded over the unit's group. Call it on every rank of ``group``."""
        settings = FullyShardedDataParallel.get_state_dict_type(model)
        config = settings.optim_state_dict_config
        full = settings.state_dict_type is StateDictType.FULL_STATE_DICT
        form = _osd.SaveForm(shard=not full, offload=getattr(config, "offload_to_cpu", True))
        return _osd.optim_state_dict(
            model,
            optim.state_dict() if optim_state_dict is None else optim_state_dict,
            _osd.KeySource.of(optim, None),
            getattr(config, "rank0_only", False),
            form,
            group,
        )

    @staticmethod
    def optim_state_dict_to_load(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any],
        is_named_optimizer: bool = False,
        load_directly: bool = False,
        group: Any = None,
    ) -> dict[str, Any]:
        """Converts a dict from ``optim_state_dict`` (of any wrapping and world size,
        in the form the units' settings ask for) into what ``optim`` (``model``'s
        optimizer) loads; under a ``rank0_only`` full config only rank 0's dict is
        read. ``is_named_optimizer``: ``optim`` keys its state by names
        (``_NamedOptimizer``, TorchRec's ``KeyedOptimizer``). ``load_directly`` also
        loads the result into ``optim``."""
        settings = FullyShardedDataParallel.get_state_dict_type(model)
        result = _osd.optim_state_dict_to_load(
            model,
            optim_state_dict,
            _osd.KeySource.of(optim, None),
            getattr(settings.optim_state_dict_config, "rank0_only", False),
            is_named_optimizer,
            group,
        )
        if load_directly:
            optim.load_state_dict(result)
        return result

    @staticmethod
    def full_optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_input: list[dict[str, Any]] | Iterable[nn.Parameter] | None = None,
        rank0_only: bool = True,
        group: Any = None,
    ) -> dict[str, Any]:
        """Deprecated (``optim_state_dict``): the full optimizer state dict, on CPU,
        keyed by parameter names; {} on ranks other than 0 under ``rank0_only``.
        ``optim_input`` (deprecated) is what ``optim`` was built from."""
        _osd.warn_legacy("full_optim_state_dict", "optim_state_dict")
        _osd.warn_optim_input(optim_input)
        return _osd.optim_state_dict(
            model,
            optim.state_dict(),
            _osd.KeySource.of(optim, optim_input),
            rank0_only,
            _osd.SaveForm(shard=False, offload=True),
            group,
        )

    @staticmethod
    def sharded_optim_state_dict(
        model: nn.Module, optim: torch.optim.Optimizer, group: Any = None
    ) -> dict[str, Any]:
        """Deprecated (``optim_state_dict``): the sharded optimizer state dict,
        each tensor state of a unit's parameter a ``ShardedTensor`` of its rows."""
        _osd.warn_legacy("sharded_optim_state_dict", "optim_state_dict")
        form = _osd.SaveForm(shard=True, offload=True)
        return _osd.optim_state_dict(
            model, optim.state_dict(), _osd.KeySource.of(optim, None), False, form, group
        )

    @staticmethod
    def shard_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any],
        model: nn.Module,
        optim_input: list[dict[str, Any]] | Iterable[nn.Parameter] | None = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """Deprecated (``optim_state_dict_to_load``): this rank's local form of a full
        dict every rank has, for ``optim`` (or an optimizer built from
        ``optim_input``; neither: from ``model.parameters()``). No communication."""
        _osd.warn_legacy("shard_full_optim_state_dict", "optim_state_dict_to_load")
        _osd.warn_optim_input(optim_input)
        source = _osd.KeySource.of(optim, optim_input)
        return _osd.optim_state_dict_to_load(
            model, full_optim_state_dict, source, False, False, None
        )

    @staticmethod
    def flatten_sharded_optim_state_dict(
        sharded_optim_state_dict: dict[str, Any],
        model: nn.Module,
        optim: torch.optim.Optimizer,
    ) -> dict[str, Any]:
        """Deprecated (``optim_state_dict_to_load``): the local form of a sharded dict
        (its rows are all-gathered over each unit's group)."""
        _osd.warn_legacy("flatten_sharded_optim_state_dict", "optim_state_dict_to_load")
        source = _osd.KeySource.of(optim, None)
        return _osd.optim_state_dict_to_load(
            model, sharded_optim_state_dict, source, False, False, None
        )

    @staticmethod
    def scatter_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any] | None,
        model: nn.Module,
        optim_input: list[dict[str, Any]] | Iterable[nn.Parameter] | None = None,
        optim: torch.optim.Optimizer | None = None,
        group: Any | None = None,
    ) -> dict[str, Any]:
        """Deprecated (``optim_state_dict_to_load``): like
        ``shard_full_optim_state_dict``, but only rank 0 of ``group`` has the full
        dict (other ranks' argument is ignored) and sends it to the others."""
        _osd.warn_legacy("scatter_full_optim_state_dict", "optim_state_dict_to_load")
        _osd.warn_optim_input(optim_input)
        source = _osd.KeySource.of(optim, optim_input)
        return _osd.optim_state_dict_to_load(
            model, full_optim_state_dict or {}, source, True, False, group
        )

    @staticmethod
    def rekey_optim_state_dict(
        optim_state_dict: dict[str, Any],
        optim_state_key_type: OptimStateKeyType,
        model: nn.Module,
        optim_input: list[dict[str, Any]] | Iterable[nn.Parameter] | None = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """Re-keys an optimizer state dict of ``model`` (which has no flat
        parameters) by parameter names (``PARAM_NAME``) or by the IDs of ``optim``
        (or of an optimizer built from ``optim_input``; neither:
        ``model.parameters()``), so that full dicts of FSDP models and plain
        optimizer state dicts convert into each other."""
        _osd.warn_optim_input(optim_input)
        source = _osd.KeySource.of(optim, optim_input)
        return _osd.rekey_optim_state_dict(optim_state_dict, optim_state_key_type, model, source)

    # -- training helpers ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate locally (unreduced, unsharded) inside; the first
        backward outside reduces the sum."""
        ensure_initialized(self)
        if not self._state.is_root:
            raise RuntimeError(
                "`no_sync()` on inner FSDP instances is not supported. Please call `no_sync()` "
                "on root FSDP module."
            )
        states = states_in(self, recurse=True)
        previous = [s.sync_gradients for s in states]
        for state in states:
            state.set_sync_gradients(False)
        try:
            yield
        finally:
            for state, sync in zip(states, previous):
                state.set_sync_gradients(sync)

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Registers ``hook`` to reduce gradients instead of FSDP, in every unit of
        this root's tree; ``state`` is passed to each call. Sharded strategies call
        ``hook(state, grad, output)`` with the padded unsharded gradient and an
        empty shard to fill; ``NO_SHARD`` calls ``hook(state, grad)``, which
        reduces ``grad`` in place (see [Note: Communication hooks] in
        fsdp._reduce). Only on the root, before the first forward, and once;
        not for hybrid strategies."""
        if not self.check_is_root():
            raise AssertionError("register_comm_hook can only be called on a root instance.")
        units = states_in(self, recurse=True)
        for unit in units:
            strategy = unit.config.sharding_strategy
            if strategy in HYBRID_SHARDING_STRATEGIES:
                raise AssertionError(
                    f"Communication hook is not supported for hybrid strategies: {strategy}"
                )
            if unit.comm_hook is not None:
                raise AssertionError("A communication hook is already registered")
        if not callable(hook):
            raise ValueError(f"The communication hook must be callable but got {hook}")
        for unit in units:
            unit.set_comm_hook(hook, state)

    def _unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Starts this unit's all-gather ahead of its forward, which then finds the
        parameters ready (torch's private API). With ``async_op`` returns a handle
        whose ``wait()`` makes the current stream wait for it; otherwise waits."""
        state = self._state
        unshard = UnshardHandle(state.root.streams, state.unshard_ahead())
        if async_op:
            return unshard
        unshard.wait()
        return None

    def _wait_unshard_streams_on_current_stream(self) -> None:
        """The current stream waits for every all-gather issued so far."""
        self._state.root.streams.compute_waits_for_unshard()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clips the gradients of every parameter in this root's tree by their
        total norm over all ranks; returns that norm (the same on every rank).
        See [Note: The total norm of sharded and replicated gradients]."""
        ensure_initialized(self)
        if not self._state.is_root:
            raise RuntimeError(
                "`clip_grad_norm_()` should only be called on the root FSDP instance"
            )
        self._assert_state(TrainingState.IDLE)
        states = states_in(self, recurse=True)
        return clip_grad_norm(self, self._state, states, float(max_norm), float(norm_type))


def _previous_settings(states: list[FSDPState]) -> StateDictSettings:
    """The first unit's settings, once every unit is checked to have the same
    type and the same kinds of configs (torch's checks and messages; the config
    values may differ). All None without units."""
    if not states:
        return StateDictSettings(None, None, None)
    first = states[0].state_dict_settings
    for state in states[1:]:
        settings = state.state_dict_settings
        if settings.state_dict_type != first.state_dict_type:
            raise AssertionError("All FSDP modules should have the same state_dict_type.")
        if not isinstance(settings.state_dict_config, type(first.state_dict_config)):
            raise AssertionError("All FSDP modules must have the same type of state_dict_config.")
        if not isinstance(settings.optim_state_dict_config, type(first.optim_state_dict_config)):
            raise AssertionError(
                "All FSDP modules must have the same type of optim_state_dict_config."
            )
    return first


FSDP = FullyShardedDataParallel


def _shared_settings(states: list[FSDPState]) -> StateDictSettings:
    """The state-dict settings every unit of ``states`` has."""
    settings = states[0].state_dict_settings
    for state in states[1:]:
        if state.state_dict_settings != settings:
            raise AssertionError(
                "All FSDP modules must have the same state dict settings."
                f"Got {state.state_dict_settings} and {settings}."
            )
    return settings
