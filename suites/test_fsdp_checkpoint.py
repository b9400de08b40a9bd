"""Activation checkpointing around and inside FSDP units (port of upstream
``test_fsdp_checkpoint.py``).

A checkpoint wrapper outside FSDP recomputes the units' forwards during
backward (non-reentrant: while the first saved tensor is unpacked; reentrant:
the whole forward first runs under ``no_grad``, then again inside backward); a
checkpoint wrapper inside a unit recomputes only the wrapped module's
computation while the unit is unsharded for its own backward. Either way the
outputs and the sharded gradients are those of the same model without
checkpointing. ``offload_wrapper`` saves activations with
``torch.autograd.graph.save_on_cpu``, looked up from the wrapper's module at
forward time, so the tests observe it by patching that name.

Torch's FSDP cannot offload parameters on a CPU-only run: those configurations
assert its failure (see [Note: Torch's FSDP on a CPU-only run] in
fsdptest.limitations, and ``assert_torch_refuses_cpu_offload``) and stop there.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as checkpoint_wrapper_module
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
    offload_wrapper,
)
from torch.utils.checkpoint import checkpoint

from fsdptest import FSDPTest
from fsdptest.api import (
    FSDP,
    CPUOffload,
    ShardingStrategy,
    assert_torch_refuses_cpu_offload,
    torch_refuses_cpu_offload,
)
from harness import parametrize

pytestmark = pytest.mark.torch_cpu_offload_asserted

OFFLOAD_CONFIGS = [CPUOffload(offload_params=True), CPUOffload(offload_params=False)]

_save_on_cpu_called = False


def offload_name(cpu_offload: CPUOffload) -> str:
    return f"offload_{str(cpu_offload.offload_params).lower()}"


def get_patched_save_on_cpu() -> Callable[..., Any]:
    """``save_on_cpu`` that records its call (the original is looked up at call time)."""
    original = checkpoint_wrapper_module.save_on_cpu

    def patched_save_on_cpu(*args: Any, **kwargs: Any) -> Any:
        global _save_on_cpu_called
        _save_on_cpu_called = True
        return original(*args, **kwargs)

    return patched_save_on_cpu


@contextlib.contextmanager
def patch_save_on_cpu(new_save_on_cpu: Callable[..., Any]) -> Iterator[None]:
    original = checkpoint_wrapper_module.save_on_cpu
    checkpoint_wrapper_module.save_on_cpu = new_save_on_cpu  # type: ignore[assignment]
    try:
        yield
    finally:
        checkpoint_wrapper_module.save_on_cpu = original


def _maybe_wrap_fsdp(module: nn.Module, *args: Any, wrap_fsdp: bool, **kwargs: Any) -> nn.Module:
    return FSDP(module, *args, **kwargs) if wrap_fsdp else module


class SequentialModule(nn.Module):
    """Three ``Linear(3, 3)``; each optionally checkpoint- (or offload-) wrapped,
    then optionally its own FSDP unit: with ``wrap_fsdp`` there are three
    independent FSDP roots and no FSDP around them."""

    def __init__(
        self,
        checkpoint_layer: bool = False,
        offload_activations: bool = False,
        wrap_fsdp: bool = False,
        device: torch.device | None = None,
        *fsdp_args: Any,
        **fsdp_kwargs: Any,
    ) -> None:
        torch.manual_seed(0)
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(3, 3).to(device) for _ in range(3)]
        if checkpoint_layer:
            wrapper = offload_wrapper if offload_activations else checkpoint_wrapper
            layers = [wrapper(layer) for layer in layers]
        wrap = functools.partial(_maybe_wrap_fsdp, *fsdp_args, wrap_fsdp=wrap_fsdp, **fsdp_kwargs)
        self.ffn = nn.Sequential(*[wrap(layer) for layer in layers])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn(x)


class TestFSDPCheckpoint(FSDPTest):
    def _verify_parity(
        self, losses: list[torch.Tensor], outputs: list[torch.Tensor], models: list[nn.Module]
    ) -> None:
        if not (losses and outputs and models):
            raise AssertionError(f"losses {losses} outputs {outputs} models {models}")
        for loss, output in zip(losses, outputs):
            self.assertEqual(loss, losses[0])
            self.assertEqual(output, outputs[0])
        ref_grads = [p.grad for p in models[0].parameters()]
        for model in models:
            grads = [p.grad for p in model.parameters()]
            self.assertEqual(len(grads), len(ref_grads))
            for grad, ref_grad in zip(grads, ref_grads):
                self.assertEqual(grad, ref_grad)

    @parametrize("cpu_offload", OFFLOAD_CONFIGS, offload_name)
    @parametrize("offload_activations", [True, False])
    @parametrize("use_orig_params", [False, True])
    def test_checkpoint_fsdp_wrapping(
        self, cpu_offload: CPUOffload, offload_activations: bool, use_orig_params: bool
    ) -> None:
        """Checkpointing around three FSDP roots, and FSDP around checkpointed
        layers, give the outputs and gradients of the plain FSDP model."""
        global _save_on_cpu_called
        if torch_refuses_cpu_offload(cpu_offload):
            assert_torch_refuses_cpu_offload(self, nn.Linear(2, 2), 2)
            return
        fsdp_kwargs = {"cpu_offload": cpu_offload, "use_orig_params": use_orig_params}
        wrapper = offload_wrapper if offload_activations else checkpoint_wrapper
        device = self.device
        # Checkpointing around FSDP roots.
        ckpt_sequential_wrapped_fsdp = wrapper(
            SequentialModule(wrap_fsdp=True, device=device, **fsdp_kwargs)
        )
        # FSDP around checkpointed layers.
        inner_ckpt = SequentialModule(
            checkpoint_layer=True,
            offload_activations=offload_activations,
            wrap_fsdp=True,
            device=device,
            **fsdp_kwargs,
        )
        baseline = SequentialModule(wrap_fsdp=True, device=device, **fsdp_kwargs)
        # A reentrant checkpoint needs an input that requires grad.
        inp = torch.randn(10, 3, device=device, requires_grad=True)
        models = [ckpt_sequential_wrapped_fsdp, inner_ckpt, baseline]
        with patch_save_on_cpu(get_patched_save_on_cpu()):
            for i in range(2):
                losses, outputs = [], []
                for m in models:
                    check_offload = m is not baseline and i == 0 and offload_activations
                    if check_offload:
                        self.assertFalse(_save_on_cpu_called)
                    out = m(inp)
                    if check_offload:
                        self.assertTrue(_save_on_cpu_called)
                        _save_on_cpu_called = False
                    loss = out.sum()
                    loss.backward()
                    losses.append(loss)
                    outputs.append(out)
                self._verify_parity(losses, outputs, models)
        dist.barrier()

    @parametrize("cpu_offload", OFFLOAD_CONFIGS, offload_name)
    @parametrize("offload_activations", [True, False])
    @parametrize("use_orig_params", [False, True])
    def test_basic_checkpoint_end_to_end(
        self, cpu_offload: CPUOffload, offload_activations: bool, use_orig_params: bool
    ) -> None:
        """One FSDP unit checkpointed from outside (wrapper, or a reentrant
        ``checkpoint`` call) or checkpointing inside trains like the plain unit
        over six iterations."""
        global _save_on_cpu_called
        if torch_refuses_cpu_offload(cpu_offload):
            assert_torch_refuses_cpu_offload(self, nn.Linear(2, 2), 2)
            return
        fsdp_kwargs = {"cpu_offload": cpu_offload, "use_orig_params": use_orig_params}
        with patch_save_on_cpu(get_patched_save_on_cpu()):
            seq = SequentialModule(device=self.device)
            wrapper = offload_wrapper if offload_activations else checkpoint_wrapper
            fsdp_only_seq = FSDP(copy.deepcopy(seq), **fsdp_kwargs)
            checkpointed_fsdp = wrapper(FSDP(copy.deepcopy(seq), **fsdp_kwargs))
            fsdp_wrapped_checkpoint = FSDP(wrapper(copy.deepcopy(seq)), **fsdp_kwargs)
            fsdp_call_checkpoint = FSDP(copy.deepcopy(seq), **fsdp_kwargs)
            inp = torch.randn(10, 3, device=self.device, requires_grad=True)
            self.assertFalse(_save_on_cpu_called)
            models = [
                fsdp_only_seq,
                checkpointed_fsdp,
                fsdp_wrapped_checkpoint,
                fsdp_call_checkpoint,
            ]
            for i in range(6):
                losses, outputs = [], []
                for m in models:
                    check_offload = m is not fsdp_only_seq and i == 0 and offload_activations
                    if m is fsdp_call_checkpoint:
                        self.assertFalse(_save_on_cpu_called)
                        offload_ctx = (
                            get_patched_save_on_cpu()(pin_memory=True)
                            if offload_activations
                            else contextlib.nullcontext()
                        )
                        with offload_ctx:
                            out = checkpoint(m, inp, use_reentrant=True)
                    else:
                        self.assertFalse(_save_on_cpu_called)
                        out = m(inp)
                    if check_offload:
                        self.assertTrue(_save_on_cpu_called)
                    loss = out.sum()
                    loss.backward()
                    losses.append(loss)
                    outputs.append(out)
                    _save_on_cpu_called = False
                self._verify_parity(losses, outputs, models)
        dist.barrier()


class CheckpointModule(nn.Module):
    def __init__(self, checkpoint: bool = False, use_reentrant: bool = True) -> None:
        super().__init__()
        self.seq = nn.Sequential(*[nn.Linear(100, 100) for _ in range(4)])
        self.checkpoint = checkpoint
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint:
            return checkpoint(self.seq, x, use_reentrant=self.use_reentrant)
        return self.seq(x)


class ModelWithCheckpointSubmodule(nn.Module):
    def __init__(self, checkpoint: bool = False, use_reentrant: bool = True) -> None:
        super().__init__()
        self.l1 = nn.Linear(100, 100)
        self.s1 = CheckpointModule(checkpoint, use_reentrant)
        self.s2 = CheckpointModule(checkpoint, use_reentrant)
        self.relu = nn.ReLU()
        self.l2 = nn.Linear(100, 100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.relu(self.s2(self.s1(self.l1(x)))))


class TestModel(nn.Module):
    __test__ = False  # a model, not a pytest test class

    def __init__(self, checkpoint: bool = False, use_reentrant: bool = True) -> None:
        super().__init__()
        self.l1 = nn.Linear(100, 100)
        self.relu = nn.ReLU()
        self.checkpoint1 = ModelWithCheckpointSubmodule(checkpoint, use_reentrant)
        self.checkpoint2 = ModelWithCheckpointSubmodule(checkpoint, use_reentrant)
        self.l2 = nn.Linear(100, 100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.relu(self.checkpoint2(self.checkpoint1(self.l1(x)))))


class TestFSDPCheckpointSubmodule(FSDPTest):
    # Upstream parametrizes use_reentrant over [False] only: its gradient checks
    # occasionally failed with True.
    @parametrize("use_reentrant", [False])
    def test_checkpoint_submodule(self, use_reentrant: bool) -> None:
        """Two FSDP roots (``module=`` as a keyword) under a plain module, with
        checkpointed submodules inside: the same names and gradients as without."""
        model = TestModel(use_reentrant=use_reentrant).to(self.device)
        model_ac = copy.deepcopy(model)
        for _, m in model_ac.named_modules():
            if isinstance(m, CheckpointModule):
                m.checkpoint = True
        self.assertTrue(model_ac.checkpoint1.s1.checkpoint)
        self.assertTrue(model_ac.checkpoint2.s2.checkpoint)
        fsdp_kwargs = {"device_id": self.device, "sharding_strategy": ShardingStrategy.NO_SHARD}
        # Wrap no checkpointing model submodules with FSDP
        model.checkpoint1 = FSDP(module=model.checkpoint1, **fsdp_kwargs)
        model.checkpoint2 = FSDP(module=model.checkpoint2, **fsdp_kwargs)
        # Wrap checkpointing model submodules with FSDP
        model_ac.checkpoint1 = FSDP(module=model_ac.checkpoint1, **fsdp_kwargs)
        model_ac.checkpoint2 = FSDP(module=model_ac.checkpoint2, **fsdp_kwargs)
        x = torch.randn(2, 100, device=self.device)
        model(x).sum().backward()
        model_ac(x).sum().backward()
        for (n1, p1), (n2, p2) in zip(model.named_parameters(), model_ac.named_parameters()):
            self.assertEqual(n1, n2)
            self.assertTrue(p1.grad.allclose(p2.grad))
