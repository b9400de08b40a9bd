"""What the ported upstream files leave open: gradients the user edits before the
optimizer step, ``clip_grad_norm_`` on hybrid meshes, and the memory and
all-gathers each sharding strategy has after forward.

- ``TestGradientEdits``: between backward and the optimizer step the user
  scales gradients in place, replaces them, replaces their ``.data``, drops a
  unit's gradients, or sets every gradient after ``zero_grad(set_to_none=True)``;
  the same edit on DDP must give the same parameters, after the step, after a
  second backward that accumulates onto the edited gradients, and after a third
  step that starts from ``zero_grad(set_to_none=True)``. With and without
  ``use_orig_params`` (without it the user edits the flat parameters'
  gradients: every edit here is elementwise, so it means the same on DDP's).
- ``TestClipGradNormHybrid``: ``clip_grad_norm_`` on ``HYBRID_SHARD`` and
  ``_HYBRID_SHARD_ZERO2`` units over explicit meshes (``suites/test_clip_grad_norm.py``
  covers the other strategies), world sizes 2 and 4 (1 x W, 2 x 2, W x 1),
  against ``nn.utils.clip_grad_norm_`` on DDP after the step. Torch's FSDP has
  the one-rank shard group defect of ``suites/test_hybrid_replicas.py``: on a
  W x 1 mesh its replicas drift from DDP, which is asserted for it.
- ``TestMemoryAndAllGathers``: bytes each rank holds (``harness.memory``) when
  built, after forward, after backward, after ``zero_grad(set_to_none=True)``
  and after a second forward, and all-gathers per forward and backward, for
  every sharding strategy (hybrid ones on 1 x W and 2 x 2 meshes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdptest import FSDPTest
from fsdptest.api import FSDP, NO_RESHARD_AFTER_FORWARD_STRATEGIES, ShardingStrategy
from fsdptest.parity import REORDERED_FP32
from harness import current_device
from harness.collectives import Collective, CollectiveRecorder
from harness.memory import MemoryMeter
from suites.test_clip_grad_norm import (
    NORM_ATOL,
    NORM_RTOL,
    _full_params,
    _loss,
    _same_on_every_rank,
)
from suites.test_clip_grad_norm import (
    _ddp as _ddp_of,
)
from suites.test_clip_grad_norm import (
    _net as _clip_net,
)
from suites.test_hybrid_replicas import ProcessGroups, _mesh, _torch_defect

HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
NON_HYBRID = (
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.NO_SHARD,
)


def _net() -> nn.Sequential:
    """Units 0 and 2 become inner units, the root holds 4 (elements: 104, 154,
    60; not divisible by 2 or 4)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 11), nn.Tanh(), nn.Linear(11, 5)
    ).to(current_device())


def _wrap(**kwargs: object) -> FSDP:
    net = _net()
    for i in (0, 2):
        net[i] = FSDP(net[i], **kwargs)
    return FSDP(net, **kwargs)


def _input(rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 7, generator=generator).to(current_device())


# -- gradient edits ------------------------------------------------------------------------


def _scale_in_place(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(0.5)


def _assign_new(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad = p.grad * 2 + 1


def _assign_data(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad.data = p.grad.data * 3 - 0.5


def _drop_first_unit(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    """The first Linear's gradients (FSDP: its unit's) become None."""
    for p in model.module[0].parameters():
        p.grad = None


def _set_after_zero_grad(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    optim.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)


EDITS: dict[str, Callable[[nn.Module, torch.optim.Optimizer], None]] = {
    "scale_in_place": _scale_in_place,
    "assign_new": _assign_new,
    "assign_data": _assign_data,
    "drop_first_unit": _drop_first_unit,
    "set_after_zero_grad": _set_after_zero_grad,
}


class TestGradientEdits(FSDPTest):
    def test_edited_gradients_step_like_ddp(self) -> None:
        """Every edit x strategy x use_orig_params: parameters equal DDP's after
        each of three steps (the second accumulates onto the edited gradients)."""
        config = {
            "edit": list(EDITS),
            "sharding_strategy": list(NON_HYBRID),
            "use_orig_params": [False, True],
        }
        self.run_subtests(config, self._check_edit)

    def _check_edit(
        self, edit: str, sharding_strategy: ShardingStrategy, use_orig_params: bool
    ) -> None:
        model = _wrap(sharding_strategy=sharding_strategy, use_orig_params=use_orig_params)
        reference = _ddp(_net())
        models: tuple[nn.Module, nn.Module] = (model, reference)
        optims = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
        for step in range(3):
            for m, optim in zip(models, optims):
                m(_input(self.rank, step)).sum().backward()
                EDITS[edit](m, optim)
                optim.step()
                if step == 1:
                    optim.zero_grad(set_to_none=True)
            # Accumulation onto the edited gradients adds in another order than
            # DDP's all-reduce of the local sum: fp32 defaults.
            self.assertEqual(
                _full_params(model),
                {n: p.detach() for n, p in reference.module.named_parameters()},
                f"after step {step + 1}",
                rtol=REORDERED_FP32.rtol,
                atol=REORDERED_FP32.atol,
            )


def _ddp(module: nn.Module) -> DDP:
    device = current_device()
    return DDP(module, device_ids=[device.index] if device.type == "cuda" else None)


# -- clip_grad_norm_ on hybrid meshes ------------------------------------------------------------


class _ClipGradNormHybrid(FSDPTest):
    def _meshes(self) -> dict[int, ProcessGroups]:
        """Built once per test: a gloo group holds sockets and threads until the test ends."""
        replicas = sorted({1, 2, self.world_size})
        return {r: _mesh(self.world_size, self.rank, r) for r in replicas}

    def test_hybrid_total_norm_and_clipped_step_equal_ddp(self) -> None:
        """Every max_norm x norm type x hybrid strategy x use_orig_params x mesh."""
        config = {
            "max_norm": [0.1, 2.5],
            "norm_type": [1.0, 2.0, math.inf],
            "sharding_strategy": list(HYBRID),
            "use_orig_params": [False, True],
            "replicas": sorted({1, 2, self.world_size}),
        }
        self.run_subtests(config, self._check_parity, self._meshes())

    def _check_parity(
        self,
        meshes: dict[int, ProcessGroups],
        max_norm: float,
        norm_type: float,
        sharding_strategy: ShardingStrategy,
        use_orig_params: bool,
        replicas: int,
    ) -> None:
        kwargs = {
            "process_group": meshes[replicas],
            "sharding_strategy": sharding_strategy,
            "use_orig_params": use_orig_params,
        }
        net = _clip_net().to(current_device())
        for i in range(2):
            net[i] = FSDP(net[i], **kwargs)
        model = FSDP(net, **kwargs)
        reference = _ddp_of(_clip_net())
        for m in (model, reference):
            _loss(m, self.rank).backward()
        total = model.clip_grad_norm_(max_norm, norm_type)
        expected = nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
        self.assertGreater(expected.item(), max_norm, "the gradients were not clipped")
        for m in (model, reference):
            torch.optim.SGD(m.parameters(), lr=0.1).step()
        full = _full_params(model)
        ddp_params = {n: p.detach() for n, p in reference.module.named_parameters()}
        if _torch_defect(replicas, self.world_size):
            # Each rank clips and steps with its own, unreduced gradient.
            self.assertNotEqual(full, ddp_params, rtol=0, atol=0)
            return
        self.assertEqual(total, expected, rtol=NORM_RTOL, atol=NORM_ATOL)
        _same_on_every_rank(self, total)
        # The clip coefficients differ by the norm's rounding: fp32 defaults.
        self.assertEqual(full, ddp_params, rtol=REORDERED_FP32.rtol, atol=REORDERED_FP32.atol)


class TestClipGradNormHybridWorld2(_ClipGradNormHybrid):
    world_size = 2


class TestClipGradNormHybridWorld4(_ClipGradNormHybrid):
    world_size = 4


# -- memory and all-gathers after forward --------------------------------------------------------

PHASES = ("built", "after forward", "after backward", "zeroed", "after second forward")


def _units(model: FSDP) -> Iterator[FSDP]:
    return (m for m in FSDP.fsdp_modules(model) if m._handle is not None)


def _bytes(numel: int, element_size: int = 4) -> int:
    return numel * element_size


class _MemoryAndAllGathers(FSDPTest):
    def _meshes(self) -> dict[int, ProcessGroups]:
        replicas = [1, 2] if self.world_size == 4 else [1]
        return {r: _mesh(self.world_size, self.rank, r) for r in replicas}

    def test_bytes_held_and_all_gathers_per_phase(self) -> None:
        """Every strategy (hybrid ones on each mesh) x use_orig_params: the
        bytes each phase holds and the all-gathers of each forward and backward."""
        configs = [(s, None) for s in NON_HYBRID]
        configs += [(s, r) for s in HYBRID for r in self._meshes()]
        self._unmeasured_round()
        self.run_subtests(
            {"strategy_and_replicas": configs, "use_orig_params": [False, True]},
            self._check,
            self._meshes(),
        )

    def _unmeasured_round(self) -> None:
        """[Note: An unmeasured round first]
        On NCCL ranks the first measured configuration of a pooled rank has
        measured up to five 1.27 kB blocks fewer after forward than expected
        (docs/runs/gpu-runs.md, runs 24–28 and 36): bytes an earlier test left that
        were freed during the measured forward, although the meter's baseline
        waited for the count to hold still; every later configuration, which
        follows one on the same groups, measured exactly. One round of the
        default group's first configuration (a forward and a backward) runs
        unmeasured before the measured ones, so that the first measured forward
        follows collectives of its own kind as every later one does."""
        model = _wrap(sharding_strategy=NON_HYBRID[0])
        model(_input(self.rank, 0)).sum().backward()
        del model

    def _check(
        self,
        meshes: dict[int, ProcessGroups],
        strategy_and_replicas: tuple[ShardingStrategy, int | None],
        use_orig_params: bool,
    ) -> None:
        sharding_strategy, replicas = strategy_and_replicas
        kwargs: dict[str, object] = {
            "sharding_strategy": sharding_strategy,
            "use_orig_params": use_orig_params,
        }
        if replicas is not None:
            kwargs["process_group"] = meshes[replicas]
        inp = _input(self.rank, 0)
        activations = self._activations(inp)
        meter = MemoryMeter(self.device)
        gathers: dict[str, int] = {}
        with meter.measuring():
            model = _wrap(**kwargs)
            meter.mark("built")
            with CollectiveRecorder((Collective.ALL_GATHER,)) as recorder:
                out = model(inp).sum()
            gathers["forward"] = len(recorder.of(Collective.ALL_GATHER))
            meter.mark("after forward")
            with CollectiveRecorder((Collective.ALL_GATHER,)) as recorder:
                out.backward()
            gathers["backward"] = len(recorder.of(Collective.ALL_GATHER))
            del out
            meter.mark("after backward")
            model.zero_grad(set_to_none=True)
            meter.mark("zeroed")
            with CollectiveRecorder((Collective.ALL_GATHER,)) as recorder:
                out = model(inp).sum()
            gathers["second forward"] = len(recorder.of(Collective.ALL_GATHER))
            meter.mark("after second forward")
            out.backward()  # a forward left without its backward keeps the model alive
            del out
        held = meter.held()
        start = held["built"] - self._local_shard_bytes(model)
        measured = {k: v - start for k, v in held.items()}
        self.assertEqual(
            measured, self._expected_bytes(model, activations, use_orig_params), rtol=0, atol=0
        )
        self.assertEqual(gathers, self._expected_gathers(model), rtol=0, atol=0)

    def _activations(self, inp: torch.Tensor) -> int:
        """Bytes forward's output and saved tensors take in the unwrapped model."""
        net = _net()
        meter = MemoryMeter(self.device)
        with meter.measuring():
            meter.mark("before")
            out = net(inp).sum()
            meter.mark("after")
            del out
        held = meter.held()
        return held["after"] - held["before"]

    def _local_shard_bytes(self, model: FSDP) -> int:
        return sum(_bytes(u._handle.flat_param._sharded_size.numel()) for u in _units(model))

    def _kept_after_forward(self, model: FSDP) -> int:
        """Unsharded parameters kept from forward to backward: every unit's for
        the strategies that do not reshard after forward, else the root's;
        none for units that do not shard (their parameter is whole)."""
        kept = 0
        for unit in _units(model):
            if unit.world_size == 1 or unit.sharding_strategy is ShardingStrategy.NO_SHARD:
                continue
            no_reshard = unit.sharding_strategy in NO_RESHARD_AFTER_FORWARD_STRATEGIES
            if no_reshard or unit is model:
                kept += _bytes(unit._handle.flat_param._padded_unsharded_size.numel())
        return kept

    def _expected_bytes(
        self, model: FSDP, activations: int, use_orig_params: bool
    ) -> dict[str, int]:
        """The shards; forward adds its activations and the kept unsharded
        parameters; backward leaves the shards and sharded gradients (of the
        shards' size), which ``zero_grad(set_to_none=True)`` frees. With
        ``use_orig_params`` it clears the original parameters' gradients, and
        the flat gradient goes in the next forward (torch's FSDP resets it in
        each unit's pre-forward)."""
        shards = self._local_shard_bytes(model)
        forward = shards + activations + self._kept_after_forward(model)
        zeroed = 2 * shards if use_orig_params else shards
        values = (shards, forward, 2 * shards, zeroed, forward)
        return dict(zip(PHASES, values))

    def _expected_gathers(self, model: FSDP) -> dict[str, int]:
        """One all-gather per sharded unit in each forward; in backward again for
        those that freed their parameter after forward (all but the root)."""
        sharded = [u for u in _units(model) if u.world_size > 1]
        sharded = [u for u in sharded if u.sharding_strategy is not ShardingStrategy.NO_SHARD]
        regather = [
            u
            for u in sharded
            if u is not model and u.sharding_strategy not in NO_RESHARD_AFTER_FORWARD_STRATEGIES
        ]
        return {
            "forward": len(sharded),
            "backward": len(regather),
            "second forward": len(sharded),
        }


class TestMemoryAndAllGathersWorld2(_MemoryAndAllGathers):
    world_size = 2


class TestMemoryAndAllGathersWorld4(_MemoryAndAllGathers):
    world_size = 4
