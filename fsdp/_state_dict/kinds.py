"""What a unit's state-dict hooks do for each state-dict type: save and load
full, sharded and local state dicts.

[Note: The three state-dict types]
- ``FULL_STATE_DICT``: save unshards the unit (summon, full precision) and
  clones each original parameter, since the unsharded storage is freed right
  after. ``rank0_only``: other ranks take part in the all-gather, then drop the
  unit's parameters and buffers. ``offload_to_cpu``: CPU tensors. Load
  unshards, lets the module copy into the exposed parameters, then writes each
  rank's part back into its shard.
- ``SHARDED_STATE_DICT``: like full, but each parameter is a ``ShardedTensor``
  chunked on dim 0 over the unit's sharding group, or with ``_use_dtensor`` (set
  whenever the unit has a device mesh) a ``DTensor`` on the unit's mesh (see
  [Note: Rows chunked as torch.chunk] in fsdp._shard_utils; a unit composed with
  tensor parallelism saves DTensors of the mesh its mesh was sliced from, see
  [Note: Tensor-parallel parameters] in fsdp._dtensor_extensions). Load gathers
  each parameter (see [Note: Gathering chunked rows]), every rank in the same
  (flat) order, then loads it as full. A value of any kind, wrapping, world size
  or mesh loads (torch's FSDP loads only the kind and mesh it saves, asserted in
  ``suites/test_fsdp_dtensor_state_dict.py``). A 0-dim parameter cannot be
  chunked and stays a plain tensor; any other plain tensor is refused with
  torch's ``AssertionError`` (unless ``DTensor`` s are saved).
- ``LOCAL_STATE_DICT``: the unit's flat shard under ``_flat_param``, as a
  ``ShardedTensor`` over the *unpadded* flat parameter (a view, no copy; a rank
  that holds only padding has no local shard), so it survives ``torch.save``
  and a gather plus re-chunk loads it into another world size. Load takes only
  a ``ShardedTensor`` and pads the local shard back. Everything else is what
  the module saves and loads itself, as in torch: buffers as they live (in
  ``buffer_dtype`` under buffer mixed precision, on the device), and under
  ``use_orig_params`` the original parameters, which then are views of their
  parts of the shard (loaded again through those views, with the same values).
  The flat shard is loaded by the pre-load hook, which removes its key, with or
  without ``use_orig_params``: torch's FSDP leaves the key in place when the
  flat parameter is not registered (``use_orig_params=True``), so its own local
  state dicts then fail a strict load with ``Unexpected key(s) ...
  "_flat_param"`` (asserted in ``suites/test_state_dict_options.py`` and
  ``suites/test_property_findings.py``). Unlike torch's, the local shard does
  not require grad (torch's is a view of the flat parameter created under
  ``no_grad``, which a gloo gather in grad mode refuses).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

from fsdp._common import FLAT_PARAM
from fsdp._runtime import FSDPState
from fsdp._shard_utils import chunk_dtensor, chunk_sharded_tensor
from fsdp._state_dict.keys import (
    UnitKeys,
    check_saved,
    drop_unit_entries,
    insert_wrapper_prefix,
    save_buffers,
    strip_wrapper_prefix,
)
from fsdp._state_dict.settings import Settings
from fsdp._state_dict.values import (
    extension_of,
    flat_shard,
    gathered_param,
    local_shard_to_load,
    saves_dtensors,
    unit_mesh,
)
from fsdp._unshard_params import SummonedUnit, validate_unshard
from fsdp.api import ShardedStateDictConfig, StateDictConfig, StateDictType


class Kind:
    """What the hooks of one state-dict type do; a pre-hook may return the unit
    it summoned, which its post-hook receives."""

    def pre_save(self, state: FSDPState, settings: Settings) -> SummonedUnit | None:
        return None

    def post_save(
        self,
        state: FSDPState,
        unit: SummonedUnit | None,
        settings: Settings,
        state_dict: dict[str, Any],
        prefix: str,
    ) -> None:
        raise NotImplementedError

    def pre_load(
        self, state: FSDPState, state_dict: dict[str, Any], prefix: str
    ) -> SummonedUnit | None:
        raise NotImplementedError

    def post_load(self, unit: SummonedUnit | None) -> None:
        pass


class _FullStateDict(Kind):
    """Save and load through the exposed full parameters (one unit at a time)."""

    def summoned(self, state: FSDPState, settings: Settings) -> SummonedUnit:
        return SummonedUnit(state, settings.rank0_only, settings.config.offload_to_cpu)

    def save_param(self, value: Tensor, state: FSDPState, config: StateDictConfig) -> Tensor:
        return value.detach().clone()

    def pre_save(self, state: FSDPState, settings: Settings) -> SummonedUnit | None:
        unit = self.summoned(state, settings)
        validate_unshard(state, False, unit.rank0_only, unit.offload_to_cpu, False)
        unit.enter()
        return unit

    def post_save(
        self,
        state: FSDPState,
        unit: SummonedUnit | None,
        settings: Settings,
        state_dict: dict[str, Any],
        prefix: str,
    ) -> None:
        assert unit is not None
        strip_wrapper_prefix(state_dict, prefix)
        keys = UnitKeys(state, prefix)
        try:
            if settings.rank0_only and state.rank != 0:
                drop_unit_entries(keys, state_dict, prefix)
                return
            for key, info in zip(keys.params, keys.param_names):
                check_saved(key, info, prefix, state_dict, state)
                state_dict[key] = self.save_param(state_dict[key], state, settings.config)
            state_dict.pop(prefix + FLAT_PARAM, None)
        finally:
            unit.exit(writeback=False)
        save_buffers(state, keys, state_dict, settings.config.offload_to_cpu)

    def pre_load(
        self, state: FSDPState, state_dict: dict[str, Any], prefix: str
    ) -> SummonedUnit | None:
        unit = SummonedUnit(state)
        unit.enter()
        insert_wrapper_prefix(state, state_dict, prefix)
        return unit

    def post_load(self, unit: SummonedUnit | None) -> None:
        assert unit is not None
        unit.exit(writeback=True)


class _ShardedStateDict(_FullStateDict):
    def summoned(self, state: FSDPState, settings: Settings) -> SummonedUnit:
        return SummonedUnit(state)  # chunked first, offloaded after

    def save_param(self, value: Tensor, state: FSDPState, config: StateDictConfig) -> Tensor:
        assert isinstance(config, ShardedStateDictConfig)
        value = value.detach()
        offload = config.offload_to_cpu
        if value.dim() == 0:
            return value.to("cpu", copy=True) if offload else value.clone()
        extension = extension_of(state)
        if extension is not None:
            return extension.chunk(value, offload)
        if config._use_dtensor or state.device_mesh is not None:
            return chunk_dtensor(value, unit_mesh(state), offload)
        sharded = chunk_sharded_tensor(value, state.rank, state.world_size, state.process_group)
        return sharded.cpu() if offload else sharded

    def pre_load(
        self, state: FSDPState, state_dict: dict[str, Any], prefix: str
    ) -> SummonedUnit | None:
        # Every rank gathers the same parameters in the same (flat) order.
        keys = UnitKeys(state, prefix)
        for key, index in zip(keys.params, keys.param_indices):
            value = state_dict.get(key)
            if isinstance(value, (ShardedTensor, DTensor)):
                state_dict[key] = gathered_param(value, state, index)
            elif isinstance(value, Tensor) and value.dim() > 0:
                raise _plain_tensor_error(state, key, value)
        return super().pre_load(state, state_dict, prefix)


def _plain_tensor_error(state: FSDPState, key: str, value: Tensor) -> AssertionError:
    """A SHARDED_STATE_DICT load handed a plain tensor (a state dict saved under
    another type, say). Torch's text for units that save ShardedTensors; for
    units that save DTensors torch fails inside its gather (``AttributeError:
    'Tensor' object has no attribute 'device_mesh'``), so ours names the key."""
    if not saves_dtensors(state):
        return AssertionError(f"Expected ShardedTensor, got {type(value)}")
    return AssertionError(
        f"Expected DTensor, got {type(value)} for {key!r}: a SHARDED_STATE_DICT of a "
        "unit with a device mesh holds DTensors (was the state dict saved under another "
        "StateDictType?)"
    )


class _LocalStateDict(Kind):
    def pre_save(self, state: FSDPState, settings: Settings) -> SummonedUnit | None:
        """The saved shard holds the user's changes of original parameters
        (``p.data = ...``), as a summon's writeback would (torch's FSDP saves the
        shard as it was: ``KnownDefects.local_state_dict_skips_writeback``)."""
        if state.handle is not None:
            state.handle.writeback_before_save()
        return None

    def post_save(
        self,
        state: FSDPState,
        unit: SummonedUnit | None,
        settings: Settings,
        state_dict: dict[str, Any],
        prefix: str,
    ) -> None:
        strip_wrapper_prefix(state_dict, prefix)
        if state.handle is not None:
            value = flat_shard(state)
            state_dict[prefix + FLAT_PARAM] = (
                value.cpu() if settings.config.offload_to_cpu else value
            )

    def pre_load(
        self, state: FSDPState, state_dict: dict[str, Any], prefix: str
    ) -> SummonedUnit | None:
        handle = state.handle
        key = prefix + FLAT_PARAM
        if handle is not None:
            if key not in state_dict:
                raise AssertionError(
                    "No `FlatParameter` in `state_dict` for this FSDP instance but it has "
                    "parameters"
                )
            if not isinstance(state_dict[key], ShardedTensor):
                raise AssertionError("Tensors in local_state_dict should be ShardedTensor.")
            handle.load_local_shard(local_shard_to_load(state_dict[key], state))
            del state_dict[key]
        insert_wrapper_prefix(state, state_dict, prefix)
        return None


KINDS: dict[StateDictType, Kind] = {
    StateDictType.FULL_STATE_DICT: _FullStateDict(),
    StateDictType.SHARDED_STATE_DICT: _ShardedStateDict(),
    StateDictType.LOCAL_STATE_DICT: _LocalStateDict(),
}
