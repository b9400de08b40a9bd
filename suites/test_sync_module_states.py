"""``sync_module_states``: every rank starts from the first rank's parameters and
buffers, frozen ones included, for every strategy, nesting and buffer dtype.

Each rank builds the model from its own seed and fills its buffers with its own
values. After construction with ``sync_module_states=True`` every parameter a
unit manages (summoned in full), frozen or not, and every buffer (float32,
float64, float16, int64 and bool; a batch norm's statistics and counter) must
hold rank 0's values on every rank, keep its ``requires_grad``, and the
parameters of an ignored module must keep each rank's own values (FSDP does not
manage them; its buffers are broadcast with the unit above it). Crossed with
every sharding strategy (hybrid ones on a device mesh of two replica groups at
four ranks), ``use_orig_params``, what is frozen (nothing, a whole unit, or, with
``use_orig_params``, some parameters of a unit), whether the module is already
on the device or built on the CPU with ``device_id``, and whether a module is
ignored. Torch's FSDP refuses CPU modules here on a CPU run: asserted once.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdptest import FSDPTest
from fsdptest.api import ADAPTER, FSDP, ShardingStrategy, clean_tensor_name
from harness.seeding import manual_seed

TORCH_SYNC_MODULE_STATES_ON_CPU = (
    "The module has CPU parameters or buffers when `sync_module_states=True`"
)
_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
FROZEN = ("nothing", "unit", "some")


class Buffers(nn.Module):
    """A linear layer and one buffer of each dtype."""

    def __init__(self, rank: int, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("f64", torch.full((2,), float(rank), dtype=torch.float64))
        self.register_buffer("f16", torch.full((3,), rank + 0.5, dtype=torch.float16))
        self.register_buffer("count", torch.tensor(rank + 7, dtype=torch.int64))
        self.register_buffer("mask", torch.tensor([rank % 2 == 0, True]))


class Synced(nn.Module):
    """A root linear, a unit with a batch norm, a unit of buffers, an ignorable part."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        manual_seed(rank)
        self.stem = nn.Linear(3, 5)
        self.a = nn.Sequential(nn.Linear(5, 5), nn.BatchNorm1d(5))
        self.b = Buffers(rank, 5)
        self.c = Buffers(rank, 2)
        bn = self.a[1]
        assert isinstance(bn, nn.BatchNorm1d)
        bn.running_mean.fill_(rank)
        bn.num_batches_tracked.fill_(rank)

    def freeze(self, frozen: str) -> None:
        if frozen == "unit":
            self.a.requires_grad_(False)
        elif frozen == "some":
            self.a[0].weight.requires_grad_(False)
            self.b.lin.bias.requires_grad_(False)


def _gathered(tensor: torch.Tensor) -> list[torch.Tensor]:
    flat = tensor.detach().reshape(-1).to(torch.float64)
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return out


class SyncModuleStates(FSDPTest):
    """The checks; subclasses pin the world size."""

    def test_every_rank_starts_from_rank_0(self) -> None:
        if ADAPTER.limitations.needs_accelerator and self.device.type == "cpu":
            model = Synced(self.rank)
            with self.assertRaisesRegex(ValueError, TORCH_SYNC_MODULE_STATES_ON_CPU):
                FSDP(model, device_id=self.device, sync_module_states=True)
            return
        configs = [
            {"sharding_strategy": s, "use_orig_params": o, "frozen": f, "on_device": d, "ignore": i}
            for s, o, f, d, i in itertools.product(
                self.strategies(), (False, True), FROZEN, (True, False), (False, True)
            )
            if f != "some" or o  # a flat parameter must not mix frozen and trainable
        ]
        self.run_subtests({"config": configs}, lambda config: self._check(**config))

    def strategies(self) -> list[ShardingStrategy]:
        return list(ShardingStrategy)

    def _torch_syncs_shard_groups_first(self) -> bool:
        from fsdptest.conformance.target import torch_before_2_13

        replicas = self._mesh().shape[0]
        return not ADAPTER.is_project_fsdp and torch_before_2_13() and replicas > 1

    def _mesh(self) -> DeviceMesh:
        if "_hybrid_mesh" not in self.__dict__:
            world = self.world_size
            shape = (2, world // 2) if world % 2 == 0 and world > 2 else (1, world)
            self.__dict__["_hybrid_mesh"] = init_device_mesh(self.device.type, shape)
        mesh: DeviceMesh = self.__dict__["_hybrid_mesh"]
        return mesh

    def _wrap(
        self,
        model: Synced,
        sharding_strategy: ShardingStrategy,
        use_orig_params: bool,
        ignore: bool,
    ) -> nn.Module:
        kwargs: dict[str, object] = {
            "sharding_strategy": sharding_strategy,
            "use_orig_params": use_orig_params,
            "device_id": self.device,
            "sync_module_states": True,
        }
        if sharding_strategy in _HYBRID:
            kwargs["device_mesh"] = self._mesh()
        model.a = FSDP(model.a, **kwargs)
        model.b = FSDP(model.b, **kwargs)
        return FSDP(model, ignored_modules=[model.c] if ignore else None, **kwargs)

    def _check(
        self,
        sharding_strategy: ShardingStrategy,
        use_orig_params: bool,
        frozen: str,
        on_device: bool,
        ignore: bool,
    ) -> None:
        if sharding_strategy in _HYBRID and self._torch_syncs_shard_groups_first():
            self.skipTest(
                "torch's FSDP before 2.13 broadcasts over the shard group first, leaving the "
                "first rank of each shard group its own values (HYBRID_SYNC_ORDER_BEFORE_TORCH_2_13, "
                "asserted in suites/test_conformance_allowed.py)"
            )
        model = Synced(self.rank)
        model.freeze(frozen)
        if on_device:
            model = model.to(self.device)
        requires_grad = {name: p.requires_grad for name, p in model.named_parameters()}
        fsdp = self._wrap(model, sharding_strategy, use_orig_params, ignore)
        ignored = {f"c.{name}" for name, _ in model.c.named_parameters()} if ignore else set()
        with FSDP.summon_full_params(fsdp):
            states = {clean_tensor_name(n): p for n, p in model.named_parameters()}
            self.assertEqual(
                {n: p.requires_grad for n, p in states.items()},
                requires_grad,
                msg="requires_grad kept",
            )
            states.update((clean_tensor_name(n), b) for n, b in model.named_buffers())
            for name, tensor in sorted(states.items()):
                values = _gathered(tensor)
                if name in ignored:
                    self.assertNotEqual(
                        values[0], values[1], msg=f"ignored {name} is the rank's own"
                    )
                    continue
                for rank, value in enumerate(values):
                    self.assertEqual(value, values[0], msg=f"{name} on rank {rank}")


class TestSyncModuleStates(SyncModuleStates):
    """Two ranks: every strategy (hybrid over one shard group of two)."""

    world_size = 2


class TestSyncModuleStatesFourRanks(SyncModuleStates):
    """Four ranks: the sharded strategies, hybrid ones over two replica groups."""

    world_size = 4

    def strategies(self) -> list[ShardingStrategy]:
        return [ShardingStrategy.FULL_SHARD, *_HYBRID]
