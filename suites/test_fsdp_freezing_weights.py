"""Frozen trunks and autograd turned off for part of the forward (port of upstream
``test_fsdp_freezing_weights.py``, and the family around it).

A model whose trunk runs without autograd inside its ``forward`` (a frozen
feature extractor; the head trains) must train like DDP. Upstream's test crosses
a flat or nested trunk, two ways of freezing it (``requires_grad=False``, or
gradients set to ``None`` after backward), wrapping before or after freezing,
the trunk under ``torch.no_grad()`` or not, and ``forward_prefetch``. With
``forward_prefetch`` the trunk's pre-forward unshards the head: its views are
made while autograd is off, and unless the FSDP makes them with autograd on the
head's gradient never reaches its flat parameter (see [Note: Views are made with
autograd on] in fsdp._orig_params).

``TestAutogradOffFamily`` crosses every way of turning autograd off for the
trunk (``torch.no_grad()``, ``requires_grad=False``, ``.detach()`` of its
output, ``torch.inference_mode()`` with the output cloned, as torch requires)
with ``forward_prefetch``, each ``backward_prefetch``, ``limit_all_gathers``,
every sharding strategy, ``use_orig_params`` and a flat or nested trunk, at
world sizes 2, 3 and 4, and with CPU offload. Torch's FSDP drops the head's
gradient when the head was forward-prefetched under ``torch.inference_mode()``
(the views made there cannot be autograd views): that combination asserts the
defect under torch (``KnownDefects.drops_inference_mode_prefetched_grads``). Two more defects of
torch's show in this family and are asserted likewise: ``zero_grad`` between
forward and backward without a reshard after forward
(``zero_grad_between_forward_and_backward_without_reshard``), and a
``NO_SHARD`` unit whose output is detached, prefetched in backward, whose
original parameters vanish from ``parameters()``
(``prefetched_unit_without_backward_hides_params``).
"""

from __future__ import annotations

import contextlib
import copy
import enum
import itertools
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdptest import FSDPTest
from fsdptest.api import (
    ADAPTER,
    FSDP,
    BackwardPrefetch,
    CPUOffload,
    ShardingStrategy,
    assert_torch_refuses_cpu_offload,
    torch_refuses_cpu_offload,
)
from harness import current_device

# -- upstream's test ------------------------------------------------------------------------------


class Model(nn.Module):
    """Upstream's flat trunk: one convolution, pooled, then a linear head."""

    def __init__(self, with_fsdp: bool, freeze_after_wrap_fsdp: bool, disable_autograd: bool):
        super().__init__()
        self.trunk: nn.Module = nn.Sequential(
            nn.Conv2d(3, 64, kernel_size=3),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(output_size=(1, 1)),
            nn.Flatten(),
        )
        self.head: nn.Module = nn.Linear(64, 10)
        self.autograd_ctx = torch.no_grad if disable_autograd else contextlib.nullcontext
        if with_fsdp and freeze_after_wrap_fsdp:
            self.fsdp_wrap()

    def fsdp_wrap(self, **fsdp_kwargs: object) -> None:
        self.trunk = FSDP(self.trunk, **fsdp_kwargs)
        self.head = FSDP(self.head, **fsdp_kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.autograd_ctx():
            x = self.trunk(x)
        return self.head(x)


class NestedTrunkModel(nn.Module):
    """Upstream's nested trunk: two convolution blocks, each a unit of its own."""

    def __init__(self, with_fsdp: bool, freeze_after_wrap_fsdp: bool, disable_autograd: bool):
        super().__init__()
        self.trunk: nn.Module = nn.Sequential(self._create_block(3, 64), self._create_block(64, 64))
        self.head: nn.Module = nn.Sequential(
            nn.AdaptiveAvgPool2d(output_size=(1, 1)), nn.Flatten(), nn.Linear(64, 10)
        )
        self.autograd_ctx = torch.no_grad if disable_autograd else contextlib.nullcontext
        if with_fsdp and freeze_after_wrap_fsdp:
            self.fsdp_wrap()

    def fsdp_wrap(self, **fsdp_kwargs: object) -> None:
        for name, child in self.trunk.named_children():
            setattr(self.trunk, name, FSDP(child, **fsdp_kwargs))
        self.trunk = FSDP(self.trunk, **fsdp_kwargs)
        self.head = FSDP(self.head, **fsdp_kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.autograd_ctx():
            x = self.trunk(x)
        return self.head(x)

    @staticmethod
    def _create_block(in_channels: int, out_channels: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(in_channels, out_channels, kernel_size=3), nn.ReLU(True))


class FreezingMethod(str, enum.Enum):
    GradToNone = "grad_to_none"
    RequiresGrad = "requires_grad"


def _ddp(module: nn.Module, find_unused_parameters: bool) -> DDP:
    device = current_device()
    ids = [device.index] if device.type == "cuda" else None
    return DDP(module, device_ids=ids, find_unused_parameters=find_unused_parameters)


class TestFreezingWeights(FSDPTest):
    """A frozen trunk, its output computed with or without autograd, trains the
    head exactly as DDP does (upstream's 32 configurations)."""

    world_size = 2

    def _create_model(
        self,
        with_fsdp: bool,
        with_nested_trunk: bool,
        freeze_after_wrap_fsdp: bool,
        disable_autograd: bool,
        fsdp_kwargs: dict[str, object],
    ) -> nn.Module:
        cls = NestedTrunkModel if with_nested_trunk else Model
        model = cls(False, False, disable_autograd)
        if with_fsdp and freeze_after_wrap_fsdp:
            model.fsdp_wrap(**fsdp_kwargs)
        return model

    def _dist_train(
        self,
        with_nested_trunk: bool,
        freezing_method: FreezingMethod,
        freeze_after_wrap_fsdp: bool,
        with_fsdp: bool,
        disable_autograd: bool,
        forward_prefetch: bool,
    ) -> list[torch.Tensor]:
        torch.manual_seed(0)
        batch = torch.randn(size=(2, 3, 224, 224), device=self.device)
        fsdp_kwargs: dict[str, object] = {
            "device_id": self.device,
            "forward_prefetch": forward_prefetch,
        }
        model = self._create_model(
            with_fsdp, with_nested_trunk, freeze_after_wrap_fsdp, disable_autograd, fsdp_kwargs
        ).to(self.device)
        if freezing_method == FreezingMethod.RequiresGrad:
            for param in model.trunk.parameters():
                param.requires_grad = False
        if with_fsdp:
            if not freeze_after_wrap_fsdp:
                model.fsdp_wrap(**fsdp_kwargs)
            model = FSDP(model, **fsdp_kwargs)
        else:
            model = _ddp(model, find_unused_parameters=disable_autograd)
        target = torch.tensor([0, 1], dtype=torch.long, device=self.device)
        criterion = nn.CrossEntropyLoss()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(3):
            out = model(batch)
            fake_loss = criterion(out, target)
            optimizer.zero_grad()
            fake_loss.backward()
            if freezing_method == FreezingMethod.GradToNone:
                for param in model.module.trunk.parameters():
                    param.grad = None
            optimizer.step()
        if with_fsdp:
            with FSDP.summon_full_params(model):
                return [p.detach().clone() for p in model.parameters()]
        return [p.detach().clone() for p in model.parameters()]

    @pytest.mark.parametrize("forward_prefetch", [False, True])
    @pytest.mark.parametrize("disable_autograd", [True, False])
    @pytest.mark.parametrize("freeze_after_wrap_fsdp", [True, False])
    @pytest.mark.parametrize(
        "freezing_method", [FreezingMethod.RequiresGrad, FreezingMethod.GradToNone]
    )
    @pytest.mark.parametrize("with_nested_trunk", [True, False])
    def test_freezing_weights(
        self,
        with_nested_trunk: bool,
        freezing_method: FreezingMethod,
        freeze_after_wrap_fsdp: bool,
        disable_autograd: bool,
        forward_prefetch: bool,
    ) -> None:
        """FSDP's parameters after three SGD steps equal DDP's."""
        config = (with_nested_trunk, freezing_method, freeze_after_wrap_fsdp)
        ddp_state = self._dist_train(*config, False, disable_autograd, forward_prefetch)
        fsdp_state = self._dist_train(*config, True, disable_autograd, forward_prefetch)
        self.assertEqual(
            ddp_state,
            fsdp_state,
            exact_device=True,
            msg="FullyShardedDataParallel states didn't match PyTorch DDP states",
        )


# -- the family: every way autograd is off for a part of the forward ------------------------------


class AutogradOff(enum.Enum):
    """How the trunk's part of the forward runs without autograd."""

    NO_GRAD = "torch.no_grad()"
    REQUIRES_GRAD_FALSE = "requires_grad=False"
    DETACH = ".detach() of its output"
    INFERENCE_MODE = "torch.inference_mode(), output cloned"

    def region(self) -> contextlib.AbstractContextManager[object]:
        if self is AutogradOff.NO_GRAD:
            return torch.no_grad()
        if self is AutogradOff.INFERENCE_MODE:
            return torch.inference_mode()
        return contextlib.nullcontext()

    def leaves_params_unused(self) -> bool:
        """The trunk's parameters need gradients that no backward computes."""
        return self is not AutogradOff.REQUIRES_GRAD_FALSE


class TrunkAndHead(nn.Module):
    """A small convolutional trunk (one block, or ``nested``: two) and a linear
    head; ``off`` says how the trunk runs without autograd."""

    def __init__(self, nested: bool, off: AutogradOff) -> None:
        super().__init__()
        blocks = [nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())]
        if nested:
            blocks.append(nn.Sequential(nn.Conv2d(4, 4, 3), nn.ReLU()))
        self.trunk: nn.Module = nn.Sequential(*blocks)
        self.head: nn.Module = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
        self.off = off
        if off is AutogradOff.REQUIRES_GRAD_FALSE:
            self.trunk.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.off.region():
            x = self.trunk(x)
        if self.off is AutogradOff.DETACH:
            x = x.detach()
        elif self.off is AutogradOff.INFERENCE_MODE:
            x = x.clone()  # an inference tensor cannot be saved for backward
        return self.head(x)

    def wrap(self, nested: bool, **kwargs: object) -> nn.Module:
        """Each trunk block (``nested``) or the trunk a unit, the head a unit, the root."""
        if nested:
            for name, block in self.trunk.named_children():
                setattr(self.trunk, name, FSDP(block, **kwargs))
        self.trunk = FSDP(self.trunk, **kwargs)
        self.head = FSDP(self.head, **kwargs)
        return FSDP(self, **kwargs)


class Trained:
    """A model's losses over three SGD steps; ``zero_grad_between``: each step's
    ``zero_grad`` comes between its forward and its backward (upstream's order),
    else first."""

    STEPS = 3

    def __init__(
        self, model: nn.Module, rank: int, device: torch.device, zero_grad_between: bool = False
    ) -> None:
        self.losses: list[torch.Tensor] = []
        optim = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        generator = torch.Generator().manual_seed(rank)
        for _ in range(self.STEPS):
            batch = torch.randn(2, 3, 7, 7, generator=generator).to(device)
            if not zero_grad_between:
                optim.zero_grad()
            loss = model(batch).square().sum()
            if zero_grad_between:
                optim.zero_grad()
            loss.backward()
            optim.step()
            self.losses.append(loss.detach())


_STRATEGIES = list(ShardingStrategy)
_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
_PREFETCHES = [None, BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST]


class AutogradOffParity:
    """The body the family's tests share; the DDP reference of each model is
    trained once per test (it depends on the model alone)."""

    rank: int
    device: torch.device

    def _reference(self, nested: bool, off: AutogradOff) -> tuple[Trained, list[torch.Tensor]]:
        """DDP's losses and parameters (the order of ``zero_grad`` does not matter
        to DDP: its gradients are the parameters' own)."""
        cache: dict[tuple[bool, AutogradOff], tuple[Trained, list[torch.Tensor]]]
        cache = self.__dict__.setdefault("_references", {})
        if (nested, off) not in cache:
            torch.manual_seed(0)
            model = TrunkAndHead(nested, off).to(self.device)
            ddp = _ddp(copy.deepcopy(model), off.leaves_params_unused())
            trained = Trained(ddp, self.rank, self.device)
            cache[(nested, off)] = (trained, [p.detach().clone() for p in ddp.parameters()])
        return cache[(nested, off)]

    def _hybrid_mesh(self) -> DeviceMesh:
        """Replicas x shard group (two replicas of two at four ranks, else one);
        manual wrapping with a hybrid strategy needs one. Built once per test."""
        if "_mesh" not in self.__dict__:
            world = dist.get_world_size()
            shape = (2, world // 2) if world % 2 == 0 and world > 2 else (1, world)
            self.__dict__["_mesh"] = init_device_mesh(self.device.type, shape)
        mesh: DeviceMesh = self.__dict__["_mesh"]
        return mesh

    def _check(
        self,
        off: AutogradOff,
        nested: bool,
        zero_grad_between: bool = False,
        **fsdp_kwargs: object,
    ) -> None:
        reference, expected = self._reference(nested, off)
        if fsdp_kwargs["sharding_strategy"] in _HYBRID:
            fsdp_kwargs["device_mesh"] = self._hybrid_mesh()
        torch.manual_seed(0)
        model = TrunkAndHead(nested, off).to(self.device)
        fsdp = model.wrap(nested, device_id=self.device, **fsdp_kwargs)
        trained = Trained(fsdp, self.rank, self.device, zero_grad_between)
        with FSDP.summon_full_params(fsdp):
            params = [p.detach().clone() for p in fsdp.parameters()]
        if zero_grad_between and _torch_loses_zero_grad_between(fsdp_kwargs):
            self.assertNotEqual(trained.losses[-1], reference.losses[-1], msg=_NO_LONGER_LOST)
            return
        if _torch_hides_params_of_unit_without_backward(off, fsdp_kwargs):
            self.assertLess(len(params), len(expected), msg=_NO_LONGER_HIDDEN)
            return
        if _torch_drops_head_grads(off, fsdp_kwargs):
            heads = zip(params[-2:], expected[-2:])
            assert any(not torch.equal(p, e) for p, e in heads), (
                "torch's FSDP trained the head right under inference_mode with forward "
                "prefetch: KnownDefects.drops_inference_mode_prefetched_grads no longer holds"
            )
            return
        torch.testing.assert_close(trained.losses, reference.losses)
        torch.testing.assert_close(params, expected)


def _torch_drops_head_grads(off: AutogradOff, fsdp_kwargs: dict[str, object]) -> bool:
    defect = ADAPTER.known_defects.drops_inference_mode_prefetched_grads
    return defect and off is AutogradOff.INFERENCE_MODE and bool(fsdp_kwargs["forward_prefetch"])


_NO_LONGER_LOST = (
    "torch's FSDP trained right with zero_grad between forward and backward: "
    "KnownDefects.zero_grad_between_forward_and_backward_without_reshard no longer holds"
)
_NO_RESHARD = (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2)


def _torch_loses_zero_grad_between(fsdp_kwargs: dict[str, object]) -> bool:
    defect = ADAPTER.known_defects.zero_grad_between_forward_and_backward_without_reshard
    without_reshard = fsdp_kwargs["sharding_strategy"] in _NO_RESHARD
    return defect and without_reshard and bool(fsdp_kwargs["use_orig_params"])


_NO_LONGER_HIDDEN = (
    "torch's FSDP listed every parameter of a backward-prefetched unit whose backward "
    "never ran: KnownDefects.prefetched_unit_without_backward_hides_params no longer holds"
)


def _torch_hides_params_of_unit_without_backward(
    off: AutogradOff, fsdp_kwargs: dict[str, object]
) -> bool:
    defect = ADAPTER.known_defects.prefetched_unit_without_backward_hides_params
    no_shard = fsdp_kwargs["sharding_strategy"] is ShardingStrategy.NO_SHARD
    prefetch = fsdp_kwargs.get("backward_prefetch", BackwardPrefetch.BACKWARD_PRE) is not None
    orig = bool(fsdp_kwargs["use_orig_params"])
    return defect and off is AutogradOff.DETACH and no_shard and prefetch and orig


def _cross(off: AutogradOff, forward_prefetch: bool) -> Iterator[dict[str, object]]:
    """Every strategy x use_orig_params x nesting x backward prefetch x
    limit_all_gathers."""
    for values in itertools.product(
        _STRATEGIES, [False, True], [False, True], _PREFETCHES, [True, False]
    ):
        keys = ("sharding_strategy", "use_orig_params", "nested")
        keys += ("backward_prefetch", "limit_all_gathers")
        yield dict(zip(keys, values), off=off, forward_prefetch=forward_prefetch)


class TestAutogradOffFamily(AutogradOffParity, FSDPTest):
    """A trunk without autograd before a trained head trains like DDP for every
    way of turning autograd off, crossed with every prefetch, rate limit,
    sharding strategy, ``use_orig_params`` and nesting (two ranks)."""

    world_size = 2

    @pytest.mark.parametrize(
        "forward_prefetch", [False, True], ids=["no_forward_prefetch", "forward_prefetch"]
    )
    @pytest.mark.parametrize("off", list(AutogradOff), ids=lambda off: off.name.lower())
    def test_trunk_without_autograd_trains_like_ddp(
        self, off: AutogradOff, forward_prefetch: bool
    ) -> None:
        """Losses and parameters equal DDP's in all 120 configurations (each way
        autograd is off, with and without forward prefetch: 240)."""
        configs = list(_cross(off, forward_prefetch))
        self.run_subtests({"config": configs}, lambda config: self._check(**config))


class TestZeroGradBetweenForwardAndBackward(AutogradOffParity, FSDPTest):
    """Upstream's order of calls (forward, ``zero_grad``, backward, step) trains
    as DDP does for every strategy, ``use_orig_params`` and way autograd is off.
    Torch's FSDP trains wrong there without a reshard after forward
    (``SHARD_GRAD_OP``, ``_HYBRID_SHARD_ZERO2``) with ``use_orig_params``, autograd
    on or off: asserted as ``KnownDefects.zero_grad_between_forward_and_backward_without_reshard``."""

    world_size = 2

    def test_zero_grad_between_forward_and_backward(self) -> None:
        self.run_subtests(
            {
                "off": list(AutogradOff),
                "sharding_strategy": _STRATEGIES,
                "use_orig_params": [False, True],
            },
            lambda **config: self._check(
                nested=True, zero_grad_between=True, forward_prefetch=True, **config
            ),
        )


class AutogradOffAtWorldSize(AutogradOffParity, FSDPTest):
    """The family at more ranks (ranks that hold only padding of the head's flat
    parameter; hybrid shard groups of the whole world): every way autograd is off
    x forward prefetch x every strategy x use_orig_params, nested trunks."""

    @pytest.mark.parametrize("off", list(AutogradOff), ids=lambda off: off.name.lower())
    def test_trunk_without_autograd_trains_like_ddp(self, off: AutogradOff) -> None:
        """Losses and parameters equal DDP's in all 20 configurations (80 over
        the ways autograd is off)."""
        self.run_subtests(
            {
                "off": [off],
                "forward_prefetch": [False, True],
                "sharding_strategy": _STRATEGIES,
                "use_orig_params": [False, True],
            },
            lambda **config: self._check(nested=True, **config),
        )


class TestAutogradOffThreeRanks(AutogradOffAtWorldSize):
    world_size = 3


class TestAutogradOffFourRanks(AutogradOffAtWorldSize):
    world_size = 4


class TestAutogradOffOffload(AutogradOffParity, FSDPTest):
    """With parameters offloaded to the CPU: every way autograd is off x forward
    prefetch x every strategy x use_orig_params x nesting."""

    world_size = 2

    def test_trunk_without_autograd_with_offload(self) -> None:
        """Losses and parameters equal DDP's in all 160 configurations."""
        offload = CPUOffload(offload_params=True)
        if torch_refuses_cpu_offload(offload):
            assert_torch_refuses_cpu_offload(self, nn.Linear(2, 2), 2)
            return
        self.run_subtests(
            {
                "off": list(AutogradOff),
                "forward_prefetch": [False, True],
                "sharding_strategy": _STRATEGIES,
                "use_orig_params": [False, True],
                "nested": [False, True],
            },
            lambda **config: self._check(cpu_offload=offload, **config),
        )
