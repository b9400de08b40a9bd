"""``LOCAL_STATE_DICT`` where ranks hold only padding (world sizes 3 and 4).

A unit's flat parameter of ``n`` elements is padded to a multiple of the world
size ``w`` and each rank holds ``s = ceil(n / w)`` of it, so with small units some
ranks hold padding only. The local state dict gives each unit's flat parameter
as a ``ShardedTensor`` of the unpadded ``n`` elements in which rank ``r`` holds
the elements ``[r*s, min((r+1)*s, n))`` (none, so no local shard, when ``r*s >=
n``): the metadata, the local shards and their values (the unit's parameters,
flattened in order) are checked on every rank, before and after a training
step (with ``use_orig_params``, as torch's FSDP gives it: padded, one shard
per rank). The dict then loads into a model built from another seed, after which the
full parameters are the saved model's, and it trains on from there as the saved
one does. Crossed with the sharded strategies, ``use_orig_params`` and the
state-dict config's ``offload_to_cpu``.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from fsdptest import FSDPTest
from fsdptest.api import (
    ADAPTER,
    FLAT_PARAM,
    FSDP,
    LocalStateDictConfig,
    ShardingStrategy,
    StateDictType,
    clean_tensor_name,
)
from fsdptest.limitations import torch_local_offload_fails
from harness.seeding import manual_seed


def _net() -> nn.Sequential:
    """Units of 1, 2 and 6 elements and a root of 3: at three ranks the first
    two units leave ranks 1-2 and 2 with padding only, at four ranks the third
    unit and the root leave rank 3 so."""
    return nn.Sequential(
        nn.Linear(1, 1, bias=False),
        nn.Linear(1, 1),
        nn.Sequential(nn.Linear(1, 2), nn.Linear(2, 1, bias=False)),
        nn.Linear(1, 3, bias=False),
    )


ALIGNMENT_BYTES = 16


def _aligned(params: list[torch.Tensor]) -> torch.Tensor:
    """The parameters flattened in order, each starting at a multiple of
    ``ALIGNMENT_BYTES``, NaN in the alignment padding (``use_orig_params``)."""
    pieces: list[torch.Tensor] = []
    numel = 0
    for param in params:
        align = ALIGNMENT_BYTES // param.element_size()
        if numel % align:
            pad = align - numel % align
            pieces.append(torch.full((pad,), float("nan")))
            numel += pad
        pieces.append(param.detach().reshape(-1).cpu())
        numel += param.numel()
    return torch.cat(pieces)


class LocalStateDictPadding(FSDPTest):
    def _model(
        self, seed: int, strategy: ShardingStrategy, orig: bool
    ) -> tuple[nn.Module, nn.Sequential]:
        manual_seed(seed)
        net = _net().to(self.device)
        reference = _net().to(self.device)
        reference.load_state_dict(net.state_dict())
        kwargs = {"sharding_strategy": strategy, "use_orig_params": orig, "device_id": self.device}
        for i in range(3):
            net[i] = FSDP(net[i], **kwargs)
        return FSDP(net, **kwargs), reference

    def test_local_state_dict_of_padding_only_ranks(self) -> None:
        """Every sharded strategy x use_orig_params x offload_to_cpu."""
        configs = [
            {"strategy": s, "orig": o, "offload": f}
            for s, o, f in itertools.product(
                (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP),
                (False, True),
                (False, True),
            )
        ]
        self.run_subtests({"config": configs}, lambda config: self._check(**config))

    def _check(self, strategy: ShardingStrategy, orig: bool, offload: bool) -> None:
        if offload and torch_local_offload_fails():
            self.skipTest("torch's FSDP cannot offload a local state dict on accelerator ranks")
        model, reference = self._model(0, strategy, orig)
        config = LocalStateDictConfig(offload_to_cpu=offload)
        with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT, config):
            self._check_shards(model.state_dict(), reference, orig)
        self._train(model, reference)
        with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT, config):
            saved = model.state_dict()
        self._check_shards(saved, reference, orig)
        other, _ = self._model(1, strategy, orig)
        with FSDP.state_dict_type(other, StateDictType.LOCAL_STATE_DICT):
            strict = not (orig and ADAPTER.known_defects.local_state_dict_keeps_flat_param_key)
            other.load_state_dict(saved, strict=strict)
        self.assertEqual(
            self._full(other), {n: p.detach() for n, p in reference.named_parameters()}
        )
        self._train(other, reference)
        self.assertEqual(
            self._full(other), {n: p.detach() for n, p in reference.named_parameters()}
        )

    def _train(self, model: nn.Module, reference: nn.Module) -> None:
        """One SGD step on the same input everywhere (the reference needs no DDP)."""
        x = torch.linspace(-1.0, 1.0, 4, device=self.device).reshape(4, 1)
        for m in (model, reference):
            m(x).square().sum().backward()
            torch.optim.SGD(m.parameters(), lr=0.1).step()
            m.zero_grad()

    def _full(self, model: nn.Module) -> dict[str, torch.Tensor]:
        with FSDP.summon_full_params(model):
            return {clean_tensor_name(n): p.detach().clone() for n, p in model.named_parameters()}

    def _check_shards(self, state: dict[str, object], reference: nn.Sequential, orig: bool) -> None:
        units = {
            "0.": list(reference[0].parameters()),
            "1.": list(reference[1].parameters()),
            "2.": list(reference[2].parameters()),
            "": [reference[3].weight],
        }
        for prefix, params in units.items():
            value = state[f"{prefix}{FLAT_PARAM}"]
            assert isinstance(value, ShardedTensor), f"{prefix}{FLAT_PARAM} is {type(value)}"
            if orig:
                self._check_padded(prefix, value, params)
            else:
                flat = torch.cat([p.detach().reshape(-1) for p in params])
                self._check_one(prefix, value, flat)

    def _check_one(self, prefix: str, value: ShardedTensor, flat: torch.Tensor) -> None:
        n, w = flat.numel(), self.world_size
        size = math.ceil(n / w)
        self.assertEqual(tuple(value.size()), (n,), msg=f"{prefix}: the unpadded size")
        expected_meta = [([r * size], [min(size, n - r * size)]) for r in range(w) if r * size < n]
        meta = sorted(
            (list(m.shard_offsets), list(m.shard_sizes)) for m in value.metadata().shards_metadata
        )
        self.assertEqual(meta, expected_meta, msg=f"{prefix}: the shards' offsets and sizes")
        start = self.rank * size
        local = value.local_shards()
        if start >= n:
            self.assertEqual(local, [], msg=f"{prefix}: rank {self.rank} holds padding only")
            return
        self.assertEqual(len(local), 1)
        self.assertEqual(local[0].tensor.cpu(), flat[start : start + size].cpu())

    def _check_padded(self, prefix: str, value: ShardedTensor, params: list[torch.Tensor]) -> None:
        """With ``use_orig_params`` the flat parameter is given as torch's FSDP
        gives it: padded, every rank one shard of ``s`` elements. Each original
        parameter starts at a multiple of 16 bytes (alignment padding), and the
        whole is padded to a multiple of the world size; the padding's values are
        each implementation's own (NaN in ``flat``: not compared)."""
        flat = _aligned(params)
        w = self.world_size
        size = math.ceil(flat.numel() / w)
        self.assertEqual(tuple(value.size()), (w * size,), msg=f"{prefix}: the padded size")
        meta = sorted(
            (list(m.shard_offsets), list(m.shard_sizes)) for m in value.metadata().shards_metadata
        )
        self.assertEqual(meta, [([r * size], [size]) for r in range(w)])
        (local,) = value.local_shards()
        expected = torch.full((w * size,), float("nan"))
        expected[: flat.numel()] = flat
        expected = expected[self.rank * size : (self.rank + 1) * size]
        kept = ~torch.isnan(expected)
        self.assertEqual(local.tensor.cpu()[kept], expected[kept])


class TestLocalStateDictPaddingThreeRanks(LocalStateDictPadding):
    world_size = 3


class TestLocalStateDictPaddingFourRanks(LocalStateDictPadding):
    world_size = 4
