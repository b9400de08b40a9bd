"""FSDP2 state dicts: ``state_dict()`` of DTensors (after forward too, and in
full precision under mixed precision), loading one into a freshly sharded model,
``torch.distributed.checkpoint.state_dict``'s ``get_model_state_dict`` /
``get_optimizer_state_dict`` (sharded and full, with CPU offload) and their
``set_*`` loads, and a DCP save/load round trip; after each load, training goes on
as the model that was saved. Facts from upstream's ``test_fully_shard_state_dict.py``
and ``test/distributed/checkpoint``'s FSDP2 tests.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from fsdptest.api import MixedPrecisionPolicy
from suites.fsdp2.helpers import LR, FSDP2Test, batch, full_tensor, mlp_stack, shard_each

DIM = 6


def trained(
    case: FSDP2Test, seed: int = 0, steps: int = 2, **kwargs: object
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A sharded MLP stack trained ``steps`` Adam steps (so the optimizer has state)."""
    model = mlp_stack(DIM, depth=2, seed=seed)
    shard_each(model, **kwargs)
    optim = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(steps):
        model(batch(case.rank, step, 2, DIM)).sum().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def fresh(seed: int = 1, **kwargs: object) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = mlp_stack(DIM, depth=2, seed=seed)
    shard_each(model, **kwargs)
    return model, torch.optim.Adam(model.parameters(), lr=LR)


def assert_same_training(
    case: FSDP2Test,
    first: tuple[nn.Module, torch.optim.Optimizer],
    second: tuple[nn.Module, torch.optim.Optimizer],
) -> None:
    """Both models hold the same shards, and one more step keeps them equal."""
    model_a, model_b = first[0], second[0]
    for (name, a), (_, b) in zip(
        model_a.named_parameters(), model_b.named_parameters(), strict=True
    ):
        case.assertEqual(a.to_local(), b.to_local(), msg=name)
    x = batch(case.rank, 50, 2, DIM)
    for model, optim in (first, second):
        model(x).sum().backward()
        optim.step()
    for (name, a), (_, b) in zip(
        model_a.named_parameters(), model_b.named_parameters(), strict=True
    ):
        case.assertEqual(a.to_local(), b.to_local(), msg=f"{name} after a step")


class TestFullyShardStateDict(FSDP2Test):
    def test_state_dict_values_are_dtensors(self) -> None:
        """``state_dict()`` has the unsharded module's keys; every parameter's value is
        a DTensor with the parameter's mesh and placements whose full tensor is the
        parameter's; buffers are plain tensors."""
        self.run_subtests(
            {"reshard_after_forward": [True, False], "with_buffer": [False, True]}, self._values
        )

    def _values(self, reshard_after_forward: bool, with_buffer: bool) -> None:
        model = mlp_stack(DIM, depth=2, with_buffer=with_buffer)
        keys = list(model.state_dict())
        shard_each(model, reshard_after_forward=reshard_after_forward)
        state_dict = model.state_dict()
        self.assertEqual(list(state_dict), keys)
        params = dict(model.named_parameters())
        for key, value in state_dict.items():
            if key not in params:
                self.assertFalse(isinstance(value, DTensor), key)
                continue
            self.assertIsInstance(value, DTensor, key)
            self.assertEqual(tuple(value.placements), tuple(params[key].placements), msg=key)
            self.assertEqual(value.full_tensor(), params[key].full_tensor(), msg=key)

    def test_state_dict_after_forward_is_sharded(self) -> None:
        """Between forward and backward (parameters unsharded when not resharding) the
        state dict still holds sharded DTensors."""
        self.run_subtests({"reshard_after_forward": [True, False]}, self._after_forward)

    def _after_forward(self, reshard_after_forward: bool) -> None:
        model = mlp_stack(DIM, depth=2)
        shard_each(model, reshard_after_forward=reshard_after_forward)
        out = model(batch(self.rank, 0, 2, DIM))
        for key, value in model.state_dict().items():
            self.assertIsInstance(value, DTensor, key)
        out.sum().backward()

    def test_state_dict_under_mixed_precision_is_full_precision(self) -> None:
        """A bf16 compute policy leaves the state dict's values fp32."""
        model = mlp_stack(DIM, depth=2)
        shard_each(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        model(batch(self.rank, 0, 2, DIM)).sum().backward()
        for key, value in model.state_dict().items():
            self.assertEqual(value.dtype, torch.float32, key)

    def test_load_state_dict_round_trip(self) -> None:
        """A saved state dict loaded into a model sharded from other weights makes it
        the saved model: same shards, and the same training from there."""
        self.run_subtests(
            {"reshard_after_forward": [True, False], "strict": [True, False]}, self._round_trip
        )

    def _round_trip(self, reshard_after_forward: bool, strict: bool) -> None:
        saved = trained(self, reshard_after_forward=reshard_after_forward)
        loaded = fresh(reshard_after_forward=reshard_after_forward)
        result = loaded[0].load_state_dict(saved[0].state_dict(), strict=strict)
        self.assertEqual((result.missing_keys, result.unexpected_keys), ([], []))
        # A deep copy: Optimizer.load_state_dict keeps the tensors it is given when
        # their device and dtype fit, so the two optimizers would share their states.
        loaded[1].load_state_dict(copy.deepcopy(saved[1].state_dict()))
        assert_same_training(self, saved, loaded)

    def test_load_state_dict_missing_key_raises(self) -> None:
        """``strict=True`` refuses a state dict without one of the keys; ``strict=False``
        reports it."""
        model, _ = fresh()
        state_dict = model.state_dict()
        missing = next(iter(state_dict))
        del state_dict[missing]
        with self.assertRaisesRegex(RuntimeError, "Missing key"):
            model.load_state_dict(state_dict)
        result = model.load_state_dict(state_dict, strict=False)
        self.assertEqual(result.missing_keys, [missing])


class TestFullyShardDistributedStateDict(FSDP2Test):
    def test_get_model_state_dict(self) -> None:
        """``get_model_state_dict``: DTensors by default; with ``full_state_dict`` the
        full tensors on every rank, or, with ``cpu_offload``, on rank 0 only (on the CPU)."""
        self.run_subtests(
            {"full_state_dict": [False, True], "cpu_offload": [False, True]}, self._model_sd
        )

    def _model_sd(self, full_state_dict: bool, cpu_offload: bool) -> None:
        model, _ = trained(self)
        options = StateDictOptions(full_state_dict=full_state_dict, cpu_offload=cpu_offload)
        state_dict = get_model_state_dict(model, options=options)
        expected = {n: p.full_tensor().cpu() for n, p in model.named_parameters()}
        if full_state_dict and cpu_offload and self.rank != 0:
            self.assertEqual(state_dict, {})
            return
        self.assertEqual(sorted(state_dict), sorted(expected))
        # gathered on the rank's device, offloaded values too
        values = {key: full_tensor(value) for key, value in state_dict.items()}
        for key, value in state_dict.items():
            self.assertEqual(isinstance(value, DTensor), not full_state_dict, key)
            if cpu_offload:
                self.assertEqual(value.device.type, "cpu", key)
            self.assertEqual(values[key].cpu(), expected[key], msg=key)

    def test_set_model_state_dict_from_full_tensors(self) -> None:
        """``set_model_state_dict`` with ``full_state_dict`` loads plain full tensors
        (broadcast from rank 0 with ``broadcast_from_rank0``) into the shards."""
        self.run_subtests({"broadcast_from_rank0": [False, True]}, self._set_full)

    def _set_full(self, broadcast_from_rank0: bool) -> None:
        saved, _ = trained(self)
        full = {k: v.full_tensor() for k, v in saved.state_dict().items()}
        if broadcast_from_rank0 and self.rank != 0:
            full = {}
        model, _ = fresh()
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast_from_rank0)
        set_model_state_dict(model, full, options=options)
        for (name, a), (_, b) in zip(
            saved.named_parameters(), model.named_parameters(), strict=True
        ):
            self.assertEqual(a.to_local(), b.to_local(), msg=name)

    def test_optimizer_state_dict_round_trip(self) -> None:
        """``get_optimizer_state_dict`` keys the states by parameter name, sharded
        (DTensor states) or full (plain tensors); ``set_optimizer_state_dict`` of
        either into a fresh model's optimizer resumes the same training."""
        self.run_subtests({"full_state_dict": [False, True]}, self._optim_round_trip)

    def _optim_round_trip(self, full_state_dict: bool) -> None:
        saved = trained(self)
        options = StateDictOptions(full_state_dict=full_state_dict)
        model_sd = get_model_state_dict(saved[0], options=options)
        optim_sd = get_optimizer_state_dict(saved[0], saved[1], options=options)
        names = {n for n, _ in saved[0].named_parameters()}
        self.assertEqual(set(optim_sd["state"]), names)
        for name, state in optim_sd["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                self.assertEqual(
                    isinstance(state[key], DTensor), not full_state_dict, f"{name}.{key}"
                )
        loaded = fresh()
        set_model_state_dict(loaded[0], model_sd, options=options)
        set_optimizer_state_dict(loaded[0], loaded[1], copy.deepcopy(optim_sd), options=options)
        assert_same_training(self, saved, loaded)

    def test_dcp_save_load_round_trip(self, tmp_path: Path) -> None:
        """``dcp.save`` of the model's and optimizer's sharded state dicts and
        ``dcp.load`` into a fresh model resume the same training."""
        self.run_subtests(
            {"reshard_after_forward": [True, False]},
            functools.partial(self._dcp, tmp_path),
        )

    def _dcp(self, tmp_path: Path, reshard_after_forward: bool) -> None:
        checkpoint = str(tmp_path / f"reshard_{reshard_after_forward}")
        saved = trained(self, reshard_after_forward=reshard_after_forward)
        dcp.save(
            {
                "model": get_model_state_dict(saved[0]),
                "optim": get_optimizer_state_dict(saved[0], saved[1]),
            },
            checkpoint_id=checkpoint,
        )
        loaded = fresh(reshard_after_forward=reshard_after_forward)
        state = {
            "model": get_model_state_dict(loaded[0]),
            "optim": get_optimizer_state_dict(loaded[0], loaded[1]),
        }
        dcp.load(state, checkpoint_id=checkpoint)
        set_model_state_dict(loaded[0], state["model"])
        set_optimizer_state_dict(loaded[0], loaded[1], state["optim"])
        assert_same_training(self, saved, loaded)


class TestFullyShardHSDPStateDict(FSDP2Test):
    world_size = 4

    def test_hsdp_state_dict(self) -> None:
        """On a 2x2 mesh the state dict's values are (Replicate(), Shard(0)) DTensors
        and load into a fresh model on the same mesh."""
        mesh = self.hsdp_mesh(2)
        saved = trained(self, mesh=mesh)
        state_dict = saved[0].state_dict()
        for key, value in state_dict.items():
            self.assertEqual([p.is_replicate() for p in value.placements], [True, False], key)
        loaded = fresh(mesh=mesh)
        loaded[0].load_state_dict(state_dict)
        loaded[1].load_state_dict(copy.deepcopy(saved[1].state_dict()))  # see _round_trip
        assert_same_training(self, saved, loaded)


class TestFullyShardStateDictContents(FSDP2Test):
    def test_keys_under_nesting(self) -> None:
        """Nested groups (children, grandchildren) keep the unsharded module's keys,
        and the saved values load back into a model nested the same way."""
        self.run_subtests({"nesting": ["root", "children", "linears"]}, self._nested_keys)

    def _nested_keys(self, nesting: str) -> None:
        def shard(model: nn.Module) -> None:
            linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
            groups = {"root": [], "children": list(model), "linears": linears}[nesting]
            shard_each(model, groups)

        model = mlp_stack(DIM, depth=2)
        keys = list(model.state_dict())
        shard(model)
        self.assertEqual(list(model.state_dict()), keys)
        other = mlp_stack(DIM, depth=2, seed=5)
        shard(other)
        other.load_state_dict(model.state_dict())
        for (name, a), (_, b) in zip(
            model.named_parameters(), other.named_parameters(), strict=True
        ):
            self.assertEqual(a.to_local(), b.to_local(), msg=name)

    def test_loaded_model_gives_the_saved_outputs(self) -> None:
        """After a load the model's forward gives the saved model's outputs."""
        saved, _ = trained(self)
        loaded, _ = fresh()
        loaded.load_state_dict(saved.state_dict())
        x = batch(self.rank, 7, 3, DIM)
        self.assertEqual(loaded(x), saved(x))

    def test_frozen_and_ignored_parameters_in_the_state_dict(self) -> None:
        """Frozen parameters are sharded DTensors in the state dict as the others;
        ignored ones are the plain tensors they are."""
        model = mlp_stack(DIM, depth=2)
        model[0].requires_grad_(False)
        ignored = set(model[1].out_proj.parameters())
        shard_each(model, ignored_params=ignored)
        for key, value in model.state_dict().items():
            self.assertEqual(isinstance(value, DTensor), not key.startswith("1.out_proj"), key)

    def test_optimizer_state_dict_names_under_nesting(self) -> None:
        """``get_optimizer_state_dict`` names every state by the parameter's name
        whatever the grouping, with Adam's step, exp_avg and exp_avg_sq."""
        self.run_subtests({"grouping": ["root", "children"]}, self._optim_names)

    def _optim_names(self, grouping: str) -> None:
        model = mlp_stack(DIM, depth=2)
        shard_each(model, [] if grouping == "root" else list(model))
        optim = torch.optim.Adam(model.parameters(), lr=LR)
        model(batch(self.rank, 0, 2, DIM)).sum().backward()
        optim.step()
        state = get_optimizer_state_dict(model, optim)["state"]
        self.assertEqual(set(state), {n for n, _ in model.named_parameters()})
        for name, value in state.items():
            self.assertEqual(set(value), {"step", "exp_avg", "exp_avg_sq"}, name)
