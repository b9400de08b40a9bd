"""What ``fully_shard`` builds: the state object per call, the class swap to
``FSDP<Class>``, DTensor parameters sharded on dim 0 (or where
``shard_placement_fn`` says) over the mesh, buffers left alone, meta-device
initialisation with ``to_empty`` and ``reset_parameters``, and ignored parameters.
Facts from upstream's ``test_fully_shard_init.py``, ``test_fully_shard_state.py``
and ``test_fully_shard_ignore_params.py``.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from fsdptest.api import FSDPModule, fully_shard
from models import MLP
from suites.fsdp2.helpers import (
    FSDP2Test,
    Lockstep,
    average_gradients,
    batch,
    lockstep,
    mlp_stack,
    shard_each,
)


class TestFullyShardState(FSDP2Test):
    def test_fully_shard_state(self) -> None:
        """``fully_shard.state(module)`` gives each call's own state object."""
        model = nn.Sequential(*(MLP(4) for _ in range(3)))
        shard_each(model)
        states = [fully_shard.state(model)] + [fully_shard.state(mlp) for mlp in model]
        self.assertTrue(all(state is not None for state in states))
        self.assertEqual(len({id(state) for state in states}), 4)

    def test_fully_shard_cls(self) -> None:
        """Only the module passed to ``fully_shard`` changes class, to ``FSDP<Class>``,
        a subclass of both its class and ``FSDPModule``; slicing a sharded
        ``Sequential`` gives a plain one."""
        model = MLP(4)
        fully_shard(model)
        self.assertIsInstance(model, MLP)
        self.assertIsInstance(model, FSDPModule)
        self.assertEqual(type(model).__name__, "FSDPMLP")
        for name, module in model.named_modules():
            if module is not model:
                self.assertFalse(isinstance(module, FSDPModule), name)
        stack = nn.Sequential(*(MLP(4) for _ in range(3)))
        fully_shard(stack)
        self.assertEqual(type(stack).__name__, "FSDPSequential")
        self.assertFalse(isinstance(stack[:2], FSDPModule))
        self.assertIsInstance(stack[:2], nn.Sequential)

    def test_lazy_init_by_torch_names(self) -> None:
        """The tree as torch's private names show it (upstream's tests read them):
        after ``fully_shard.state(root)._lazy_init()`` only the root's ``_is_root``
        is true, ``_state_ctx.all_states`` is the root's state then the others in
        module order, and each ``_fsdp_param_group`` has the module's name as
        ``_module_fqn`` and its ``fsdp_params`` the parameters' names from the root
        (the root's own group holds the unsharded child's)."""
        model = nn.Sequential(MLP(4), MLP(4))
        shard_each(model, [model[0].in_proj, model[0].out_proj])
        root = fully_shard.state(model)
        root._lazy_init()
        inner = [fully_shard.state(model[0].in_proj), fully_shard.state(model[0].out_proj)]
        self.assertEqual([s._is_root for s in [root, *inner]], [True, False, False])
        self.assertEqual(root._state_ctx.all_states, [root, *inner])
        expected = {
            "": {f"1.{m}.{p}" for m in ("in_proj", "out_proj") for p in ("weight", "bias")},
            "0.in_proj": {"0.in_proj.weight", "0.in_proj.bias"},
            "0.out_proj": {"0.out_proj.weight", "0.out_proj.bias"},
        }
        for state, fqn in zip([root, *inner], expected):
            group = state._fsdp_param_group
            self.assertEqual(group._module_fqn, fqn)
            self.assertEqual({p._param_fqn for p in group.fsdp_params}, expected[fqn])

    def test_lazy_init_errors(self) -> None:
        """A nested state set up first (as if its forward ran before the root's)
        makes the root's set-up refuse, naming it; a call on several modules cannot
        be the root of a tree."""
        model = nn.Sequential(MLP(4), MLP(4))
        shard_each(model, [model[0].in_proj, model[0].out_proj])
        fully_shard.state(model[0].in_proj)._lazy_init()
        regex = (
            "FSDP state has already been lazily initialized for 0.in_proj\n"
            "FSDP requires running forward through the root module first"
        )
        with self.assertRaisesRegex(RuntimeError, regex):
            fully_shard.state(model)._lazy_init()
        pair = nn.Sequential(MLP(4), MLP(4))
        fully_shard([pair[0], pair[1]])
        with self.assertRaisesRegex(RuntimeError, "FSDP requires a single root module but got "):
            fully_shard.state(pair[0])._lazy_init()


class TestFullyShardParameters(FSDP2Test):
    def test_sharded_parameters(self) -> None:
        """Every managed parameter becomes a DTensor of the original shape and
        dtype, placed (Shard(0),) on the 1-D mesh, on the mesh's device, still
        requiring grad as before and registered under the same name."""
        self.run_subtests(
            {"dtype": [torch.float32, torch.bfloat16], "frozen_first": [False, True]}, self._sharded
        )

    def _sharded(self, dtype: torch.dtype, frozen_first: bool) -> None:
        model = mlp_stack(5, depth=2).to(dtype)
        if frozen_first:
            model[0].requires_grad_(False)
        before = {n: (p.shape, p.requires_grad) for n, p in model.named_parameters()}
        shard_each(model)
        after = dict(model.named_parameters())
        self.assertEqual(list(after), list(before))
        for name, param in after.items():
            self.assertIsInstance(param, DTensor, name)
            self.assertIsInstance(param, nn.Parameter, name)
            self.assertEqual((param.shape, param.requires_grad), before[name], msg=name)
            self.assertEqual(param.dtype, dtype, msg=name)
            self.assertEqual(tuple(param.placements), (Shard(0),), msg=name)
            self.assertEqual(param.device_mesh.size(), self.world_size, msg=name)
            self.assertEqual(param.to_local().device.type, self.device_type, msg=name)

    def test_buffers_are_not_sharded(self) -> None:
        """Buffers stay plain tensors, equal to the originals, on the device."""
        model = mlp_stack(4, depth=2, with_buffer=True)
        buffers = {n: b.clone() for n, b in model.named_buffers()}
        shard_each(model)
        for name, buffer in model.named_buffers():
            self.assertFalse(isinstance(buffer, DTensor), name)
            self.assertEqual(buffer, buffers[name], msg=name)

    def test_shard_placement_fn(self) -> None:
        """``shard_placement_fn`` returning ``Shard(1)`` for weights (and None, dim 0,
        for the rest) places them so, and the model trains as the reference."""
        self.run_subtests({"reshard_after_forward": [True, False]}, self._placement)

    def _placement(self, reshard_after_forward: bool) -> None:
        def place(param: nn.Parameter) -> Shard | None:
            return Shard(1) if param.ndim == 2 else None

        width = 12  # divisible by 2, 3 and 4: dim-1 sharding must be even
        run = lockstep(
            self,
            lambda: mlp_stack(width, depth=2, dim_multiplier=1),
            functools.partial(
                shard_each, shard_placement_fn=place, reshard_after_forward=reshard_after_forward
            ),
        )
        for name, param in run.model.named_parameters():
            expected = Shard(1) if param.ndim == 2 else Shard(0)
            self.assertEqual(tuple(param.placements), (expected,), msg=name)
        run.train(2, (2, width))


class TestFullyShardMetaDeviceInit(FSDP2Test):
    def test_meta_device_1d_init(self) -> None:
        """A model built on the meta device, sharded, then ``to_empty`` on the device
        and ``reset_parameters`` on every module: no parameter or buffer is left on
        meta, the shards are DTensors on the device, and the model trains as a
        replicated copy of its full parameters."""
        self.run_subtests({"with_buffer": [False, True]}, self._meta)

    def _meta(self, with_buffer: bool) -> None:
        with torch.device("meta"):
            model = nn.Sequential(*(MLP(6, with_buffer=with_buffer) for _ in range(2)))
        shard_each(model)
        for name, param in model.named_parameters():
            self.assertEqual(param.device.type, "meta", name)
        model.to_empty(device=self.device)
        torch.manual_seed(self.rank)  # shards are initialised independently per rank
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            self.assertEqual(tensor.device.type, self.device_type, name)
        for name, param in model.named_parameters():
            self.assertIsInstance(param, DTensor, name)
        reference = nn.Sequential(*(MLP(6, with_buffer=with_buffer) for _ in range(2))).to(
            self.device
        )
        reference.load_state_dict(
            {
                k: v.full_tensor() if isinstance(v, DTensor) else v
                for k, v in model.state_dict().items()
            }
        )
        if with_buffer:
            # reset_parameters drew each rank's buffer independently: take rank 0's.
            for buffer in [*model.buffers(), *reference.buffers()]:
                torch.distributed.broadcast(buffer, src=0)
        Lockstep(self, model, reference).train(2, (2, 6))


class TestFullyShardIgnoredParams(FSDP2Test):
    def test_ignored_params(self) -> None:
        """Ignored parameters stay plain tensors, are not moved or sharded, and their
        gradients are each rank's own (not reduced); the rest trains as the reference."""
        self.run_subtests({"ignore": ["first_in_proj", "last_mlp"]}, self._ignored)

    def _ignored(self, ignore: str) -> None:
        model = mlp_stack(6, depth=2)
        reference = copy.deepcopy(model)
        ignored = set(
            model[0].in_proj.parameters() if ignore == "first_in_proj" else model[1].parameters()
        )
        names = {n for n, p in model.named_parameters() if p in ignored}
        shard_each(model, ignored_params=ignored)
        for name, param in model.named_parameters():
            self.assertEqual(isinstance(param, DTensor), name not in names, name)
        x = batch(self.rank, 0, 2, 6)
        model(x).sum().backward()
        reference(x).sum().backward()
        local = {n: p.grad.clone() for n, p in reference.named_parameters()}
        average_gradients(reference)
        for name, param in model.named_parameters():
            if name in names:
                self.assertEqual(param.grad, local[name], msg=f"{name}: the rank's own gradient")
        references = dict(reference.named_parameters())
        for name, param in model.named_parameters():
            if name not in names:
                self.assertEqual(param.full_tensor(), references[name].detach(), msg=name)
                self.assertEqual(param.grad.full_tensor(), references[name].grad, msg=name)


class TestFullyShardInitMore(FSDP2Test):
    def test_reset_parameters_on_shards(self) -> None:
        """``reset_parameters`` on a sharded module (not on meta) redraws the shards in
        place: they stay DTensors of the same placements, and training goes on."""
        model = mlp_stack(6, depth=2)
        shard_each(model)
        placements = [tuple(p.placements) for p in model.parameters()]
        before = [p.to_local().clone() for p in model.parameters()]
        torch.manual_seed(123 + self.rank)
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()
        after = [p.to_local() for p in model.parameters()]
        self.assertEqual([tuple(p.placements) for p in model.parameters()], placements)
        self.assertNotEqual(after, before)
        model(batch(self.rank, 0, 2, 6)).sum().backward()
        for name, param in model.named_parameters():
            self.assertIsInstance(param.grad, DTensor, name)

    def test_meta_init_then_load_state_dict(self) -> None:
        """A meta-device model sharded, ``to_empty``, then given a saved state dict is
        the saved model (the first forward gives its outputs)."""
        saved = mlp_stack(6, depth=2)
        shard_each(saved)
        with torch.device("meta"):
            model = nn.Sequential(*(MLP(6) for _ in range(2)))
        shard_each(model)
        model.to_empty(device=self.device)
        model.load_state_dict(saved.state_dict())
        x = batch(self.rank, 0, 2, 6)
        self.assertEqual(model(x), saved(x))

    def test_module_without_parameters(self) -> None:
        """``fully_shard`` on a module with no parameters of its own (all in sharded
        children, or none at all) works and trains."""
        self.run_subtests({"children_sharded": [True, False]}, self._no_params)

    def _no_params(self, children_sharded: bool) -> None:
        run = lockstep(
            self,
            lambda: nn.Sequential(mlp_stack(4, depth=1), nn.ReLU()).to(self.device),
            lambda m: shard_each(m, [m[0], m[1]] if children_sharded else [m[1]]),
        )
        run.train(2, (2, 4))

    def test_replicated_child_is_left_to_replicate(self) -> None:
        """A child that torch's composable ``replicate`` was applied to is not
        managed by a later ``fully_shard`` of its parent (nor is its subtree): its
        parameters stay the same plain tensors, every other parameter becomes a
        DTensor."""
        from torch.distributed._composable import replicate

        model = nn.Sequential(*(MLP(4) for _ in range(3))).to(self.device)
        replicate(model[0])
        kept = list(model[0].parameters())
        fully_shard(model[2])
        fully_shard(model)
        self.assertEqual([id(p) for p in model[0].parameters()], [id(p) for p in kept])
        for name, param in model.named_parameters():
            self.assertEqual(isinstance(param, DTensor), not name.startswith("0."), msg=name)


class TestFullyShardHSDPInit(FSDP2Test):
    world_size = 4

    def test_hsdp_meta_init_and_mean_gradient(self) -> None:
        """A meta-device model on a 2x2 mesh is materialised with ``to_empty``; with a
        loss of ``(rank + 1) * sum(w)`` every gradient is the mean of 1..4 over all
        four ranks (replicas and shards)."""
        mesh = self.hsdp_mesh(2)
        with torch.device("meta"):
            model = nn.Linear(4, 6)
        fully_shard(model, mesh=mesh)
        model.to_empty(device=self.device)
        model.reset_parameters()
        out = model(torch.zeros(1, 4, device=self.device))
        ((self.rank + 1) * out.sum()).backward()
        # the weight's gradient is zero (input 0); the bias's is the mean of 1..W
        bias_grad = model.bias.grad.to_local()
        expected = (self.world_size + 1) / 2
        self.assertEqual(bias_grad, torch.full_like(bias_grad, expected))
