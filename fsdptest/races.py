"""Races of torch's FSDP on accelerators: checks that skip where torch's numbers
depend on the GPU's pace.

[Note: Skipping what torch races on]
A defect that shows every time is asserted (``fsdptest.limitations``); a race
cannot be: the same check passes with a GPU to itself and fails on a GPU shared
by two tests (``--gpu-slots 2``, docs/runs/gpu-runs.md runs 58–60). Each check that
such a race reaches skips under torch's FSDP on accelerator ranks, visibly, the
reason naming the defect:

- ``KnownDefects.no_shard_offload_race_on_accelerator``: NO_SHARD units with
  parameter offload and ``use_orig_params=True`` (pytorch/pytorch#118245).
  ``skip_torch_offload_race`` takes the strategies a test asks for;
  ``skip_torch_offload_race_in`` the units as built (torch makes a unit of a
  one-rank group NO_SHARD, an expert's in a mixture of experts, say).
- ``KnownDefects.scaler_races_on_cpu_gradients``: ``ShardedGradScaler`` with CPU
  gradients (``skip_torch_scaler_race``).

The module reads the implementation's public names only when a check runs (by
name, not by import), so suites that never reach one run against an
implementation that lacks those names.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from fsdptest import api
from harness import current_device
from harness.assertions import Assertions

TORCH_OFFLOAD_RACE = (
    "torch's FSDP races on NO_SHARD units with parameter offload and use_orig_params=True "
    "on accelerators (pytorch/pytorch#118245): their numbers depend on the GPU's pace"
)
TORCH_SCALER_RACE = (
    "torch's ShardedGradScaler copies its found-inf flag to the CPU without waiting for "
    "the copy on accelerators: a found inf in a CPU gradient can be lost"
)


def _on_accelerator() -> bool:
    return current_device().type != "cpu"


def skip_torch_offload_race(
    case: Assertions, strategies: Iterable[Any], cpu_offload: Any, use_orig_params: bool
) -> None:
    """Skips a numeric check of units with ``strategies`` (ShardingStrategy members
    or None) that torch's FSDP races on here (see the note)."""
    if not (api.ADAPTER.known_defects.no_shard_offload_race_on_accelerator and use_orig_params):
        return
    offloads = cpu_offload is not None and cpu_offload.offload_params
    no_shard = any(getattr(s, "name", None) == "NO_SHARD" for s in strategies)
    if offloads and no_shard and _on_accelerator():
        case.skipTest(TORCH_OFFLOAD_RACE)


def skip_torch_offload_race_in(
    case: Assertions, model: nn.Module, cpu_offload: Any, use_orig_params: bool
) -> None:
    """``skip_torch_offload_race`` for the units of ``model`` as built."""
    if not api.ADAPTER.known_defects.no_shard_offload_race_on_accelerator:
        return
    strategies = [getattr(m, "sharding_strategy", None) for m in api.FSDP.fsdp_modules(model)]
    skip_torch_offload_race(case, strategies, cpu_offload, use_orig_params)


def skip_torch_scaler_race(case: Assertions) -> None:
    """Skips a check of found-infs in CPU gradients where torch's scaler races on
    them (accelerator ranks)."""
    if api.ADAPTER.known_defects.scaler_races_on_cpu_gradients and _on_accelerator():
        case.skipTest(TORCH_SCALER_RACE)
