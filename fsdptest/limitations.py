"""What torch's FSDP cannot do on a CPU-only run, for suites that assert it
(so that a fix in torch shows up) instead of skipping.

[Note: Torch's FSDP on a CPU-only run]
- ``CPUOffload(offload_params=True)``: torch's FSDP builds the unit, then fails
  when first used (its lazy initialisation pins the shard's memory, which needs
  an accelerator). The plugin skips such parametrizations under ``--fsdp-impl
  torch``, except in tests marked ``torch_cpu_offload_asserted``, which call
  ``fsdptest.api.assert_torch_refuses_cpu_offload`` where
  ``torch_refuses_cpu_offload`` says so.
- ``FULL_STATE_DICT`` with ``offload_to_cpu=True`` (2.13):
  ``FlatParamHandle.to_cpu()`` "moves" the unsharded flat parameter to the CPU
  it is already on (the same storage), then frees that storage. With
  ``use_orig_params=False`` unflattening the original parameters then fails
  (``TORCH_OFFLOAD_TO_CPU_ERROR``); with ``use_orig_params=True`` the original
  parameters are views of the freed storage and cloning them reads freed memory
  (garbage, or a segmentation fault). ``assert_cannot_offload_full_state_dict``
  asserts the deterministic failure, on a one-unit model with
  ``use_orig_params=False`` under ``rank0_only``: rank 0 fails after the
  all-gather, the other ranks return an empty dict. Ours copies
  (``fsdp._storage``).
- On accelerator ranks (the other way round): ``LOCAL_STATE_DICT`` with
  ``LocalStateDictConfig(offload_to_cpu=True)`` raises
  (``TORCH_LOCAL_OFFLOAD_ERROR``): the save hook calls ``ShardedTensor.cpu()``
  under ``no_grad``, whose copies of the local shards do not require grad while
  the metadata, taken from the flat parameter, says they do.
  ``torch_local_offload_fails`` says where; ``assert_cannot_offload_local_state_dict``
  asserts it.
- ``sync_module_states=True`` refuses CPU parameters and buffers
  (``TORCH_SYNC_MODULE_STATES_ERROR``), whatever ``device_id`` says.
"""

from __future__ import annotations

from torch import nn

from fsdptest.api import (
    ADAPTER,
    FSDP,
    FullStateDictConfig,
    LocalStateDictConfig,
    StateDictType,
)
from harness import current_device
from harness.assertions import Assertions

TORCH_OFFLOAD_TO_CPU_ERROR = "out of bounds for storage of size 0"
TORCH_SYNC_MODULE_STATES_ERROR = (
    "The module has CPU parameters or buffers when `sync_module_states=True`"
)


TORCH_LOCAL_OFFLOAD_ERROR = "Local shards' tensor requires_grad property is incompatible"


def torch_local_offload_fails() -> bool:
    """Whether a LOCAL_STATE_DICT with offload_to_cpu=True fails here (torch's FSDP
    on accelerator ranks)."""
    defect = ADAPTER.known_defects.local_state_dict_offload_on_accelerator
    return defect and current_device().type != "cpu"


def assert_cannot_offload_local_state_dict(case: Assertions, model: nn.Module) -> None:
    """``model``'s LOCAL_STATE_DICT with offload_to_cpu=True raises torch's error."""
    config = LocalStateDictConfig(offload_to_cpu=True)
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT, config):
        with case.assertRaisesRegex(ValueError, TORCH_LOCAL_OFFLOAD_ERROR):
            model.state_dict()


def torch_on_cpu() -> bool:
    """Whether torch's FSDP is under test on CPU ranks."""
    return ADAPTER.limitations.on_cpu


def assert_cannot_offload_full_state_dict(case: Assertions, rank: int) -> None:
    model = FSDP(nn.Linear(10, 10, bias=False).to(current_device()))
    config = FullStateDictConfig(rank0_only=True, offload_to_cpu=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        if rank == 0:
            with case.assertRaisesRegex(RuntimeError, TORCH_OFFLOAD_TO_CPU_ERROR):
                model.state_dict()
        else:
            case.assertEqual(model.state_dict(), {})


def assert_cannot_sync_module_states(case: Assertions) -> None:
    module = nn.Linear(2, 2).to(current_device())
    with case.assertRaisesRegex(ValueError, TORCH_SYNC_MODULE_STATES_ERROR):
        FSDP(module, sync_module_states=True, device_id=current_device())
