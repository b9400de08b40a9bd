"""Hybrid sharding with an explicit ``(shard_group, replicate_group)`` pair.

Meshes are built here with ``dist.new_group``: ``replicas=1`` is one replica
sharded over every rank; ``replicas=W`` makes every rank a replica with a
one-rank shard group. With different data on every rank, the replicas must stay
identical and equal DDP's model, and a loss with a known gradient must give
DDP's gradient, the mean over all ranks.

[Note: torch's one-rank shard group defect]
With a one-rank shard group torch's FSDP silently switches to ``NO_SHARD``
(``torch/distributed/fsdp/_init_utils.py``, ``_init_core_state``: "switching to
use NO_SHARD ... since the world size is 1"), then reduces a ``NO_SHARD``
gradient with ``_runtime_utils._reduce_grad_no_shard``, which all-reduces over
``state.process_group`` (the one-rank shard group) only, and never over the
replicate group, after dividing by the data-parallel size (shard size x replica
count). Each rank keeps its own gradient divided by the replica count and the
replicas drift apart. For torch these tests assert that drift, so that a fix in
torch shows up here; for our FSDP they assert the correct behaviour.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdptest import FSDPTest
from fsdptest.api import ADAPTER, FSDP, ShardingStrategy, clean_tensor_name
from fsdptest.parity import EXACT, REORDERED_FP32, Tolerance
from harness import current_device

HYBRID = [ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2]
ProcessGroups = tuple[dist.ProcessGroup, dist.ProcessGroup]


def _subgroup(layout: list[list[int]], rank: int) -> dist.ProcessGroup:
    """Creates every group of ``layout`` (on every rank, in order); returns this rank's."""
    groups = {tuple(ranks): dist.new_group(ranks) for ranks in layout}
    return next(group for ranks, group in groups.items() if rank in ranks)


def _mesh(world_size: int, rank: int, replicas: int) -> ProcessGroups:
    """(shard, replicate) groups: ``replicas`` blocks of consecutive ranks."""
    shards = world_size // replicas
    shard_layout = [list(range(r * shards, (r + 1) * shards)) for r in range(replicas)]
    replicate_layout = [list(range(s, world_size, shards)) for s in range(shards)]
    return _subgroup(shard_layout, rank), _subgroup(replicate_layout, rank)


def _torch_defect(replicas: int, world_size: int) -> bool:
    """See [Note: torch's one-rank shard group defect]."""
    return (
        ADAPTER.known_defects.one_rank_shard_group_never_syncs_replicas and replicas == world_size
    )


def _ddp(module: nn.Module) -> DDP:
    device = current_device()
    module = module.to(device)
    return DDP(module, device_ids=[device.index] if device.type == "cuda" else None)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3)).to(current_device())


def _input(rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(3, 7, generator=generator).to(current_device())


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    with FSDP.summon_full_params(model):
        return {clean_tensor_name(n): p.detach().clone() for n, p in model.named_parameters()}


def _in_sync(world_size: int, tensors: list[torch.Tensor]) -> bool:
    """Whether every rank holds the same values (checksums all-gathered)."""
    local = torch.stack([t.double().sum() for t in tensors]).to(current_device())
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)
    return all(torch.equal(other, gathered[0]) for other in gathered[1:])


def _tolerance(world_size: int) -> Tolerance:
    """Exact with two ranks (two addends per reduction, exact in any order); with
    three, DDP's and FSDP's reductions may add in different orders."""
    return EXACT if world_size == 2 else REORDERED_FP32


class _HybridReplicas(FSDPTest):
    """HYBRID_SHARD and _HYBRID_SHARD_ZERO2 on a 1xW and a Wx1 mesh."""

    def test_replicas_stay_in_sync_and_equal_ddp(self) -> None:
        """Different data per rank: after steps 1 and 3 all replicas are identical and equal DDP."""
        config = {
            "sharding_strategy": HYBRID,
            "replicas": [1, self.world_size],
            "use_orig_params": [False, True],
        }
        self.run_subtests(config, self._check_sync, self._meshes())

    def _meshes(self) -> dict[int, ProcessGroups]:
        """Built once per test: a gloo group holds sockets and threads until the test ends."""
        return {r: _mesh(self.world_size, self.rank, r) for r in (1, self.world_size)}

    def _check_sync(
        self,
        meshes: dict[int, ProcessGroups],
        sharding_strategy: ShardingStrategy,
        replicas: int,
        use_orig_params: bool,
    ) -> None:
        group = meshes[replicas]
        kwargs = {
            "process_group": group,
            "sharding_strategy": sharding_strategy,
            "use_orig_params": use_orig_params,
        }
        net = _net()
        net[0] = FSDP(net[0], **kwargs)
        model = FSDP(net, **kwargs)
        reference = _ddp(_net())
        optims = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference)]
        for step in range(3):
            for m, optim in zip((model, reference), optims):
                optim.zero_grad()
                m(_input(self.rank, step)).sum().backward()
                optim.step()
            if step in (0, 2):
                self._compare(model, reference, replicas, f"after {step + 1} step(s)")

    def _compare(self, model: FSDP, reference: DDP, replicas: int, when: str) -> None:
        full = _full_params(model)
        expected = {n: p.detach() for n, p in reference.module.named_parameters()}
        in_sync = _in_sync(self.world_size, list(full.values()))
        if _torch_defect(replicas, self.world_size):
            self.assertFalse(in_sync, f"torch's one-rank shard replicas synced {when}: fixed?")
            self.assertNotEqual(full, expected, rtol=0, atol=0)
            return
        self.assertTrue(in_sync, f"replicas differ {when}")
        tolerance = _tolerance(self.world_size)
        self.assertEqual(full, expected, when, rtol=tolerance.rtol, atol=tolerance.atol)

    def test_known_gradient_is_mean_over_ranks(self) -> None:
        """loss = sum(Linear(4, 1, bias=False)(x)), x = rank + 1: the gradient is DDP's mean."""
        config = {
            "sharding_strategy": HYBRID,
            "replicas": [1, self.world_size],
            "use_orig_params": [False, True],
        }
        self.run_subtests(config, self._check_known_gradient, self._meshes())

    def _check_known_gradient(
        self,
        meshes: dict[int, ProcessGroups],
        sharding_strategy: ShardingStrategy,
        replicas: int,
        use_orig_params: bool,
    ) -> None:
        group = meshes[replicas]
        x = torch.full((1, 4), float(self.rank + 1), device=current_device())
        reference = _ddp(nn.Linear(4, 1, bias=False))
        reference(x).sum().backward()
        ddp_grad = reference.module.weight.grad
        mean = sum(range(1, self.world_size + 1)) / self.world_size
        self.assertEqual(ddp_grad, torch.full_like(ddp_grad, mean))  # the mean over ranks
        model = FSDP(
            nn.Linear(4, 1, bias=False).to(current_device()),
            process_group=group,
            sharding_strategy=sharding_strategy,
            use_orig_params=use_orig_params,
        )
        model(x).sum().backward()
        grad = _gathered_weight_grad(model, use_orig_params)
        if _torch_defect(replicas, self.world_size):
            # Each rank keeps its own gradient, rank + 1, divided by the replica count.
            drifted = (self.rank + 1) / self.world_size
            self.assertEqual(grad, torch.full_like(grad, drifted))
            return
        tolerance = _tolerance(self.world_size)
        self.assertEqual(grad, ddp_grad, rtol=tolerance.rtol, atol=tolerance.atol)


def _gathered_weight_grad(model: FSDP, use_orig_params: bool) -> torch.Tensor:
    """The full gradient of the single Linear's weight (shape (1, 4))."""
    if use_orig_params:
        with FSDP.summon_full_params(model, with_grads=True):
            grad = model.module.weight.grad
            assert grad is not None
            return grad.detach().clone()
    flat = model._flat_param.grad
    assert flat is not None
    group = model.process_group  # the shard group
    shards = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, flat.contiguous(), group=group)
    return torch.cat(shards)[:4].view(1, 4)


class TestHybridReplicasWorld2(_HybridReplicas):
    world_size = 2


class TestHybridReplicasWorld3(_HybridReplicas):
    world_size = 3
