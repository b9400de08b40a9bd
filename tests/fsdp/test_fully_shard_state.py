"""``fully_shard``'s parameters as state: state dicts of DTensors and a
``torch.distributed.checkpoint`` round trip, ``clip_grad_norm_`` over DTensor
gradients, deferred initialisation on the meta device, CPU offloading,
ignored parameters, sharding along another dimension, and the mixed-precision
casts of inputs and outputs; each against torch's ``fully_shard`` (exact)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Shard

from harness import DistributedTest
from tests.fsdp.fully_shard_cases import (
    IMPLEMENTATIONS,
    OURS,
    assert_same_params,
    batch,
    local_batch,
    lockstep,
    loss_of,
    model,
    shard_layers,
    twins,
)


def _sharded(api: SimpleNamespace, device: torch.device, **kwargs: Any) -> nn.Sequential:
    return shard_layers(model(device), api, **kwargs)


def _train(module: nn.Module, test: DistributedTest, steps: int = 2) -> torch.optim.Optimizer:
    optim = torch.optim.Adam(module.parameters(), lr=0.01)
    for step in range(steps):
        loss_of(module, local_batch(test, step)).backward()
        optim.step()
        optim.zero_grad()
    return optim


class TestFullyShardState(DistributedTest):
    world_size = 2

    def test_state_dict_round_trip(self) -> None:
        """state_dict() holds the sharded DTensors under the original names (also
        between forward and backward, where it reshards first); loading it back,
        in place or by assignment, restores the parameters."""
        self.run_subtests({"assign": [False, True]}, self._check_state_dict)

    def _check_state_dict(self, assign: bool) -> None:
        trained, other = _sharded(OURS, self.device), _sharded(OURS, self.device)
        _train(trained, self)
        state = trained.state_dict()
        self.assertEqual(list(state), [name for name, _ in model(self.device).named_parameters()])
        for name, value in state.items():
            self.assertTrue(isinstance(value, DTensor), name)
            self.assertEqual(value.placements, (Shard(0),))
        loss_of(other, local_batch(self, 0))  # unsharded until its backward
        other.load_state_dict(state, assign=assign)
        self.assertTrue(all(isinstance(p, DTensor) for p in other.parameters()))
        for mine, theirs in zip(other.parameters(), trained.parameters()):
            self.assertEqual(mine.to_local(), theirs.to_local(), atol=0, rtol=0)
        lockstep(self, [other, trained], steps=2)

    def test_checkpoint_round_trip(self, tmp_path: Path) -> None:
        """torch.distributed.checkpoint saves the model and optimizer (DCP's
        get_state_dict) and loads them into a fresh model: training goes on as
        torch's does from its own checkpoint."""
        models = []
        for api in IMPLEMENTATIONS:
            trained = _sharded(api, self.device)
            optim = _train(trained, self)
            model_state, optim_state = get_state_dict(trained, optim)
            path = tmp_path / api.name
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
            fresh = _sharded(api, self.device)
            fresh_optim = torch.optim.Adam(fresh.parameters(), lr=0.01)
            model_state, optim_state = get_state_dict(fresh, fresh_optim)
            loaded = {"model": model_state, "optim": optim_state}
            dcp.load(loaded, checkpoint_id=path)
            set_state_dict(
                fresh,
                fresh_optim,
                model_state_dict=loaded["model"],
                optim_state_dict=loaded["optim"],
            )
            assert_same_params(self, fresh, trained, grads=False)
            for step in range(2):
                loss_of(fresh, local_batch(self, 10 + step)).backward()
                fresh_optim.step()
                fresh_optim.zero_grad()
            models.append(fresh)
        assert_same_params(self, models[0], models[1], grads=False)

    def test_clip_grad_norm(self) -> None:
        """torch.nn.utils.clip_grad_norm_ over the DTensor gradients: the total norm
        of the full gradients (that of an unsharded model on the whole batch), the
        same on every rank, and the clipped gradients torch's."""
        self.run_subtests({"norm_type": [2.0, float("inf")]}, self._check_clip)

    def _check_clip(self, norm_type: float) -> None:
        models = [_sharded(api, self.device) for api in IMPLEMENTATIONS]
        norms = []
        for sharded in models:
            loss_of(sharded, local_batch(self, 0)).backward()
            norms.append(nn.utils.clip_grad_norm_(sharded.parameters(), 0.5, norm_type=norm_type))
        reference = model(self.device)
        whole = torch.cat([local_batch_of(self, r) for r in range(self.world_size)])
        (loss_of(reference, whole) / self.world_size).backward()
        expected = nn.utils.clip_grad_norm_(reference.parameters(), 0.5, norm_type=norm_type)
        self.assertEqual(norms[0].full_tensor(), norms[1].full_tensor(), atol=0, rtol=0)
        # the reference sums all rows at once, the shards per rank: another order
        self.assertEqual(norms[0].full_tensor(), expected, atol=1e-5, rtol=1e-5)
        assert_same_params(self, models[0], models[1])

    def test_meta_device_init(self) -> None:
        """A model built on the meta device, sharded there, then to_empty and
        reset_parameters: its first forward without materialising is refused;
        after, it trains as torch's does."""
        models = []
        for api in IMPLEMENTATIONS:
            torch.manual_seed(0)
            with torch.device("meta"):
                meta = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3), nn.Linear(3, 11))
            shard_layers(meta, api)
            if api is OURS:
                with self.assertRaisesRegex(
                    RuntimeError, "should be materialized from meta device"
                ):
                    meta(local_batch(self, 0))
                meta.reset_iter_state()
            meta.to_empty(device=self.device)
            torch.manual_seed(1)
            for layer in meta:
                if isinstance(layer, nn.Linear):
                    layer.reset_parameters()
            models.append(meta)
        assert_same_params(self, models[0], models[1], grads=False)
        lockstep(self, models, steps=2)

    def test_cpu_offload(self) -> None:
        """CPUOffloadPolicy: shards and gradients on the CPU; training is torch's."""
        models = twins(
            lambda api: _sharded(
                api, self.device, offload_policy=api.CPUOffloadPolicy(pin_memory=False)
            )
        )
        lockstep(self, models, steps=2)
        for param in models[0].parameters():
            self.assertEqual(param.to_local().device.type, "cpu")

    def test_ignored_params(self) -> None:
        """An ignored parameter stays a plain tensor where it was, gets its local
        gradient unreduced, and the rest trains as torch's."""
        models = []
        for api in IMPLEMENTATIONS:
            net = model(self.device)
            ignored = {net[2].weight}
            for index in (0, 2, 3):
                api.fully_shard(net[index], ignored_params=ignored)
            api.fully_shard(net, ignored_params=ignored)
            models.append(net)
        lockstep(self, models, steps=2)
        for net in models:
            self.assertFalse(isinstance(net[2].weight, DTensor))
            self.assertTrue(isinstance(net[2].bias, DTensor))

    def test_shard_placement_fn(self) -> None:
        """Shard(1) for the weights (their columns divide evenly), Shard(0) else:
        the placements and training are torch's."""

        def placement(param: nn.Parameter) -> Shard | None:
            return Shard(1) if param.ndim == 2 and param.size(1) % self.world_size == 0 else None

        models = twins(lambda api: _wide(api, self.device, shard_placement_fn=placement))
        self.assertEqual(models[0][0].weight.placements, (Shard(1),))
        lockstep(self, models, steps=2, inputs=lambda step: local_batch(self, step, features=4))

    def test_mixed_precision_casts(self) -> None:
        """output_dtype casts the outputs, cast_forward_inputs=False leaves the
        inputs as given (the module then computes in its parameters' dtype)."""
        for cast_inputs in (True, False):
            models = []
            for api in IMPLEMENTATIONS:
                policy = api.MixedPrecisionPolicy(
                    param_dtype=torch.bfloat16,
                    output_dtype=torch.float16,
                    cast_forward_inputs=cast_inputs,
                )
                net = model(self.device)
                api.fully_shard(net, mp_policy=policy)
                x = local_batch(self, 0).to(torch.bfloat16)
                out = net(x)
                self.assertEqual(out.dtype, torch.float16)
                out.float().sum().backward()
                models.append(net)
            assert_same_params(self, models[0], models[1])


def local_batch_of(test: DistributedTest, rank: int) -> torch.Tensor:
    return batch(0, test.world_size, test.device)[4 * rank : 4 * rank + 4]


def _wide(api: SimpleNamespace, device: torch.device, **kwargs: Any) -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)).to(device)
    for layer in (net[0], net[2]):
        api.fully_shard(layer, **kwargs)
    api.fully_shard(net, **kwargs)
    return net
