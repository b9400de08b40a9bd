"""Misuse of ``fully_shard`` gets torch's error (type and message, checked on
torch's ``fully_shard`` too) and leaves the process usable: applied twice, a
parameter tied across groups, a child run before its root, parameters and
meshes it cannot shard (a tensor-parallel mesh foreign to the data-parallel
one), and calls that undo the parameters during forward."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.torch_version import TorchVersion

from harness import DistributedTest
from tests.fsdp.fully_shard_cases import IMPLEMENTATIONS, OURS, local_batch, lockstep, model

_TORCH_2_13 = TorchVersion(torch.__version__) >= (2, 13)


class TestFullyShardErrors(DistributedTest):
    world_size = 2

    def _both_raise(
        self, error: type[Exception], regex: str, misuse: Callable[[SimpleNamespace], Any]
    ) -> None:
        for api in IMPLEMENTATIONS:
            with self.assertRaisesRegex(error, regex, msg=api.name):
                misuse(api)

    def test_construction_errors_are_torch_s(self) -> None:
        """What fully_shard refuses, as torch refuses it."""
        cases: dict[str, tuple[type[Exception], str, Callable[[SimpleNamespace], Any]]] = {
            "twice": (AssertionError, "can only be applied to a module once", _twice),
            "scalar parameter": (ValueError, "doesn't support scalar parameters", _scalar),
            "container without forward": (ValueError, "does not support containers", _container),
            "3-D mesh": (ValueError, "expects a 1D or 2D DeviceMesh", self._mesh_3d),
            "unnamed 2-D mesh": (AssertionError, "mesh_dim_names specified", self._mesh_unnamed),
            "reshard to a non-divisor": (
                ValueError,
                "it should be a factor of 2, not 3",
                _reshard_three,
            ),
            "reshard to a string": (ValueError, "should be a bool or an int", _reshard_string),
            "non-contiguous parameter": (
                NotImplementedError,
                "non-contiguous parameters",
                _transposed,
            ),
            "uneven Shard(1)": (NotImplementedError, "uneven sharding on dim 1", _uneven_dim1),
            "mixed original dtypes": (
                AssertionError,
                "uniform original parameter dtype",
                _mixed_dtypes,
            ),
        }
        self.run_subtests({"case": list(cases)}, lambda case: self._both_raise(*cases[case]))

    def _mesh_3d(self, api: SimpleNamespace) -> None:
        api.fully_shard(model(self.device), mesh=init_device_mesh(self.device.type, (2, 1, 1)))

    def _mesh_unnamed(self, api: SimpleNamespace) -> None:
        api.fully_shard(model(self.device), mesh=init_device_mesh(self.device.type, (1, 2)))

    def test_parameter_tied_across_groups(self) -> None:
        """A weight tied between a module sharded on its own and the root: the first
        forward refuses it, naming the parameter (torch 2.13; torch 2.11 has no check)."""
        apis = IMPLEMENTATIONS if _TORCH_2_13 else (OURS,)
        for api in apis:
            net = _Tied().to(self.device)
            api.fully_shard(net.embed)
            api.fully_shard(net)
            with self.assertRaisesRegex(ValueError, "is shared with a parameter already managed"):
                net(torch.arange(4, device=self.device))

    def test_child_run_before_its_root(self) -> None:
        """Running a sharded child's forward first, then the root's, is refused."""

        def misuse(api: SimpleNamespace) -> None:
            net = model(self.device)
            api.fully_shard(net[0])
            api.fully_shard(net)
            net[0](local_batch(self, 0))
            net(local_batch(self, 0))

        self._both_raise(
            RuntimeError, "requires running forward through the root module first", misuse
        )

    def test_reshard_during_forward_fails_cleanly(self) -> None:
        """A forward that reshards its own module midway fails with an error (the
        sharded DTensors are not its computation's tensors), as torch's does; after
        reset_iter_state the module trains as a fresh one."""
        for api in IMPLEMENTATIONS:
            net = _ReshardsItself().to(self.device)
            api.fully_shard(net, reshard_after_forward=True)
            with self.assertRaises(RuntimeError, msg=api.name):
                net(local_batch(self, 0, features=4))
        broken = OURS.fully_shard(_ReshardsItself().to(self.device), reshard_after_forward=True)
        with self.assertRaises(RuntimeError):
            broken(local_batch(self, 0, features=4))
        broken.reset_iter_state()
        broken.misbehave = False
        fresh = OURS.fully_shard(_ReshardsItself(misbehave=False).to(self.device))
        lockstep(
            self, [broken, fresh], steps=2, inputs=lambda step: local_batch(self, step, features=4)
        )

    def test_tensor_parallel_mesh_not_from_the_same_root(self) -> None:
        """A tensor-parallel parameter whose mesh and the data-parallel mesh do not
        come from one device mesh is refused (both meshes span the same ranks)."""

        def misuse(api: SimpleNamespace) -> None:
            net = nn.Linear(4, 4).to(self.device)
            tp_mesh = init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=("tp",))
            dp_mesh = init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=("dp",))
            net.weight = nn.Parameter(distribute_tensor(net.weight.detach(), tp_mesh, [Shard(0)]))
            api.fully_shard(net, mesh=dp_mesh)

        self._both_raise(RuntimeError, "Cannot concatenate", misuse)


def _twice(api: SimpleNamespace) -> None:
    net = model(torch.device("cpu"))
    api.fully_shard(net)
    api.fully_shard(net)


def _scalar(api: SimpleNamespace) -> None:
    net = nn.Linear(2, 2)
    net.scale = nn.Parameter(torch.tensor(1.0))
    api.fully_shard(net)


def _container(api: SimpleNamespace) -> None:
    api.fully_shard(nn.ModuleList([nn.Linear(2, 2)]))


def _reshard_three(api: SimpleNamespace) -> None:
    api.fully_shard(nn.Linear(2, 2), reshard_after_forward=3)


def _reshard_string(api: SimpleNamespace) -> None:
    api.fully_shard(nn.Linear(2, 2), reshard_after_forward="yes")


def _transposed(api: SimpleNamespace) -> None:
    net = nn.Linear(4, 6)
    net.weight = nn.Parameter(torch.randn(4, 6).t())
    api.fully_shard(net)


def _uneven_dim1(api: SimpleNamespace) -> None:
    api.fully_shard(nn.Linear(3, 4), shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)


def _mixed_dtypes(api: SimpleNamespace) -> None:
    net = nn.Linear(2, 2)
    net.bias = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    api.fully_shard(net)
    net(torch.randn(1, 2))


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


class _ReshardsItself(nn.Module):
    def __init__(self, misbehave: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 5)
        self.misbehave = misbehave

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        if self.misbehave:
            self.reshard()  # type: ignore[operator]
        return self.second(x)
