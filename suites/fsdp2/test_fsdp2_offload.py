"""FSDP2 CPU offload (``CPUOffloadPolicy``): the sharded parameters and their
gradients live on the CPU, the compute runs on the mesh's device, the optimizer
steps the CPU shards, state dicts hold CPU DTensors, and training matches the
replicated reference. ``OffloadPolicy()`` (the default) offloads nothing. Facts
from upstream's ``test_fully_shard_training.py`` (``test_train_parity_with_cpu_offload``)
and ``test_fully_shard_state_dict.py``.

Pinning host memory needs an accelerator: on CPU ranks only
``CPUOffloadPolicy(pin_memory=False)`` is run (the other is skipped, saying so).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.tensor import DTensor

from fsdptest.api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from suites.fsdp2.helpers import (
    LOW_PRECISION_TOL,
    FSDP2Test,
    LowPrecisionReference,
    assert_sharded_close,
    average_gradients,
    batch,
    lockstep,
    mlp_stack,
    shard_each,
)
from upstream.common_fsdp import check_sharded_parity

PIN_NEEDS_ACCELERATOR = (
    "CPUOffloadPolicy(pin_memory=True) pins host memory, which needs an accelerator; "
    "this rank has none"
)


class TestFullyShardCPUOffload(FSDP2Test):
    def _policy(self, pin_memory: bool) -> CPUOffloadPolicy:
        if pin_memory and self.device_type == "cpu":
            pytest.skip(PIN_NEEDS_ACCELERATOR)
        return CPUOffloadPolicy(pin_memory=pin_memory)

    def test_train_parity_with_cpu_offload(self) -> None:
        """Offloaded training matches the reference, resharding after forward or
        not, with or without a bf16 compute policy."""
        self.run_subtests(
            {
                "pin_memory": [False, True],
                "reshard_after_forward": [True, False],
                "param_dtype": [None, torch.bfloat16],
            },
            self._train,
        )

    def _train(
        self, pin_memory: bool, reshard_after_forward: bool, param_dtype: torch.dtype | None
    ) -> None:
        policy = self._policy(pin_memory)
        mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype)
        run = lockstep(
            self,
            lambda: mlp_stack(6, depth=2),
            functools.partial(
                shard_each,
                offload_policy=policy,
                mp_policy=mp_policy,
                reshard_after_forward=reshard_after_forward,
            ),
        )
        if param_dtype is None:
            run.train(2, (2, 6))
            return
        reference = LowPrecisionReference(run.reference, param_dtype, param_dtype)
        for step in range(2):
            x = batch(self.rank, step, 2, 6)
            loss = run.model(x).sum()
            loss.backward()
            self.assertEqual(loss, reference.backward(x), **LOW_PRECISION_TOL[param_dtype])
            assert_sharded_close(self, reference.full, run.model, param_dtype)
            run.optims[0].step()
            run.optims[0].zero_grad()
            reference.step()

    def test_offloaded_shards_live_on_the_cpu(self) -> None:
        """Shards, gradients and optimizer states of an offloaded model are on the
        CPU; the forward's unsharded parameters are on the mesh's device."""
        self.run_subtests({"pin_memory": [False, True]}, self._where)

    def _where(self, pin_memory: bool) -> None:
        model = mlp_stack(6, depth=2)
        shard_each(model, offload_policy=self._policy(pin_memory))
        devices: list[str] = []
        for mlp in model:
            mlp.register_forward_pre_hook(lambda m, _: devices.append(m.in_proj.weight.device.type))
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        model(batch(self.rank, 0, 2, 6)).sum().backward()
        optim.step()
        self.assertEqual(devices, [self.device_type] * 2)
        for name, param in model.named_parameters():
            self.assertEqual(param.to_local().device.type, "cpu", name)
            self.assertEqual(param.grad.to_local().device.type, "cpu", f"{name}.grad")
            for key, state in optim.state[param].items():
                if isinstance(state, DTensor):
                    self.assertEqual(state.to_local().device.type, "cpu", f"{name} {key}")
        for key, value in model.state_dict().items():
            self.assertEqual(value.to_local().device.type, "cpu", key)

    def test_default_offload_policy_offloads_nothing(self) -> None:
        """``OffloadPolicy()`` keeps shards on the mesh's device."""
        model = mlp_stack(6, depth=2)
        shard_each(model, offload_policy=OffloadPolicy())
        for name, param in model.named_parameters():
            self.assertEqual(param.to_local().device.type, self.device_type, name)

    def test_offloaded_state_dict_round_trip(self) -> None:
        """An offloaded model's state dict loads into another offloaded model and
        both then train alike."""
        policy = self._policy(False)
        models = [mlp_stack(6, depth=2, seed=seed) for seed in (0, 1)]
        for model in models:
            shard_each(model, offload_policy=policy)
        models[1].load_state_dict(models[0].state_dict())
        optims = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in models]
        for model, optim in zip(models, optims, strict=True):
            model(batch(self.rank, 0, 2, 6)).sum().backward()
            optim.step()
        for (name, a), (_, b) in zip(
            models[0].named_parameters(), models[1].named_parameters(), strict=True
        ):
            self.assertEqual(a.to_local(), b.to_local(), msg=name)


class TestFullyShardCPUOffloadMore(FSDP2Test):
    def test_offload_with_gradient_accumulation(self) -> None:
        """Microbatches without sync under offload accumulate as the reference."""
        run = lockstep(
            self,
            lambda: mlp_stack(6, depth=2),
            functools.partial(shard_each, offload_policy=CPUOffloadPolicy(pin_memory=False)),
        )
        for micro in range(3):
            run.model.set_requires_gradient_sync(micro == 2)
            x = batch(self.rank, micro, 2, 6)
            for model in (run.model, run.reference):
                model(x).sum().backward()
        average_gradients(run.reference)
        check_sharded_parity(self, run.reference, run.model)

    def test_offload_with_clip_grad_norm(self) -> None:
        """``clip_grad_norm_`` over offloaded (CPU) DTensor gradients gives the
        reference's norm (its all-reduce of a CPU partial norm needs a group with a
        CPU backend: see [Note: CPU tensors on CUDA ranks])."""
        run = lockstep(
            self,
            lambda: mlp_stack(6, depth=2),
            functools.partial(
                shard_each,
                mesh=self.cpu_capable_mesh(),
                offload_policy=CPUOffloadPolicy(pin_memory=False),
            ),
        )
        run.backward(batch(self.rank, 0, 2, 6))
        ref_norm = torch.nn.utils.clip_grad_norm_(run.reference.parameters(), 0.5)
        norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), 0.5)
        self.assertEqual(norm.full_tensor().to(ref_norm.device), ref_norm)
