"""FullyShardedDataParallel: the module wrapper."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.profiler import record_function

from fsdp._clip_grad import clip_grad_norm
from fsdp._common import FLAT_PARAM, FSDP_PREFIX, TrainingState
from fsdp._flat_param import FlatParameter, FlatParamHandle
from fsdp._init import Ignored, UnitArgs, build_unit
from fsdp._runtime import FSDPState
from fsdp._state_dict import StateDictHooks
from fsdp._unshard_params import ensure_initialized, states_in
from fsdp._unshard_params import summon_full_params as _summon
from fsdp.api import (
    BackwardPrefetch,
    CPUOffload,
    FullStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictType,
)
from fsdp.wrap import _auto_wrap

_DEFAULT_CONFIGS: dict[StateDictType, StateDictConfig] = {
    StateDictType.FULL_STATE_DICT: FullStateDictConfig(),
    StateDictType.SHARDED_STATE_DICT: ShardedStateDictConfig(),
    StateDictType.LOCAL_STATE_DICT: LocalStateDictConfig(),
}


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
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
    ) -> None:
        super().__init__()
        args = UnitArgs(
            process_group,
            sharding_strategy,
            cpu_offload,
            backward_prefetch,
            mixed_precision,
            ignored_modules,
            param_init_fn,
            device_id,
            sync_module_states,
            forward_prefetch,
            limit_all_gathers,
            use_orig_params,
        )
        ignored = Ignored.resolve(module, ignored_modules)
        if auto_wrap_policy is not None:
            root_kwargs = {**args._asdict(), "ignored_modules": ignored.modules}
            _auto_wrap(
                module,
                auto_wrap_policy,
                set(ignored.modules),
                set(ignored.params),
                root_kwargs,
                type(self),
            )
        self._fsdp_wrapped_module = module
        self._state = build_unit(self, module, args, ignored)
        self._state.show_flat_param()
        StateDictHooks(self._state).register(self)

    # -- what the wrapper exposes -----------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

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
    def _is_root(self) -> bool | None:
        return self._state.is_root

    @property
    def training_state(self) -> TrainingState:
        return self._state.training_state

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
        with record_function("FullyShardedDataParallel.forward"):
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
            handle.deregister_orig_params()
            self._parameters[FLAT_PARAM] = handle.flat_param
        try:
            return super()._apply(fn, recurse)
        finally:
            if use_orig:
                self._parameters.pop(FLAT_PARAM, None)
            handle.rebind_local_shard()
            if use_orig:
                handle.register_orig_params()

    # -- static API --------------------------------------------------------------------------------

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """The FSDP wrappers in ``module`` (itself included), outermost first."""
        wrappers = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        if not root_only:
            return wrappers
        inner = {id(m) for w in wrappers for m in w.modules() if m is not w}
        return [w for w in wrappers if id(w) not in inner]

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
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: object | None = None,
    ) -> Iterator[None]:
        """Sets the state-dict type (and config) of every unit in ``module`` for a while."""
        config = state_dict_config or _DEFAULT_CONFIGS[state_dict_type]
        states = states_in(module, recurse=True)
        previous = [(s.state_dict_type, s.state_dict_config) for s in states]
        for state in states:
            state.state_dict_type, state.state_dict_config = state_dict_type, config
        try:
            yield
        finally:
            for state, (kind, cfg) in zip(states, previous):
                state.state_dict_type, state.state_dict_config = kind, cfg

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
            state.sync_gradients = False
        try:
            yield
        finally:
            for state, sync in zip(states, previous):
                state.sync_gradients = sync

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
