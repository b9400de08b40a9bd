"""FSDP2's errors and warnings: bad modules, meshes and arguments are refused with
the messages upstream's tests name, before anything is sharded; misuse of the
``FSDPModule`` methods is refused; each rank raises by itself, and the ranks stay
in step afterwards (the next collective succeeds). Facts from upstream's
``test_fully_shard_init.py``, ``test_fully_shard_state.py`` and
``test_fully_shard_training.py``.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from fsdptest.api import FSDP2, fully_shard, register_fsdp_forward_method
from models import MLP
from suites.fsdp2.helpers import FSDP2Test, batch, mlp_stack, shard_each


class TestFullyShardErrors(FSDP2Test):
    def tearDown(self) -> None:
        """Every rank raised alone: the group is still in step."""
        ones = torch.ones(1, device=self.device)
        dist.all_reduce(ones)
        self.assertEqual(ones.item(), float(self.world_size))

    def test_fully_shard_unsupported_module_cls(self) -> None:
        """Containers without a forward are refused: ValueError."""
        self.run_subtests({"container": ["ModuleList", "ModuleDict"]}, self._container)

    def _container(self, container: str) -> None:
        mlps = [MLP(4) for _ in range(2)]
        module = nn.ModuleList(mlps) if container == "ModuleList" else nn.ModuleDict({"a": mlps[0]})
        regex = r"fully\_shard does not support containers that do not implement forward"
        with self.assertRaisesRegex(ValueError, regex):
            fully_shard(module)

    def test_fully_shard_reapply(self) -> None:
        """A second ``fully_shard`` on the same module is refused."""
        model = MLP(4)
        fully_shard(model)
        regex = "Each distinct composable distributed API can only be applied to a module once"
        with self.assertRaisesRegex(AssertionError, regex):
            fully_shard(model)

    def test_fully_shard_deepcopy(self) -> None:
        """A sharded module cannot be deep-copied (use a state dict)."""
        model = MLP(4)
        fully_shard(model)
        with self.assertRaisesRegex(AssertionError, "FSDP does not support deepcopy"):
            copy.deepcopy(model)

    def test_mesh_of_three_dims_raises(self) -> None:
        """Only 1-D (FSDP) and 2-D (HSDP) meshes are accepted."""
        mesh = init_device_mesh(
            self.device_type, (1, 1, self.world_size), mesh_dim_names=("a", "b", "c")
        )
        with self.assertRaisesRegex(ValueError, "fully_shard expects a 1D or 2D DeviceMesh"):
            fully_shard(MLP(4), mesh=mesh)

    def test_2d_mesh_without_names_raises(self) -> None:
        """An HSDP mesh must name its dimensions."""
        mesh = init_device_mesh(self.device_type, (1, self.world_size))
        regex = "Please init the 2D mesh for HSDP with mesh_dim_names specified"
        with self.assertRaisesRegex(AssertionError, regex):
            fully_shard(MLP(4), mesh=mesh)

    def test_reshard_after_forward_not_a_factor(self) -> None:
        """An int ``reshard_after_forward`` must divide the shard dimension's size."""
        bad = [0, -1, self.world_size + 1, 2 * self.world_size]
        self.run_subtests({"reshard_after_forward": bad}, self._not_a_factor)

    def _not_a_factor(self, reshard_after_forward: int) -> None:
        with self.assertRaisesRegex(ValueError, f"factor of {self.world_size}"):
            fully_shard(MLP(4), reshard_after_forward=reshard_after_forward)

    def test_reshard_after_forward_wrong_type(self) -> None:
        """Neither a bool nor an int: refused."""
        self.run_subtests({"reshard_after_forward": ["yes", 1.5, [True]]}, self._wrong_type)

    def _wrong_type(self, reshard_after_forward: object) -> None:
        with self.assertRaisesRegex(ValueError, "reshard_after_forward should be a bool or an int"):
            fully_shard(MLP(4), reshard_after_forward=reshard_after_forward)

    def test_scalar_parameter_raises(self) -> None:
        """A 0-dimensional parameter cannot be sharded on dim 0."""
        module = nn.Linear(3, 3)
        module.scale = nn.Parameter(torch.tensor(2.0))
        with self.assertRaisesRegex(ValueError, "doesn't support scalar parameters"):
            fully_shard(module)

    def test_shard_dim_beyond_the_parameter_raises(self) -> None:
        """A ``shard_placement_fn`` naming a dimension the parameter lacks
        (``Shard(1)`` of a 1-D norm weight) is refused with an AssertionError
        naming the dimension and the parameter's rank, not an IndexError."""
        with self.assertRaisesRegex(AssertionError, "Shard dim 1 is invalid for 1D tensor"):
            fully_shard(nn.LayerNorm(6), shard_placement_fn=lambda param: Shard(1))

    def test_set_reshard_after_forward_wrong_type(self) -> None:
        """``FSDPModule.set_reshard_after_forward`` takes a bool only."""
        model = MLP(4)
        fully_shard(model)
        with self.assertRaisesRegex(ValueError, "reshard_after_forward should be a bool"):
            model.set_reshard_after_forward(2)

    def test_prefetch_targets_must_be_fsdp_modules(self) -> None:
        """``set_modules_to_forward_prefetch`` and ``..._backward_prefetch`` take
        sharded modules only."""
        self.run_subtests({"direction": ["forward", "backward"]}, self._prefetch_target)

    def _prefetch_target(self, direction: str) -> None:
        model = mlp_stack(4, depth=2)
        fully_shard(model[0])
        fully_shard(model)
        setter = getattr(model[0], f"set_modules_to_{direction}_prefetch")
        with self.assertRaisesRegex(ValueError, "Expects FSDPModule"):
            setter([model[1]])

    def test_register_fsdp_forward_method_missing(self) -> None:
        """Registering a method the module does not have is refused."""
        model = MLP(4)
        fully_shard(model)
        with self.assertRaisesRegex(ValueError, "does not have a method"):
            register_fsdp_forward_method(model, "generate")

    def test_uniform_dtype_in_a_group(self) -> None:
        """One group's parameters must share one dtype (by the first forward at the latest)."""
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16)).to(self.device)
        with self.assertRaisesRegex(
            AssertionError, "FSDP expects uniform original parameter dtype"
        ):
            fully_shard(model)
            model(batch(self.rank, 0, 2, 4))


class TestFullyShardWarnings(FSDP2Test):
    def test_no_warning_in_plain_training(self) -> None:
        """A plain step of a sharded model warns nothing of FSDP's."""
        model = mlp_stack(4, depth=2)
        shard_each(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(batch(self.rank, 0, 2, 4)).sum().backward()
        fsdp_warnings = [str(w.message) for w in caught if "FSDP" in str(w.message)]
        self.assertEqual(fsdp_warnings, [])

    def test_view_output_warns(self) -> None:
        """A sharded module whose output is a view of its input warns that an
        in-place op on it would skip the pre-backward all-gather (torch 2.13's)."""
        if not _warns_on_views():
            pytest.skip("the view-output warning is torch 2.13's; this torch has none")
        model = ViewOutput(4).to(self.device)
        fully_shard(model)
        with self.assertWarnsRegex(UserWarning, "returned a view tensor"):
            model(batch(self.rank, 0, 2, 4))


def _warns_on_views() -> bool:
    from torch.torch_version import TorchVersion

    return TorchVersion(torch.__version__) >= (2, 13)


class ViewOutput(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).view(-1)


class TestFullyShardRefusalsLeaveNoTrace(FSDP2Test):
    def test_refused_fully_shard_leaves_the_module_as_it_was(self) -> None:
        """After ``fully_shard`` refuses an argument the module keeps its class and its
        plain parameters, still runs, and a corrected call shards it (torch's refuses
        that call, having marked the module as applied before validating: asserted,
        ``FSDP2.known_defects.marks_module_before_validating``)."""
        self.run_subtests({"bad": ["reshard_int", "reshard_type", "mesh_3d"]}, self._refused)

    def _refused(self, bad: str) -> None:
        model = MLP(4).to(self.device)
        kwargs: dict[str, object] = {
            "reshard_int": {"reshard_after_forward": self.world_size + 1},
            "reshard_type": {"reshard_after_forward": "yes"},
            "mesh_3d": {
                "mesh": init_device_mesh(
                    self.device_type, (1, 1, self.world_size), mesh_dim_names=("a", "b", "c")
                )
            },
        }[bad]
        with self.assertRaises((ValueError, AssertionError)):
            fully_shard(model, **kwargs)
        self.assertEqual(type(model), MLP)
        for name, param in model.named_parameters():
            self.assertFalse(isinstance(param, torch.distributed.tensor.DTensor), name)
        model(batch(self.rank, 0, 2, 4)).sum().backward()
        if FSDP2.known_defects.marks_module_before_validating:
            with self.assertRaisesRegex(AssertionError, "can only be applied to a module once"):
                fully_shard(model)
            return
        fully_shard(model)
        model(batch(self.rank, 0, 2, 4)).sum().backward()

    def test_every_valid_reshard_after_forward_is_accepted(self) -> None:
        """True, False, and every divisor of the world size above 1 are accepted,
        and the model then trains a step."""
        values = [
            True,
            False,
            *(d for d in range(2, self.world_size + 1) if self.world_size % d == 0),
        ]
        self.run_subtests({"reshard_after_forward": values}, self._accepted)

    def _accepted(self, reshard_after_forward: bool | int) -> None:
        model = mlp_stack(4, depth=2)
        shard_each(model, reshard_after_forward=reshard_after_forward)
        model(batch(self.rank, 0, 2, 4)).sum().backward()


class TestFullyShardBeforeFirstForward(FSDP2Test):
    def test_methods_before_the_first_forward(self) -> None:
        """The ``FSDPModule`` setters, ``state_dict`` and ``reshard`` work before the
        first forward, and the model then gives the unsharded copy's outputs."""
        self.run_subtests(
            {
                "call": [
                    "state_dict",
                    "reshard",
                    "set_requires_gradient_sync",
                    "set_reshard_after_backward",
                    "set_is_last_backward",
                ]
            },
            self._before,
        )

    def _before(self, call: str) -> None:
        model = mlp_stack(4, depth=2)
        reference = copy.deepcopy(model)
        shard_each(model)
        if call == "state_dict":
            self.assertEqual(sorted(model.state_dict()), sorted(reference.state_dict()))
        elif call == "reshard":
            model.reshard()
        else:
            getattr(model, call)(True)
        x = batch(self.rank, 0, 2, 4)
        self.assertEqual(model(x), reference(x))

    def test_unshard_before_the_first_forward(self) -> None:
        """``unshard()`` before any forward gathers the full parameters (lazy
        initialisation happens there); the forward then gives the copy's output."""
        model = mlp_stack(4, depth=2)
        reference = copy.deepcopy(model)
        shard_each(model)
        for mlp in model:
            mlp.unshard()
        self.assertEqual(model[0].in_proj.weight, reference[0].in_proj.weight)
        x = batch(self.rank, 0, 2, 4)
        self.assertEqual(model(x), reference(x))

    def test_two_separate_roots_train(self) -> None:
        """Two models sharded separately, each its own root, run forward in turns."""
        models = [mlp_stack(4, depth=2, seed=s) for s in (0, 1)]
        references = [copy.deepcopy(m) for m in models]
        for model in models:
            shard_each(model)
        for step in range(2):
            for model, reference in zip(models, references, strict=True):
                x = batch(self.rank, step, 2, 4)
                self.assertEqual(model(x), reference(x))
