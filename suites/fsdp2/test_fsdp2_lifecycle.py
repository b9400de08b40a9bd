"""What stays the same across a sharded model's life, and what optimizers see:
parameter and buffer objects kept across steps, train/eval flags, forwards without
a backward, user hooks that see the unsharded parameters, optimizers of every kind
(and several optimizers or parameter groups), batch shapes and model sizes, each
trained as the replicated reference ([Note: FSDP2 parity recipe] in
``suites/fsdp2/helpers.py``).
"""

from __future__ import annotations

import copy
import functools
import logging

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from harness import current_device
from suites.fsdp2.helpers import (
    LR,
    STEPS,
    FSDP2Test,
    Lockstep,
    average_gradients,
    batch,
    lockstep,
    shard_each,
)
from upstream.common_fsdp import check_sharded_parity

OPTIMIZERS = {
    "sgd": functools.partial(torch.optim.SGD, lr=LR),
    "sgd_momentum": functools.partial(torch.optim.SGD, lr=LR, momentum=0.9),
    "sgd_nesterov": functools.partial(torch.optim.SGD, lr=LR, momentum=0.9, nesterov=True),
    "adam": functools.partial(torch.optim.Adam, lr=LR),
    "adamw": functools.partial(torch.optim.AdamW, lr=LR, weight_decay=0.1),
    "rmsprop": functools.partial(torch.optim.RMSprop, lr=LR),
    "adagrad": functools.partial(torch.optim.Adagrad, lr=LR),
}


def chain(dim: int = 4, depth: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(dim, dim) for _ in range(depth))).to(current_device())


def grouped(model: nn.Module, grouping: str, **kwargs: object) -> None:
    shard_each(model, [] if grouping == "root" else list(model)[:-1], **kwargs)


class TestFullyShardLifecycle(FSDP2Test):
    def test_parameter_objects_are_kept_across_steps(self) -> None:
        """The parameter and buffer objects after every step are those the optimizer
        was given (sharded DTensors, not replaced)."""
        self.run_subtests(
            {
                "reshard_after_forward": [True, False],
                "grouping": ["root", "children"],
                "steps": [1, 3],
            },
            self._identity,
        )

    def _identity(self, reshard_after_forward: bool, grouping: str, steps: int) -> None:
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4)).to(self.device)
        grouped(model, grouping, reshard_after_forward=reshard_after_forward)
        params = [id(p) for p in model.parameters()]
        buffers = [id(b) for b in model.buffers()]
        optim = torch.optim.SGD(model.parameters(), lr=LR)
        for step in range(steps):
            model(batch(self.rank, step, 3, 4)).sum().backward()
            optim.step()
            optim.zero_grad()
        self.assertEqual([id(p) for p in model.parameters()], params)
        self.assertEqual([id(b) for b in model.buffers()], buffers)
        self.assertEqual([id(p) for p in optim.param_groups[0]["params"]], params)

    def test_train_and_eval_flags(self) -> None:
        """``train()`` / ``eval()`` reach every submodule of a sharded model."""
        self.run_subtests({"grouping": ["root", "children"]}, self._flags)

    def _flags(self, grouping: str) -> None:
        model = chain()
        grouped(model, grouping)
        for mode in (False, True, False):
            model.train(mode)
            self.assertEqual({m.training for m in model.modules()}, {mode})

    def test_forwards_without_backward(self) -> None:
        """One to three forwards without a backward (with grad or not) leave the
        model able to train as the reference afterwards."""
        self.run_subtests(
            {
                "forwards": [1, 2, 3],
                "no_grad": [False, True],
                "reshard_after_forward": [True, False],
                "grouping": ["root", "children"],
            },
            self._forwards,
        )

    def _forwards(
        self, forwards: int, no_grad: bool, reshard_after_forward: bool, grouping: str
    ) -> None:
        run = lockstep(
            self,
            chain,
            functools.partial(
                grouped, grouping=grouping, reshard_after_forward=reshard_after_forward
            ),
        )
        for i in range(forwards):
            with torch.no_grad() if no_grad else torch.enable_grad():
                outs = [m(batch(self.rank, 50 + i, 2, 4)) for m in (run.model, run.reference)]
            self.assertEqual(outs[0], outs[1])
        run.train(STEPS, (2, 4))

    def test_user_hooks_see_unsharded_parameters(self) -> None:
        """A forward pre-hook registered on a sharded module after ``fully_shard`` runs
        after FSDP's and sees the parameters unsharded (plain full tensors); a forward
        hook runs after FSDP's post-forward, so it sees them resharded (DTensors)
        when the group reshards after forward, unsharded otherwise."""
        self.run_subtests(
            {
                "hook": ["pre", "post"],
                "reshard_after_forward": [True, False],
                "grouping": ["root", "children"],
            },
            self._hooks,
        )

    def _hooks(self, hook: str, reshard_after_forward: bool, grouping: str) -> None:
        model = chain()
        full = model[0].weight.detach().clone()
        grouped(model, grouping, reshard_after_forward=reshard_after_forward)
        target = model[0] if grouping == "children" else model
        seen: list[torch.Tensor] = []

        def record(module: nn.Module, *_: object) -> None:
            # A copy: the unsharded storage is freed when the group reshards
            weight = model[0].weight
            seen.append(weight if isinstance(weight, DTensor) else weight.detach().clone())

        if hook == "pre":
            target.register_forward_pre_hook(record)
        else:
            target.register_forward_hook(record)
        model(batch(self.rank, 0, 2, 4))
        self.assertEqual(len(seen), 1)
        if hook == "post" and reshard_after_forward:
            self.assertIsInstance(seen[0], DTensor)
            self.assertEqual(seen[0].full_tensor(), full)
        else:
            self.assertFalse(isinstance(seen[0], DTensor))
            self.assertEqual(seen[0], full)

    def test_debug_log_of_one_step(self) -> None:
        """At DEBUG, the logger ``torch.distributed.fsdp.fully_shard`` (what
        ``TORCH_LOGS=+fsdp`` turns on) traces a step of two sharded layers under a
        sharded root: the root's pre-forward once, each group's pre/post-forward in
        forward order and pre/post-backward in reverse, labelled with the module's
        name, then the root's post-backward (facts of upstream's
        ``test_fully_shard_logging.py``; the order is torch's, the root's own group
        holding no parameters here)."""
        model = nn.Sequential(*(nn.Linear(4, 4, bias=False) for _ in range(2)))
        shard_each(model)
        x = batch(self.rank, 0, 4, 4)
        logger = logging.getLogger("torch.distributed.fsdp.fully_shard")
        records: list[logging.LogRecord] = []
        handler = logging.Handler(logging.DEBUG)
        handler.emit = records.append  # type: ignore[method-assign]
        level = logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        try:
            model(x).sum().backward()
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
        expected = [
            "FSDP::root_pre_forward",
            "FSDP::pre_forward (0)",
            "FSDP::post_forward (0)",
            "FSDP::pre_forward (1)",
            "FSDP::post_forward (1)",
            "FSDP::pre_backward (1)",
            "FSDP::post_backward (1)",
            "FSDP::pre_backward (0)",
            "FSDP::root_post_backward",
            "FSDP::post_backward (0)",
        ]
        self.assertEqual([record.getMessage() for record in records], expected)


class TestFullyShardOptimizers(FSDP2Test):
    def test_optimizer_matrix(self) -> None:
        """Every common optimizer (foreach or not) steps the DTensor shards as it steps
        the replicated parameters."""
        self.run_subtests(
            {"optim": list(OPTIMIZERS), "grouping": ["root", "children"], "foreach": [False, True]},
            self._optimizer,
        )

    def _optimizer(self, optim: str, grouping: str, foreach: bool) -> None:
        model = chain()
        reference = _replica(model)
        grouped(model, grouping)
        make = functools.partial(OPTIMIZERS[optim], foreach=foreach)
        run = Lockstep(self, model, reference, optim=lambda params, lr: make(params))
        run.train(STEPS, (2, 4))
        for param in model.parameters():
            for key, state in run.optims[0].state[param].items():
                if isinstance(state, torch.Tensor) and state.ndim:
                    self.assertIsInstance(state, DTensor, key)

    def test_two_optimizers_and_param_groups(self) -> None:
        """Parameters split over two optimizers, or over two parameter groups with
        their own learning rates, train as the reference split the same way."""
        self.run_subtests({"split": ["optimizers", "param_groups"]}, self._split)

    def _split(self, split: str) -> None:
        model = chain()
        reference = _replica(model)
        grouped(model, "children")

        def optimizers(m: nn.Module) -> list[torch.optim.Optimizer]:
            first, rest = (
                list(m[0].parameters()),
                [p for layer in m[1:] for p in layer.parameters()],
            )
            if split == "optimizers":
                return [torch.optim.SGD(first, lr=LR), torch.optim.Adam(rest, lr=LR)]
            return [torch.optim.SGD([{"params": first, "lr": 0.1}, {"params": rest}], lr=LR)]

        optims = [optimizers(model), optimizers(reference)]
        for step in range(STEPS):
            x = batch(self.rank, step, 2, 4)
            for m in (model, reference):
                m(x).sum().backward()
            average_gradients(reference)
            check_sharded_parity(self, reference, model)
            for optim in (*optims[0], *optims[1]):
                optim.step()
                optim.zero_grad()
        check_sharded_parity(self, reference, model)


def _replica(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


class TestFullyShardShapes(FSDP2Test):
    def test_batch_shapes(self) -> None:
        """Inputs with extra batch dimensions (2-D, 3-D, 4-D) train as the reference."""
        self.run_subtests(
            {
                "shape": [(2, 4), (2, 3, 4), (2, 1, 3, 4)],
                "reshard_after_forward": [True, False],
                "grouping": ["root", "children"],
            },
            self._shapes,
        )

    def _shapes(self, shape: tuple[int, ...], reshard_after_forward: bool, grouping: str) -> None:
        run = lockstep(
            self,
            chain,
            functools.partial(
                grouped, grouping=grouping, reshard_after_forward=reshard_after_forward
            ),
        )
        run.train(STEPS, shape)

    def test_depth_and_width(self) -> None:
        """Chains of one to four layers of widths one to four train as the reference."""
        self.run_subtests({"depth": [1, 2, 3, 4], "dim": [1, 2, 3, 4]}, self._depth_width)

    def _depth_width(self, depth: int, dim: int) -> None:
        run = lockstep(
            self, lambda: chain(dim, depth), functools.partial(grouped, grouping="children")
        )
        run.train(1, (2, dim))


class TestFullyShardHSDPRegistration(FSDP2Test):
    world_size = 4

    def test_hsdp_registration_and_parity(self) -> None:
        """On 1x4, 2x2 and 4x1 meshes, resharding after forward or not, one group or
        several: the registration after forward and one training step as the reference."""
        self.run_subtests(
            {
                "replicas": [1, 2, 4],
                "reshard_after_forward": [True, False],
                "grouping": ["root", "children"],
            },
            self._hsdp,
        )

    def _hsdp(self, replicas: int, reshard_after_forward: bool, grouping: str) -> None:
        mesh = self.hsdp_mesh(replicas)
        run = lockstep(
            self,
            chain,
            functools.partial(
                grouped, grouping=grouping, mesh=mesh, reshard_after_forward=reshard_after_forward
            ),
        )
        out = run.model(batch(self.rank, 0, 2, 4))
        for name, param in run.model.named_parameters():
            self.assertEqual(isinstance(param, DTensor), reshard_after_forward, name)
        out.sum().backward()
        run.reference(batch(self.rank, 0, 2, 4)).sum().backward()
        average_gradients(run.reference)
        check_sharded_parity(self, run.reference, run.model)
