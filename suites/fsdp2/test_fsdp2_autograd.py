"""FSDP2 under autograd's corner cases: outputs the loss does not use, modules a
forward skips, outputs in containers with non-tensors, inputs that require grad,
forwards under ``no_grad`` and ``inference_mode``, eval, post-accumulate-grad hooks
and ``register_fsdp_forward_method``. Each trains or runs as the replicated
reference. Facts from upstream's ``test_fully_shard_autograd.py`` and
``test_fully_shard_training.py``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdptest.api import fully_shard, register_fsdp_forward_method
from models import MLP, DoubleLinear
from suites.fsdp2.helpers import (
    FSDP2Test,
    average_gradients,
    batch,
    lockstep,
    mlp_stack,
    shard_each,
    skip_dataclass_outputs,
)
from upstream.common_fsdp import check_sharded_parity


def double_linear(dim: int = 6, use_second_linear: bool = True) -> nn.Module:
    from harness import current_device

    torch.manual_seed(0)
    return DoubleLinear(dim, use_second_linear).to(current_device())


class TestFullyShardAutograd(FSDP2Test):
    def test_unused_forward_output(self) -> None:
        """The loss uses only the first of a group's two outputs: the other's
        parameters get no gradient, the rest trains as the reference."""
        self.run_subtests(
            {"reshard_after_forward": [True, False], "shard_lins": [True, False]},
            self._unused_output,
        )

    def _unused_output(self, reshard_after_forward: bool, shard_lins: bool) -> None:
        run = lockstep(
            self,
            double_linear,
            lambda m: shard_each(
                m,
                [m.lin1, m.lin2] if shard_lins else [],
                reshard_after_forward=reshard_after_forward,
            ),
        )
        run.loss_fn = lambda out: out[0].sum()
        run.train(2, (3, 6))
        self.assertIsNone(run.model.lin2.weight.grad)

    def test_unused_forward_module(self) -> None:
        """A group used on even steps only: its gradients come and go with its use."""
        self.run_subtests({"reshard_after_forward": [True, False]}, self._sometimes_used)

    def _sometimes_used(self, reshard_after_forward: bool) -> None:
        run = lockstep(
            self,
            lambda: double_linear(use_second_linear=True),
            lambda m: shard_each(m, [m.lin1, m.lin2], reshard_after_forward=reshard_after_forward),
        )
        for step in range(3):
            use_second = step % 2 == 0
            for model in (run.model, run.reference):
                model.use_second_linear = use_second
            run.loss_fn = (
                (lambda out: out[0].sum() + out[1].sum()) if use_second else (lambda out: out.sum())
            )
            run.backward(batch(self.rank, step, 2, 6))
            if not use_second:
                self.assertIsNone(run.model.lin2.weight.grad)
            run.step(0)  # zero_grad(set_to_none=True): an unused module's gradient stays None

    def test_nontensor_activations_and_containers(self) -> None:
        """Outputs in a dataclass beside non-tensors, passed between groups: parity."""
        self.run_subtests({"reshard_after_forward": [True, False]}, self._containers)

    def _containers(self, reshard_after_forward: bool) -> None:
        skip_dataclass_outputs(reshard_after_forward)
        run = lockstep(
            self,
            lambda: ContainerChain(6).to(self.device),
            lambda m: shard_each(m, list(m.blocks), reshard_after_forward=reshard_after_forward),
        )
        run.train(2, (2, 6))

    def test_input_requires_grad(self) -> None:
        """The input's gradient equals the reference's (the mean is not taken for it)."""
        run = lockstep(self, lambda: mlp_stack(6, depth=2), shard_each)
        x = batch(self.rank, 0, 2, 6).requires_grad_(True)
        x_ref = x.detach().clone().requires_grad_(True)
        run.model(x).sum().backward()
        run.reference(x_ref).sum().backward()
        self.assertEqual(x.grad, x_ref.grad)
        average_gradients(run.reference)
        check_sharded_parity(self, run.reference, run.model)

    def test_forward_without_grad(self) -> None:
        """Forwards under ``no_grad`` or in eval give the reference's outputs and
        leave the parameters sharded (when resharding); training goes on as the
        reference's."""
        self.run_subtests(
            {"mode": ["no_grad", "eval"], "reshard_after_forward": [True, False]}, self._no_grad
        )

    def test_forward_in_inference_mode(self) -> None:
        """A forward under ``inference_mode`` gives the reference's output. (Training
        after it is not asked: torch's FSDP2 then reuses the inference-mode
        all-gather buffers and raises.)"""
        run = lockstep(self, lambda: mlp_stack(6, depth=2), shard_each)
        x = batch(self.rank, 0, 2, 6)
        with torch.inference_mode():
            outs = [m(x) for m in (run.model, run.reference)]
        self.assertEqual(outs[0], outs[1])

    def _no_grad(self, mode: str, reshard_after_forward: bool) -> None:
        run = lockstep(
            self,
            lambda: mlp_stack(6, depth=2),
            functools.partial(shard_each, reshard_after_forward=reshard_after_forward),
        )
        x = batch(self.rank, 0, 2, 6)
        for model in (run.model, run.reference):
            model.train(mode != "eval")
        with torch.no_grad() if mode == "no_grad" else contextlib.nullcontext():
            outs = [m(x) for m in (run.model, run.reference)]
        self.assertEqual(outs[0], outs[1])
        if reshard_after_forward:
            for name, param in run.model.named_parameters():
                self.assertIsInstance(param, DTensor, name)
        for model in (run.model, run.reference):
            model.train()
        run.train(2, (2, 6))

    def test_post_accumulate_grad_hook(self) -> None:
        """A post-accumulate-grad hook on each sharded parameter runs once per
        backward, with the reduced DTensor gradient in place."""
        model = mlp_stack(6, depth=2)
        shard_each(model)
        seen: list[tuple[str, bool]] = []
        for name, param in model.named_parameters():
            param.register_post_accumulate_grad_hook(
                lambda p, name=name: seen.append((name, isinstance(p.grad, DTensor)))
            )
        model(batch(self.rank, 0, 2, 6)).sum().backward()
        self.assertEqual(sorted(seen), sorted((n, True) for n, _ in model.named_parameters()))


@dataclasses.dataclass
class Carry:
    tensor: torch.Tensor
    note: str
    extras: dict[str, Any]


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mlp = MLP(dim)

    def forward(self, carry: Carry | torch.Tensor) -> Carry:
        x = carry if isinstance(carry, torch.Tensor) else carry.tensor
        return Carry(self.mlp(x), note="block", extras={"scale": 2, "skip": x})


class ContainerChain(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        carry: Carry | torch.Tensor = x
        for block in self.blocks:
            carry = block(carry)
        assert isinstance(carry, Carry)
        return carry.tensor * carry.extras["scale"] + carry.extras["skip"]


class Sampler(nn.Module):
    """A module with a method besides ``forward`` that uses its parameters."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def sample(self, x: torch.Tensor, steps: int) -> torch.Tensor:
        for _ in range(steps):
            x = torch.tanh(self.lin(x))
        return x


class TestFullyShardForwardMethods(FSDP2Test):
    def test_register_fsdp_forward_method(self) -> None:
        """A method registered with ``register_fsdp_forward_method`` runs with the
        unsharded parameters (as forward does), gives the reference's result, and
        its backward trains as the reference."""
        self.run_subtests({"reshard_after_forward": [True, False], "steps": [1, 2]}, self._method)

    def _method(self, reshard_after_forward: bool, steps: int) -> None:
        model = nn.Sequential(Sampler(6)).to(self.device)
        reference = copy.deepcopy(model)
        fully_shard(model[0], reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        register_fsdp_forward_method(model[0], "sample")
        x = batch(self.rank, 0, 2, 6)
        out = model[0].sample(x, steps)
        ref_out = reference[0].sample(x, steps)
        self.assertEqual(out, ref_out)
        out.sum().backward()
        ref_out.sum().backward()
        average_gradients(reference)
        check_sharded_parity(self, reference, model)


class TestFullyShardAutogradMore(FSDP2Test):
    def test_backward_with_a_gradient_argument(self) -> None:
        """``out.backward(gradient)`` with a non-scalar output trains as the reference."""
        run = lockstep(self, lambda: mlp_stack(6, depth=2), shard_each)
        x = batch(self.rank, 0, 2, 6)
        grad_out = batch(self.rank, 1, 2, 6)
        for model in (run.model, run.reference):
            model(x).backward(grad_out)
        average_gradients(run.reference)
        check_sharded_parity(self, run.reference, run.model)

    def test_output_used_twice(self) -> None:
        """An output entering the loss twice (through two paths) trains as the reference."""
        run = lockstep(self, lambda: mlp_stack(6, depth=2), shard_each)
        run.loss_fn = lambda out: (out * out).sum() + out.mean()
        run.train(2, (2, 6))

    def test_detached_branch(self) -> None:
        """A branch of the graph detached before the loss contributes no gradient."""
        run = lockstep(self, lambda: double_linear(), lambda m: shard_each(m, [m.lin1, m.lin2]))
        run.loss_fn = lambda out: out[0].sum() + out[1].detach().sum()
        run.train(2, (2, 6))
        self.assertIsNone(run.model.lin2.weight.grad)

    def test_apply_activation_checkpointing_wrapper(self) -> None:
        """Modules wrapped by ``apply_activation_checkpointing`` (the checkpoint
        wrapper, non-reentrant) and sharded inside train as the reference."""
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
        )

        def build() -> nn.Module:
            model = mlp_stack(6, depth=2)
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, MLP))
            return model

        run = lockstep(
            self, build, lambda m: shard_each(m, [c for c in m.modules() if isinstance(c, MLP)])
        )
        run.train(2, (2, 6))
