"""``summon_full_params(offload_to_cpu=True, writeback=...)``: edits of the CPU
copies reach the sharded parameters exactly when ``writeback``.

Inside the context every summoned parameter is a full-precision CPU copy of the
full parameter; edits made there (in place, the same on every rank) are written
back into each rank's shard on exit with ``writeback=True`` and dropped with
``writeback=False``. Checked by summoning again (on the device) and by a
forward, which must equal the unwrapped reference's with the same edits, for
the sharded strategies, ``use_orig_params``, ``recurse`` (only the root unit's
own parameters are summoned without it), parameter mixed precision, parameters
offloaded by ``CPUOffload`` or not, and two and three ranks. ``NO_SHARD`` refuses
``offload_to_cpu`` (torch's ``NotImplementedError``, asserted). Torch's FSDP
cannot summon with ``offload_to_cpu`` on CPU ranks (fsdptest.limitations): the
suite skips there and runs on accelerators.
"""

from __future__ import annotations

import copy
import itertools

import torch
from torch import nn

from fsdptest import FSDPTest
from fsdptest.api import (
    ADAPTER,
    FSDP,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
    clean_tensor_name,
    torch_refuses_cpu_offload,
)

TORCH_CANNOT_OFFLOAD_SUMMONS = (
    "torch's summon_full_params(offload_to_cpu=True) with the CPU as compute device exposes "
    "freed storage (fsdptest.limitations)"
)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(3, 5), nn.Sequential(nn.Linear(5, 7), nn.Tanh()), nn.Linear(7, 2)
    )


@torch.no_grad()
def _edit(params: list[nn.Parameter]) -> None:
    for i, param in enumerate(params):
        param.mul_(0.5).add_(0.125 * (i + 1))


class SummonOffloadWriteback(FSDPTest):
    def test_offloaded_edits_are_written_back(self) -> None:
        """Sharded strategies x use_orig_params x writeback x recurse x mixed
        precision x parameter offload."""
        if ADAPTER.limitations.offload_to_cpu_on_cpu:
            self.skipTest(TORCH_CANNOT_OFFLOAD_SUMMONS)
        configs = [
            dict(zip(("strategy", "orig", "writeback", "recurse", "mp", "offload"), values))
            for values in itertools.product(
                (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP),
                (False, True),
                (True, False),
                (True, False),
                (False, True),
                (False, True),
            )
        ]
        self.run_subtests({"config": configs}, lambda config: self._check(**config))

    def _model(self, strategy: ShardingStrategy, orig: bool, mp: bool, offload: bool) -> nn.Module:
        kwargs = {
            "sharding_strategy": strategy,
            "use_orig_params": orig,
            "mixed_precision": MixedPrecision(param_dtype=torch.float16) if mp else None,
            "cpu_offload": CPUOffload(offload_params=offload),
            "device_id": self.device,
        }
        net = _net()
        net[1] = FSDP(net[1], **kwargs)
        return FSDP(net, **kwargs)

    def _check(
        self,
        strategy: ShardingStrategy,
        orig: bool,
        writeback: bool,
        recurse: bool,
        mp: bool,
        offload: bool,
    ) -> None:
        if torch_refuses_cpu_offload(CPUOffload(offload_params=offload)):
            self.skipTest("torch's FSDP cannot offload parameters on CPU ranks")
        model = self._model(strategy, orig, mp, offload)
        reference = _net().to(self.device)
        with FSDP.summon_full_params(
            model, recurse=recurse, writeback=writeback, offload_to_cpu=True
        ):
            summoned = self._summoned(model, recurse)
            for name, param in summoned.items():
                self.assertEqual(param.device.type, "cpu", msg=name)
                self.assertEqual(param.dtype, torch.float32, msg=name)
            self.assertEqual(
                {n: p.detach().cpu() for n, p in summoned.items()},
                {n: p.detach().cpu() for n, p in reference.named_parameters() if n in summoned},
            )
            _edit(list(summoned.values()))
        if writeback:
            _edit([p for n, p in reference.named_parameters() if n in summoned])
        with FSDP.summon_full_params(model):
            full = {clean_tensor_name(n): p.detach().clone() for n, p in model.named_parameters()}
        self.assertEqual(full, {n: p.detach() for n, p in reference.named_parameters()})
        if not mp:  # the same computation: the outputs are equal
            x = torch.randn(4, 3, device=self.device)
            self.assertEqual(model(x), reference(x))

    def _summoned(self, model: nn.Module, recurse: bool) -> dict[str, nn.Parameter]:
        """What the summon exposes: every parameter, or without ``recurse`` the
        root unit's own (those of units 0 and 2 of the Sequential)."""
        named = {clean_tensor_name(n): p for n, p in model.named_parameters()}
        if recurse:
            return named
        return {n: p for n, p in named.items() if not n.startswith("1.")}

    def test_no_shard_refuses_offload_to_cpu(self) -> None:
        model = FSDP(
            copy.deepcopy(_net()).to(self.device),
            sharding_strategy=ShardingStrategy.NO_SHARD,
            device_id=self.device,
        )
        with self.assertRaisesRegex(
            NotImplementedError, "offload_to_cpu=True and NO_SHARD is not supported yet"
        ):
            with FSDP.summon_full_params(model, offload_to_cpu=True):
                pass


class TestSummonOffloadWritebackTwoRanks(SummonOffloadWriteback):
    world_size = 2


class TestSummonOffloadWritebackThreeRanks(SummonOffloadWriteback):
    world_size = 3
