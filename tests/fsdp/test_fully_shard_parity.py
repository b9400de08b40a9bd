"""Our ``fully_shard`` trains as torch's does, bit for bit, and as DDP does: on
1-D meshes of 1, 2, 3 and 4 ranks (uneven shards, a rank with an empty shard),
every ``reshard_after_forward``, mixed precision, HSDP on a 2 x 2 mesh and
tensor parallelism within data parallelism (2 x 2); and
it issues the same collectives per step (one all-gather and one reduce-scatter
per parameter group, of the same sizes and dtypes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecision
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdp._fully_shard import MixedPrecisionPolicy, fully_shard
from harness import DistributedTest
from harness.collectives import CollectiveRecorder
from tests.fsdp.fully_shard_cases import PRECISIONS, batch, loss_of, model

_PRECISIONS = PRECISIONS


def _shard(module: nn.Sequential, shard_fn: Callable[..., Any], **kwargs: Any) -> nn.Sequential:
    for layer in module:
        if isinstance(layer, nn.Linear):
            shard_fn(layer, **kwargs)
    shard_fn(module, **kwargs)
    return module


class _Pair:
    """Ours and torch's copies of one model (and, when asked, DDP's), trained in lockstep."""

    def __init__(
        self, test: DistributedTest, mesh: DeviceMesh, precision: str, ddp: bool, **kwargs: Any
    ):
        self.test = test
        policy = _PRECISIONS[precision]
        ours_policy, torch_policy = MixedPrecisionPolicy(**policy), TorchMixedPrecision(**policy)
        self.ours = _shard(
            model(test.device), fully_shard, mesh=mesh, mp_policy=ours_policy, **kwargs
        )
        self.theirs = _shard(
            model(test.device), torch_fully_shard, mesh=mesh, mp_policy=torch_policy, **kwargs
        )
        self.ddp = DDP(model(test.device)) if ddp else None
        models = [m for m in (self.ours, self.theirs, self.ddp) if m is not None]
        self.optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]

    def train(self, steps: int) -> None:
        for step in range(steps):
            self.step(step)

    def step(self, step: int) -> None:
        rank, world = self.test.rank, self.test.world_size
        x = batch(step, world, self.test.device)[4 * rank : 4 * rank + 4]
        models = [m for m in (self.ours, self.theirs, self.ddp) if m is not None]
        losses = [loss_of(m, x) for m in models]
        for loss in losses:
            loss.backward()
        self.test.assertEqual(losses[0], losses[1], atol=0, rtol=0)
        self.check_grads()
        for optim in self.optims:
            optim.step()
            optim.zero_grad(set_to_none=step % 2 == 0)

    def check_grads(self) -> None:
        named = zip(self.ours.named_parameters(), self.theirs.parameters())
        for (name, ours), theirs in named:
            assert isinstance(ours, DTensor) and isinstance(theirs, DTensor), name
            self.test.assertEqual(ours.placements, theirs.placements)
            self.test.assertEqual(ours.to_local(), theirs.to_local(), atol=0, rtol=0)
            self.test.assertEqual(ours.grad.to_local(), theirs.grad.to_local(), atol=0, rtol=0)
        if self.ddp is None:
            return
        for ours, ddp in zip(self.ours.parameters(), self.ddp.parameters()):
            # DDP all-reduces where we reduce-scatter: the sums run in another order
            self.test.assertEqual(ours.grad.full_tensor(), ddp.grad, atol=1e-5, rtol=1e-5)


class _ParityTests(DistributedTest):
    """One test per world size, its cases as subtests: each world size's ranks
    start once (a pool of 3 or 4 ranks takes tens of seconds on two cores)."""

    # (reshard_after_forward, precision) pairs compared with torch; the full
    # product at 2 ranks, a spread at 3 and 4
    torch_configs: tuple[tuple[bool | int | None, str], ...]

    def _mesh(self) -> DeviceMesh:
        return init_device_mesh(self.device.type, (self.world_size,))

    def _cases(self) -> list[tuple[str, Any]]:
        return [
            *(("torch", config) for config in self.torch_configs),
            ("ddp", None),
            *(("collectives", precision) for precision in _PRECISIONS),
        ]

    def test_parity_with_torch_and_ddp(self) -> None:
        """Losses, parameters and gradients equal torch's exactly, step by step,
        for each (reshard_after_forward, precision); fp32 gradients equal DDP's
        (to the order of the sums); the collectives are torch's."""
        self.run_subtests({"case": self._cases()}, self._check)

    def _check(self, case: tuple[str, Any]) -> None:
        kind, value = case
        if kind == "torch":
            reshard_after_forward, precision = value
            _Pair(
                self, self._mesh(), precision, False, reshard_after_forward=reshard_after_forward
            ).train(3)
        elif kind == "ddp":
            _Pair(self, self._mesh(), "fp32", True).train(3)
        elif kind == "collectives":
            self._check_collectives(value)
        else:
            self._check_hsdp(value)

    def _check_collectives(self, precision: str) -> None:
        """Per step: one all-gather per group in forward, one per resharded group
        in backward, one reduce-scatter per group; the same sizes and dtypes as
        torch's, in the same order."""
        traces = []
        for shard_fn, policy in (
            (fully_shard, MixedPrecisionPolicy),
            (torch_fully_shard, TorchMixedPrecision),
        ):
            sharded = _shard(
                model(self.device), shard_fn, mp_policy=policy(**_PRECISIONS[precision])
            )
            with CollectiveRecorder() as recorder:
                loss_of(sharded, batch(0, 1, self.device)).backward()
            traces.append(
                [(c.kind, c.input_dtype, c.input_numel, c.output_numel) for c in recorder.calls]
            )
        self.assertEqual(traces[0], traces[1])
        kinds = [call[0].name for call in traces[0]]
        # three groups (the root has no parameters of its own), none of them the
        # root, so all resharded after forward and gathered again in backward
        self.assertEqual(kinds.count("ALL_GATHER"), 3 + 3)
        self.assertEqual(kinds.count("REDUCE_SCATTER"), 3)

    def _check_hsdp(self, precision: str) -> None:
        """A 2 x 2 mesh (replicate x shard): exact to torch's HSDP (close to DDP in
        fp32), and the two replicas of every shard equal."""
        mesh = init_device_mesh(self.device.type, (2, 2), mesh_dim_names=("replicate", "shard"))
        pair = _Pair(self, mesh, precision, precision == "fp32")
        pair.train(3)
        for param in pair.ours.parameters():
            local = param.to_local().detach().clone()
            replicas = [torch.empty_like(local) for _ in range(2)]
            dist.all_gather(replicas, local, group=mesh.get_group(0))
            self.assertEqual(replicas[0], replicas[1], atol=0, rtol=0)


class TestParityOneRank(_ParityTests):
    world_size = 1
    torch_configs = ((None, "fp32"), (True, "bf16"))

    def _cases(self) -> list[tuple[str, Any]]:
        return [*(("torch", config) for config in self.torch_configs), ("collectives", "bf16")]

    def _check_collectives(self, precision: str) -> None:
        """One rank: no collective at all, as torch's."""
        for shard_fn in (fully_shard, torch_fully_shard):
            sharded = _shard(model(self.device), shard_fn)
            with CollectiveRecorder() as recorder:
                loss_of(sharded, batch(0, 1, self.device)).backward()
            self.assertEqual(recorder.calls, [])


class TestParityTwoRanks(_ParityTests):
    world_size = 2
    torch_configs = tuple(
        (reshard, precision) for reshard in (None, True, False) for precision in _PRECISIONS
    )


class TestParityThreeRanks(_ParityTests):
    world_size = 3
    torch_configs = ((None, "fp32"), (True, "bf16"), (False, "fp16-reduce-fp32"))


class TestParityFourRanks(_ParityTests):
    world_size = 4
    torch_configs = ((True, "fp32"), (2, "fp32"), (2, "bf16"), (None, "fp16-reduce-fp32"))

    def _cases(self) -> list[tuple[str, Any]]:
        hsdp = [("hsdp", "fp32"), ("hsdp", "fp16-reduce-fp32")]
        return [*super()._cases(), *hsdp, ("tensor-parallel", "fp32"), ("tensor-parallel", "bf16")]

    def _check(self, case: tuple[str, Any]) -> None:
        if case[0] == "tensor-parallel":
            self._check_tensor_parallel(case[1])
        else:
            super()._check(case)

    def _check_tensor_parallel(self, precision: str) -> None:
        """2 x 2 (data x tensor parallel): column- then row-wise linear layers
        sharded over the data-parallel mesh: the placements (a strided shard where
        both split the rows), losses and gradients are torch's exactly."""
        mesh = init_device_mesh(self.device.type, (2, 2), mesh_dim_names=("dp", "tp"))
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        models = []
        for shard_fn, policy in (
            (fully_shard, MixedPrecisionPolicy),
            (torch_fully_shard, TorchMixedPrecision),
        ):
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).to(self.device)
            parallelize_module(net, mesh["tp"], plan)
            models.append(
                shard_fn(net, mesh=mesh["dp"], mp_policy=policy(**_PRECISIONS[precision]))
            )
        dp_rank = mesh["dp"].get_local_rank()
        for step in range(3):
            x = batch(step, 2, self.device, features=8)[4 * dp_rank : 4 * dp_rank + 4]
            losses = [loss_of(m, x) for m in models]
            for loss in losses:
                loss.backward()
            self.assertEqual(losses[0], losses[1], atol=0, rtol=0)
            for ours, theirs in zip(models[0].parameters(), models[1].parameters()):
                self.assertEqual(ours.placements, theirs.placements)
                self.assertEqual(ours.to_local(), theirs.to_local(), atol=0, rtol=0)
                self.assertEqual(ours.grad.to_local(), theirs.grad.to_local(), atol=0, rtol=0)
                ours.grad = theirs.grad = None
