"""The skips of torch races in ``fsdptest.races``: which configurations a suite's
numeric check skips, where, and under which implementation (without GPUs: the
device and the adapter are stood in for)."""

from __future__ import annotations

import unittest
from types import SimpleNamespace

import pytest
import torch

from fsdptest import races
from fsdptest.adapters import KnownDefects
from fsdptest.api import CPUOffload, ShardingStrategy
from harness.assertions import Assertions

NO_SHARD, FULL_SHARD = ShardingStrategy.NO_SHARD, ShardingStrategy.FULL_SHARD


def _skips(monkeypatch, *, torch_defects: bool, device: str, **config) -> bool:
    defects = KnownDefects.all_present() if torch_defects else KnownDefects()
    monkeypatch.setattr(races.api, "ADAPTER", SimpleNamespace(known_defects=defects))
    monkeypatch.setattr(races, "current_device", lambda: torch.device(device))
    try:
        races.skip_torch_offload_race(Assertions(), **config)
    except unittest.SkipTest as skip:
        assert "pytorch/pytorch#118245" in str(skip)
        return True
    return False


RACY = {"strategies": [NO_SHARD], "cpu_offload": CPUOffload(True), "use_orig_params": True}


@pytest.mark.parametrize(
    "change",
    [
        {"strategies": [FULL_SHARD]},
        {"strategies": [None]},
        {"cpu_offload": CPUOffload(False)},
        {"cpu_offload": None},
        {"use_orig_params": False},
    ],
)
def test_only_no_shard_with_offload_and_orig_params_skips(monkeypatch, change):
    assert _skips(monkeypatch, torch_defects=True, device="cuda", **RACY)
    assert not _skips(monkeypatch, torch_defects=True, device="cuda", **(RACY | change))


def test_a_no_shard_unit_among_others_skips(monkeypatch):
    config = RACY | {"strategies": [NO_SHARD, FULL_SHARD]}  # inner NO_SHARD, root FULL_SHARD
    assert _skips(monkeypatch, torch_defects=True, device="cuda", **config)


def test_cpu_ranks_and_this_projects_fsdp_never_skip(monkeypatch):
    assert not _skips(monkeypatch, torch_defects=True, device="cpu", **RACY)
    assert not _skips(monkeypatch, torch_defects=False, device="cuda", **RACY)


def test_units_of_a_one_rank_group_count_as_no_shard(monkeypatch):
    """The built model decides: torch makes a unit of a one-rank group NO_SHARD."""
    units = [SimpleNamespace(sharding_strategy=FULL_SHARD)]
    monkeypatch.setattr(races.api, "FSDP", SimpleNamespace(fsdp_modules=lambda model: units))
    monkeypatch.setattr(
        races.api, "ADAPTER", SimpleNamespace(known_defects=KnownDefects.all_present())
    )
    monkeypatch.setattr(races, "current_device", lambda: torch.device("cuda"))
    config = (CPUOffload(True), True)
    races.skip_torch_offload_race_in(Assertions(), object(), *config)  # no skip
    units.append(SimpleNamespace(sharding_strategy=NO_SHARD))  # an expert's unit
    with pytest.raises(unittest.SkipTest, match="118245"):
        races.skip_torch_offload_race_in(Assertions(), object(), *config)


@pytest.mark.parametrize(
    ("torch_defects", "device", "skips"),
    [(True, "cuda", True), (True, "cpu", False), (False, "cuda", False)],
)
def test_the_scaler_race_skips_only_torch_on_accelerators(
    monkeypatch, torch_defects, device, skips
):
    defects = KnownDefects.all_present() if torch_defects else KnownDefects()
    monkeypatch.setattr(races.api, "ADAPTER", SimpleNamespace(known_defects=defects))
    monkeypatch.setattr(races, "current_device", lambda: torch.device(device))
    if skips:
        with pytest.raises(unittest.SkipTest, match="found-inf"):
            races.skip_torch_scaler_race(Assertions())
    else:
        races.skip_torch_scaler_race(Assertions())
