"""How many collectives FSDP issues, and explicit unshards (port of upstream ``test_fsdp_comm.py``).

[Note: Counting collectives]
Upstream replaces ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` with
mocks and counts their calls. Here ``harness.collectives.CollectiveRecorder``
counts every name of each collective (torch's FSDP all-gathers CPU tensors with
the list form ``all_gather``, our FSDP calls the newest single-tensor name) and
lets the collectives run, so both implementations are counted on the CPU as on
CUDA. The reference counts are upstream's: one all-gather per unit per forward,
none in backward for the root (it keeps its parameters after forward) nor for
``SHARD_GRAD_OP`` (no unit frees them after forward), none in the forward after
a ``no_sync()`` backward for ``SHARD_GRAD_OP`` (units keep their parameters
then), two more per unit in the first forward, where the DETAIL debug level
checks the forward order across ranks; one reduce-scatter per unit per
backward outside ``no_sync()``.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdptest import FSDPTest
from fsdptest.api import FSDP, ModuleWrapPolicy, ShardingStrategy
from fsdptest.interface import DeviceInitMode, FSDPInitMode
from harness import parametrize
from harness.collectives import Collective, CollectiveRecorder
from models import NestedWrappedModule, TransformerWithSharedParams


class PassType(enum.Enum):
    FWD = enum.auto()
    BWD = enum.auto()


@contextlib.contextmanager
def _debug_level(level: dist.DebugLevel) -> Iterator[None]:
    """Sets the distributed debug level (process-wide) for the duration."""
    previous = dist.get_debug_level()
    dist.set_debug_level(level)
    try:
        yield
    finally:
        dist.set_debug_level(previous)


def _ddp(module: nn.Module, device: torch.device) -> DDP:
    return DDP(module, device_ids=[device.index] if device.type == "cuda" else None)


class TestCommunication(FSDPTest):
    """Tests ``FullyShardedDataParallel``'s collective communication usage."""

    def _init_model(
        self, nested_model: bool, sharding_strategy: ShardingStrategy | None
    ) -> nn.Module:
        fsdp_kwargs = {"sharding_strategy": sharding_strategy, "device_id": self.device.type}
        if nested_model:
            model = NestedWrappedModule.init(
                self.process_group, FSDPInitMode.RECURSIVE, DeviceInitMode.AFTER, fsdp_kwargs
            )
            fsdp_model: nn.Module = FSDP(model, self.process_group, **fsdp_kwargs)
        else:
            fsdp_model = TransformerWithSharedParams.init(
                self.process_group, FSDPInitMode.RECURSIVE, DeviceInitMode.BEFORE, fsdp_kwargs
            )
        return fsdp_model

    def _run_iter(self, fsdp_model: nn.Module, batch: Any, use_no_sync: bool) -> None:
        """Runs an iteration inside or outside the ``no_sync()`` context."""
        context = fsdp_model.no_sync() if use_no_sync else contextlib.nullcontext()
        with context:
            output = fsdp_model(*batch)
            loss = fsdp_model.module.get_loss(batch, output)
            loss.backward()

    def _get_ref_num_reduce_scatters(self, num_fsdp: int, in_no_sync: bool) -> int:
        """The expected number of reduce-scatters in one iteration."""
        return 0 if in_no_sync else num_fsdp

    def _get_ref_num_all_gathers(
        self,
        num_fsdp: int,
        sharding_strategy: ShardingStrategy | None,
        is_first_iter: bool,
        is_last_iter_no_sync: bool,
    ) -> int:
        """The expected number of all-gathers in one iteration (see [Note: Counting
        collectives])."""
        return sum(
            self._get_ref_num_all_gathers_in_pass(
                num_fsdp, sharding_strategy, pass_type, is_first_iter, is_last_iter_no_sync
            )
            for pass_type in PassType
        )

    def _get_ref_num_all_gathers_in_pass(
        self,
        num_fsdp: int,
        sharding_strategy: ShardingStrategy | None,
        pass_type: PassType,
        is_first_iter: bool,
        is_last_iter_no_sync: bool,
    ) -> int:
        """The expected number of all-gathers in one pass."""
        if sharding_strategy is None:
            sharding_strategy = ShardingStrategy.FULL_SHARD  # default
        if (
            pass_type == PassType.FWD
            and sharding_strategy == ShardingStrategy.SHARD_GRAD_OP
            and is_last_iter_no_sync
        ):
            # Modules do not free the full parameters in the last iteration's
            # backward pass if it was in `no_sync()`
            num_all_gathers = 0
        elif pass_type == PassType.FWD:
            # Otherwise, all modules all-gather the full parameters in the
            # forward pass
            num_all_gathers = num_fsdp
        elif pass_type == PassType.BWD and sharding_strategy == ShardingStrategy.FULL_SHARD:
            # Root does not free the full parameters at the end of the forward
            # pass
            num_all_gathers = num_fsdp - 1
        elif pass_type == PassType.BWD and sharding_strategy == ShardingStrategy.SHARD_GRAD_OP:
            # Modules do not free the full parameters at the end of the forward
            # pass
            num_all_gathers = 0
        else:
            raise AssertionError(
                f"Unsupported: add a branch for pass_type={pass_type} "
                f"is_first_iter={is_first_iter} is_last_iter_no_sync={is_last_iter_no_sync} "
                f"sharding_strategy={sharding_strategy}"
            )
        if is_first_iter and pass_type == PassType.FWD:
            # With execution order validation, on the first iteration, we have
            # an additional two all-gathers before every actual all-gather in
            # the forward pass
            num_all_gathers *= 3
        return num_all_gathers

    @parametrize("nested_model", [False, True])
    @parametrize("use_no_sync", [False, True])
    @parametrize("sharding_strategy", [ShardingStrategy.SHARD_GRAD_OP, None])
    def test_communication(
        self,
        nested_model: bool,
        use_no_sync: bool,
        sharding_strategy: ShardingStrategy | None,
    ) -> None:
        """Each iteration issues exactly the expected numbers of all-gathers and
        reduce-scatters, inside and after ``no_sync()`` (see [Note: Counting
        collectives])."""
        # Enable execution order checking
        with _debug_level(dist.DebugLevel.DETAIL):
            self._check_communication(nested_model, use_no_sync, sharding_strategy)

    def _check_communication(
        self,
        nested_model: bool,
        use_no_sync: bool,
        sharding_strategy: ShardingStrategy | None,
    ) -> None:
        # Initialize the model and inputs
        fsdp_model = self._init_model(nested_model, sharding_strategy)
        batch = fsdp_model.module.get_input(self.device)

        # Count the number of FSDP instances that manage parameters since the
        # number of collectives are a function of this number
        num_fsdp = sum((isinstance(m, FSDP) and len(m.params) > 0) for m in fsdp_model.modules())

        num_iters = 3
        recorder = CollectiveRecorder((Collective.ALL_GATHER, Collective.REDUCE_SCATTER))
        with recorder:
            # Check the communication cost when using `no_sync()`
            if use_no_sync:
                for i in range(num_iters):
                    recorder.calls.clear()
                    self._run_iter(fsdp_model, batch, use_no_sync=True)
                    num_all_gathers = len(recorder.of(Collective.ALL_GATHER))
                    num_reduce_scatters = len(recorder.of(Collective.REDUCE_SCATTER))
                    ref_num_all_gathers = self._get_ref_num_all_gathers(
                        num_fsdp,
                        sharding_strategy,
                        is_first_iter=i == 0,
                        is_last_iter_no_sync=i > 0,
                    )
                    ref_num_reduce_scatters = self._get_ref_num_reduce_scatters(
                        num_fsdp, in_no_sync=True
                    )
                    self.assertEqual(num_all_gathers, ref_num_all_gathers)
                    self.assertEqual(num_reduce_scatters, ref_num_reduce_scatters)
            # Check the normal communication cost (when not using `no_sync()`)
            for i in range(num_iters):
                recorder.calls.clear()
                self._run_iter(fsdp_model, batch, use_no_sync=False)
                num_all_gathers = len(recorder.of(Collective.ALL_GATHER))
                num_reduce_scatters = len(recorder.of(Collective.REDUCE_SCATTER))
                ref_num_all_gathers = self._get_ref_num_all_gathers(
                    num_fsdp,
                    sharding_strategy,
                    is_first_iter=not use_no_sync and i == 0,
                    is_last_iter_no_sync=use_no_sync and i == 0,
                )
                ref_num_reduce_scatters = self._get_ref_num_reduce_scatters(
                    num_fsdp, in_no_sync=False
                )
                self.assertEqual(num_all_gathers, ref_num_all_gathers)
                self.assertEqual(num_reduce_scatters, ref_num_reduce_scatters)


class TestExplicitUnshard(FSDPTest):
    world_size = 2

    @parametrize("use_orig_params", [False, True])
    def test_unshard_async(self, use_orig_params: bool) -> None:
        """All-gathers started explicitly with ``_unshard(async_op=True)`` before a
        unit's forward, overlapping another collective, train like DDP."""

        class ReduceModule(nn.Module):
            def __init__(self, dim: int, group: dist.ProcessGroup) -> None:
                super().__init__()
                self.group = group
                self.weight = nn.Parameter(torch.randn(dim, dim))

            def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
                y = F.relu(x @ self.weight)
                # NOTE: This all-reduce is not differentiable and is included
                # to exercise the overlap.
                work = dist.all_reduce(y, group=self.group, async_op=True)
                return y, work

        class MLPs(nn.Module):
            def __init__(self, dim: int) -> None:
                super().__init__()
                self.mlp1 = MLP(dim)
                self.mlp2 = MLP(dim)
                self.mlp3 = MLP(dim)

            def forward(self, ys: list[torch.Tensor], works: list[Any]) -> torch.Tensor:
                (y1, y2, y3), (work1, work2, work3) = ys, works
                work1.wait()
                z1 = self.mlp1(y1)
                work2.wait()
                z2 = self.mlp2(y2)
                work3.wait()
                z3 = self.mlp3(y3)
                return z1 + z2 + z3

        class ReduceModel(nn.Module):
            def __init__(self, dim: int, group: dist.ProcessGroup) -> None:
                super().__init__()
                self.reduce_module1 = ReduceModule(dim, group)
                self.reduce_module2 = ReduceModule(dim, group)
                self.reduce_module3 = ReduceModule(dim, group)
                self.mlps = MLPs(dim)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                y1, work1 = self.reduce_module1(x)
                if isinstance(self.mlps.mlp1, FSDP):
                    self.mlps.mlp1._unshard(async_op=True)
                y2, work2 = self.reduce_module2(x)
                if isinstance(self.mlps.mlp2, FSDP):
                    self.mlps.mlp2._unshard(async_op=True)
                y3, work3 = self.reduce_module3(x)
                if isinstance(self.mlps.mlp3, FSDP):
                    self.mlps.mlp3._unshard(async_op=True)
                return self.mlps([y1, y2, y3], [work1, work2, work3])

        group = self.process_group
        batch_size, dim = 2, 8
        torch.manual_seed(42)
        ref_model = _ddp(ReduceModel(dim, group).to(self.device), self.device)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        torch.manual_seed(42)
        model = ReduceModel(dim, group)
        model.mlps = FSDP(
            model.mlps,
            sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
            auto_wrap_policy=ModuleWrapPolicy((MLP,)),
            device_id=self.device.type,
            use_orig_params=use_orig_params,
        )
        model.mlps.check_is_root()
        mlp_params = set(model.mlps.parameters())
        mlp_param_names = {n for n, p in model.named_parameters() if p in mlp_params}
        DDP._set_params_and_buffers_to_ignore_for_model(model, mlp_param_names)
        model = _ddp(model.to(self.device), self.device)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + self.rank + 1)
        inp = torch.randn((batch_size, dim), device=self.device)
        for _ in range(10):
            losses: list[torch.Tensor] = []
            for _model, _optim in ((ref_model, ref_optim), (model, optim)):
                loss = _model(inp).sum()
                losses.append(loss)
                loss.backward()
                _optim.step()
                _optim.zero_grad()
            self.assertEqual(losses[0], losses[1])
            model.module.mlps._wait_unshard_streams_on_current_stream()


class MLP(nn.Module):
    """``relu(out_proj(relu(in_proj(x))))`` with a hidden width of ``4 * dim``
    (upstream's common ``MLP``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, 4 * dim)
        self.out_proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.out_proj(F.relu(self.in_proj(x))))
