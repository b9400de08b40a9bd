"""Optimizer state dicts (port of upstream ``test_fsdp_optim_state.py``).

What is pinned down: the full and sharded optimizer state dicts of FSDP models
(keyed by parameter name, equal to an unwrapped model's optimizer state) and
their conversion back into the state the local optimizer holds, through every
API (``full_optim_state_dict`` / ``shard_full_optim_state_dict`` /
``scatter_full_optim_state_dict`` / ``sharded_optim_state_dict`` /
``flatten_sharded_optim_state_dict`` / ``optim_state_dict`` /
``optim_state_dict_to_load``), across wrappings (``wrap`` vs ``wrap_alt``),
world sizes (a dict from every rank loaded on a group of the even ranks),
optimizer parameter orders and groups, ``use_orig_params``, ``NO_SHARD``,
ignored and unmanaged parameters, parameters without state and parameters whose
``requires_grad`` changes; ``rekey_optim_state_dict`` between names and IDs; the
deprecation warning of ``optim_input``; and the errors for missing states.

"cuda" in upstream is the test's device (``self.device``) here; on a CPU run
"not on the GPU" is "on the CPU" and "on the GPU" is "on the test's device".

[Note: Torch aliases the gathered states of original parameters on the CPU]
With ``use_orig_params=True`` torch's FSDP all-gathers every tensor state of a
unit (Adam's ``exp_avg``, then ``exp_avg_sq``) into one buffer it reuses, takes
views of it, and offloads them with ``.cpu()`` (``offload_to_cpu=True``, the
default of full optimizer state dicts). ``.cpu()`` of a CPU tensor is the tensor
itself: on a CPU-only run every tensor state of a sharded unit's parameter in
the full dict is a view of the last state gathered, so the dict does not load
back. Under ``--fsdp-impl torch`` on the CPU those cases assert the aliasing
(so that a fix in torch shows up here) instead of the round trip.

[Note: Object collectives without numpy]
Torch's FSDP sends the keys and metadata of optimizer state dicts with
``broadcast_object_list`` / ``all_gather_object``, which unpickle the received
bytes through ``tensor.numpy()``: under ``--fsdp-impl torch`` this file needs
numpy (skipped without it). Our FSDP and this file's own broadcast (standing in
for ``torch.save`` / ``torch.load``) send pickled bytes as a ``uint8`` tensor
and need no numpy.
"""

from __future__ import annotations

import bisect
import copy
import enum
import io
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._state_dict_utils import _gather_state_dict
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_WRAPPED_MODULE,
    apply_activation_checkpointing,
)

from fsdptest import FSDPTest
from fsdptest.api import (
    ADAPTER,
    FSDP,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictSettings,
    StateDictType,
)
from fsdptest.interface import DeviceInitMode, FSDPInitMode
from harness import current_device, parametrize
from models import TransformerWithSharedParams

STATE_DICT_TYPES = [StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT]

if ADAPTER.limitations.optim_keys_need_numpy:  # see [Note: Object collectives without numpy]
    pytestmark = pytest.mark.requires_module(
        "numpy",
        reason="torch's FSDP sends optimizer state-dict keys with object collectives, "
        "which unpickle through numpy",
    )

OSD = dict[str, Any]
OptimInput = list[nn.Parameter] | list[dict[str, Any]] | None
ModelAndOptim = tuple[nn.Module, torch.optim.Optimizer, OptimInput]


class _OSDCommMethod(enum.Enum):
    """How the first model's optimizer state dict reaches the second model."""

    BROADCAST_OBJECT_LIST = enum.auto()
    SCATTER_FULL_OSD = enum.auto()
    FLATTEN_SHARDED_OSD = enum.auto()
    OPTIM_STATE_DICT = enum.auto()


class _ModelClass(enum.Enum):
    NESTED = enum.auto()
    TRANSFORMER = enum.auto()


class Bias(nn.Module):
    """Adds a learned bias of size ``dim``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bias = nn.Parameter(torch.randn((dim,)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias


class BlockA(nn.Module):
    """``bias_module0``, then ``weight``, then ``bias_module1``: the weight sits
    between two child modules in registration order."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bias_module0 = Bias(out_dim)
        self.weight = nn.Parameter(torch.randn((in_dim, out_dim)))
        self.bias_module1 = Bias(out_dim)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bias_module0(x @ self.weight)
        return self.bias_module1(self.relu(x))  # the two biases get different gradients


class BlockB(nn.Module):
    """``weight`` first, then two bias modules."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn((in_dim, out_dim)))
        self.bias_module0 = Bias(out_dim)
        self.bias_module1 = Bias(out_dim)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bias_module0(x @ self.weight)
        return self.bias_module1(self.relu(x))


class NestedModel(nn.Module):
    """Blocks nested so that FSDP units, unmanaged parameters and a parameter of
    the root interleave in ``parameters()`` order."""

    def __init__(self) -> None:
        super().__init__()
        self.block0 = BlockB(5, 3)
        self.block1 = BlockB(3, 7)
        self.bias = nn.Parameter(torch.randn((5,)))
        self.block2 = nn.Sequential(BlockA(7, 9), BlockA(9, 9), BlockB(9, 5))
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.block0(x))
        x = self.relu(self.block1(x))
        x = self.relu(self.block2(x))
        return x + self.bias

    def get_input(self, device: torch.device) -> tuple[torch.Tensor]:
        return (torch.randn((8, 5)).to(device),)

    def get_loss(self, inp: tuple[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
        return output.sum()

    def run_backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    @staticmethod
    def wrap(
        model: nn.Module,
        group: dist.ProcessGroup | None = None,
        ignore_modules: bool = False,
        fsdp_kwargs: dict[str, Any] | None = None,
    ) -> nn.Module:
        """Wraps units inside the model (not the model itself): ``block1`` (its
        ``weight`` and ``bias_module1``) around a unit for ``bias_module0``;
        ``block2[1]`` (its ``weight``) around units for both biases; ``block2[2]``,
        optionally ignoring its ``bias_module0``. ``block0``, ``bias`` and
        ``block2[0]`` stay unmanaged."""
        kwargs = fsdp_kwargs or {}
        model.block1.bias_module0 = FSDP(model.block1.bias_module0, process_group=group, **kwargs)
        model.block1 = FSDP(model.block1, process_group=group, **kwargs)
        block = model.block2[1]
        block.bias_module0 = FSDP(block.bias_module0, process_group=group, **kwargs)
        block.bias_module1 = FSDP(block.bias_module1, process_group=group, **kwargs)
        model.block2[1] = FSDP(block, process_group=group, **kwargs)
        ignored = [model.block2[2].bias_module0] if ignore_modules else None
        model.block2[2] = FSDP(
            model.block2[2], process_group=group, ignored_modules=ignored, **kwargs
        )
        return model

    @staticmethod
    def wrap_alt(
        model: nn.Module,
        group: dist.ProcessGroup | None = None,
        fsdp_kwargs: dict[str, Any] | None = None,
    ) -> nn.Module:
        """Another wrapping: only ``block0`` around a unit for its ``bias_module0``."""
        kwargs = fsdp_kwargs or {}
        model.block0.bias_module0 = FSDP(model.block0.bias_module0, process_group=group, **kwargs)
        model.block0 = FSDP(model.block0, process_group=group, **kwargs)
        return model

    @staticmethod
    def wrap_with_unmanaged_params(
        model: nn.Module, add_to_fsdp_module: bool, group: dist.ProcessGroup | None = None
    ) -> tuple[nn.Module, list[nn.Parameter]]:
        """Registers one more parameter on ``block2[2]`` (to be flattened into its
        unit) or on the model (unmanaged), then ``wrap`` s."""
        device = next(model.parameters()).device
        unmanaged_param = nn.Parameter(torch.randn(5, 5, device=device))
        register_module = model.block2[2] if add_to_fsdp_module else model
        register_module.register_parameter("unmanaged_param", unmanaged_param)
        return NestedModel.wrap(model, group), [unmanaged_param]

    @staticmethod
    def add_unmanaged_param_entry(osd: OSD, unmanaged_param: nn.Parameter, step: int) -> None:
        """Adds Adam state for ``unmanaged_param`` under the parameter ID the
        flattened dict skipped (the first gap in group 0, else the next ID)."""
        param_ids = osd["param_groups"][0]["params"]
        unmanaged_param_id = len(param_ids)
        for prev, curr in zip(param_ids, param_ids[1:]):
            if curr - prev != 1:
                assert curr - prev > 1, f"Invalid IDs: {prev} {curr}"
                unmanaged_param_id = prev + 1
                break
        state_device = next(iter(next(iter(osd["state"].values())).values())).device
        osd["state"][unmanaged_param_id] = {
            "step": torch.tensor(float(step), device=state_device),
            "exp_avg": torch.randn(unmanaged_param.shape, device=state_device),
            "exp_avg_sq": torch.randn(unmanaged_param.shape, device=state_device),
        }
        bisect.insort(osd["param_groups"][0]["params"], unmanaged_param_id)

    # ``self.bias`` is in neither group: the optimizer does not hold every parameter.
    def param_group0(self) -> list[nn.Parameter]:
        return list(self.block1.parameters())

    def param_group1(self) -> list[nn.Parameter]:
        return list(self.block2.parameters()) + list(self.block0.parameters())


class TestDummyModel(nn.Module):
    """Four small linear stages; ``no_grad`` freezes the first linear layer."""

    __test__ = False  # a model, not a pytest class

    def __init__(self, no_grad: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net1 = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.net1[0].weight.requires_grad = not no_grad
        self.net1[0].bias.requires_grad = not no_grad
        self.net2 = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.net3 = nn.Linear(32, 64)
        self.net4 = nn.Sequential(nn.ReLU(), nn.Linear(64, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net4(self.net3(self.net2(self.net1(x))))

    def get_input(self) -> torch.Tensor:
        return torch.rand(8, 8, device=current_device())


def _state_values(osd: OSD) -> Iterator[Any]:
    for state in osd["state"].values():
        yield from state.values()


def _optim_input_values(state_dict_type: StateDictType) -> list[bool]:
    """The sharded APIs take no ``optim_input``."""
    return [False] if state_dict_type == StateDictType.SHARDED_STATE_DICT else [False, True]


def _torch_aliases_orig_param_states(
    device: torch.device, use_orig_params: bool, settings: StateDictSettings, group_size: int
) -> bool:
    """Whether torch's full dict aliases its tensor states (see [Note: Torch
    aliases the gathered states of original parameters on the CPU])."""
    full = settings.state_dict_type == StateDictType.FULL_STATE_DICT
    offload = getattr(settings.optim_state_dict_config, "offload_to_cpu", True)
    sharded = group_size > 1
    return (
        ADAPTER.known_defects.aliases_orig_param_optim_states_on_cpu
        and device.type == "cpu"
        and use_orig_params
        and full
        and offload
        and sharded
    )


class TestFSDPOptimState(FSDPTest):
    # -- models and training -------------------------------------------------------

    def _init_nested_model(
        self,
        wrap: bool,
        wrap_alt: bool = False,  # ignored if `wrap=False`
        group: dist.ProcessGroup | None = None,
        optim_class: type[torch.optim.Optimizer] = torch.optim.Adam,
        use_multiple_param_groups: bool = False,
        use_diff_optim_inputs: bool = False,
        fsdp_kwargs: dict[str, Any] | None = None,
    ) -> ModelAndOptim:
        model = NestedModel().to(self.device)
        if wrap:
            model = (
                NestedModel.wrap_alt(model, group, fsdp_kwargs)
                if wrap_alt
                else NestedModel.wrap(model, group, fsdp_kwargs=fsdp_kwargs)
            )
        optim_input: list[Any]
        if not use_multiple_param_groups:
            optim_input = list(model.parameters())
        else:
            optim_input = [
                {"params": model.param_group0()},
                {"params": model.param_group1(), "weight_decay": 0.9},
            ]
        # Odd ranks hand the optimizer the parameters in reversed order
        if use_diff_optim_inputs and self.rank % 2 == 1:
            if isinstance(optim_input[0], dict):
                for param_group in optim_input:
                    param_group["params"] = list(reversed(param_group["params"]))
            else:
                optim_input = list(reversed(optim_input))
        optim = optim_class(optim_input, lr=0.01)
        return model, optim, optim_input

    def _init_transformer_model(
        self,
        wrap: bool,
        group: dist.ProcessGroup | None = None,
        optim_class: type[torch.optim.Optimizer] = torch.optim.Adam,
        use_multiple_param_groups: bool = False,
        use_diff_optim_inputs: bool = False,
    ) -> ModelAndOptim:
        if use_multiple_param_groups or use_diff_optim_inputs:
            # The transformer has a single top-level unit: these settings are vacuous
            raise NotImplementedError
        model = TransformerWithSharedParams.init(
            group or self.process_group,
            FSDPInitMode.RECURSIVE if wrap else FSDPInitMode.NO_FSDP,
            DeviceInitMode.BEFORE,
            deterministic=True,
        )
        optim = optim_class(model.parameters(), lr=0.01)
        return model, optim, None

    def _initializer(self, model_class: _ModelClass) -> Callable[..., ModelAndOptim]:
        if model_class is _ModelClass.NESTED:
            return self._init_nested_model
        return self._init_transformer_model

    def _step_model(
        self, model: nn.Module, optim: torch.optim.Optimizer, num_iters: int = 1
    ) -> list[float]:
        """``num_iters`` forward/backward/step iterations; returns the losses."""
        torch.manual_seed(0)  # every rank, and every model, sees the same inputs
        losses = []
        module = getattr(model, "module", model)
        for _ in range(num_iters):
            optim.zero_grad()
            inp = module.get_input(self.device)
            output = model(*inp)
            loss = module.get_loss(inp, output).to(self.device)
            losses.append(loss.item())
            module.run_backward(loss)
            optim.step()
        return losses

    def _broadcast_full_osd(self, full_osd: OSD, group: dist.ProcessGroup | None = None) -> OSD:
        """Stands in for ``torch.save`` on rank 0 and ``torch.load`` everywhere (see
        [Note: Object collectives without numpy])."""
        src = dist.get_global_rank(group, 0) if group is not None else 0
        payload = torch.empty(0, dtype=torch.uint8)
        if self.rank == src:
            buffer = io.BytesIO()
            torch.save(full_osd, buffer)
            payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], device=self.device)
        dist.broadcast(size, src=src, group=group)
        if self.rank == src:
            data = payload.to(self.device)
        else:
            data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(data, src=src, group=group)
        return torch.load(io.BytesIO(bytes(data.cpu().untyped_storage())), weights_only=False)

    # -- comparisons ---------------------------------------------------------------

    def _are_equal_states(self, state1: dict[str, Any], state2: dict[str, Any]) -> bool:
        if set(state1.keys()) != set(state2.keys()):
            return False
        for state_name, value1 in state1.items():
            value2 = state2[state_name]
            if type(value1) is not type(value2):
                return False
            if torch.is_tensor(value1):
                value1, value2 = value1.cpu(), value2.cpu()  # device-agnostic
                if value1.shape != value2.shape or not torch.all(torch.isclose(value1, value2)):
                    return False
            elif value1 != value2:
                return False
        return True

    def _check_same_state(self, fsdp_osd: OSD, ref_osd: OSD, check_same_param_keys: bool) -> None:
        """Same "state" part; without ``check_same_param_keys`` the keys need only
        correspond (names on one side, IDs on the other)."""
        assert "state" in ref_osd
        self.assertTrue("state" in fsdp_osd)
        ref_osd_state = ref_osd["state"]
        fsdp_osd_state = {k: _gather_state_dict(v) for k, v in fsdp_osd["state"].items()}
        if check_same_param_keys:
            ref_ids, fsdp_ids = set(ref_osd_state.keys()), set(fsdp_osd_state.keys())
            self.assertTrue(ref_ids == fsdp_ids, f"Rank {self.rank}: {(ref_ids, fsdp_ids)}")
            for param_id, param_state in fsdp_osd_state.items():
                for state_name, value in param_state.items():
                    self.assertEqual(value, ref_osd_state[param_id][state_name])
            return
        ref_states = list(ref_osd_state.values())
        fsdp_states = list(fsdp_osd_state.values())
        self.assertEqual(len(ref_states), len(fsdp_states))
        # Each FSDP state matches some reference state and the counts agree
        for fsdp_state in fsdp_states:
            self.assertTrue(any(self._are_equal_states(fsdp_state, r) for r in ref_states))

    def _assert_states_alias(self, osd: OSD) -> None:
        """Some parameter's tensor states share one buffer (torch's limitation; the
        parameters outside every unit are not gathered and do not alias)."""
        aliased = 0
        for state in osd["state"].values():
            tensors = [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
            aliased += len(tensors) > 1 and len({t.data_ptr() for t in tensors}) == 1
        self.assertGreater(aliased, 0)

    def _check_same_param_groups(
        self, full_osd: OSD, ref_osd: OSD, check_same_param_keys: bool
    ) -> None:
        """Same "param_groups" part; "params" only compared with ``check_same_param_keys``."""
        assert "param_groups" in ref_osd
        self.assertTrue("param_groups" in full_osd)
        ref_groups, full_groups = ref_osd["param_groups"], full_osd["param_groups"]
        self.assertTrue(len(full_groups), len(ref_groups))  # as upstream: no length check
        for full_group, ref_group in zip(full_groups, ref_groups):
            self.assertEqual(set(full_group.keys()), set(ref_group.keys()))
            for name, full_value in full_group.items():
                if name == "params" and not check_same_param_keys:
                    continue
                self.assertEqual(full_value, ref_group[name])

    # -- full and sharded dicts against an unwrapped model ---------------------------

    @parametrize("state_dict_type", STATE_DICT_TYPES)
    @parametrize("use_multiple_param_groups", [False, True])
    @parametrize("rank0_only", [False, True])
    @parametrize("use_diff_optim_inputs", [False, True])
    def test_optim_state_dict_nested(
        self,
        state_dict_type: StateDictType,
        use_multiple_param_groups: bool,
        rank0_only: bool,
        use_diff_optim_inputs: bool,
    ) -> None:
        """The full/sharded dict of a wrapped model equals the optimizer state of the
        same model unwrapped (up to keys: names there, IDs here)."""
        self.run_subtests(
            {"use_optim_input": [False, True]},
            self._test_optim_state_dict_nested,
            state_dict_type=state_dict_type,
            use_multiple_param_groups=use_multiple_param_groups,
            rank0_only=rank0_only,
            use_diff_optim_inputs=use_diff_optim_inputs,
        )

    def _test_optim_state_dict_nested(
        self,
        state_dict_type: StateDictType,
        use_multiple_param_groups: bool,
        rank0_only: bool,
        use_diff_optim_inputs: bool,
        use_optim_input: bool,
    ) -> None:
        if rank0_only and state_dict_type == StateDictType.SHARDED_STATE_DICT:
            return  # not supported
        num_iters = 3
        model1, optim1, optim_input = self._init_nested_model(
            wrap=True,
            use_multiple_param_groups=use_multiple_param_groups,
            use_diff_optim_inputs=use_diff_optim_inputs,
        )
        losses1 = self._step_model(model1, optim1, num_iters=num_iters)
        if state_dict_type == StateDictType.FULL_STATE_DICT:
            if use_optim_input:
                fsdp_osd = FSDP.full_optim_state_dict(
                    model1, optim1, optim_input, rank0_only=rank0_only
                )
            else:
                fsdp_osd = FSDP.full_optim_state_dict(model1, optim1, rank0_only=rank0_only)
        else:
            fsdp_osd = FSDP.sharded_optim_state_dict(model1, optim1)
        if rank0_only and self.rank != 0:
            self.assertEqual(len(fsdp_osd), 0)  # non-target ranks get an empty dict
            return
        model2, optim2, _ = self._init_nested_model(
            wrap=False,
            use_multiple_param_groups=use_multiple_param_groups,
            use_diff_optim_inputs=use_diff_optim_inputs,
        )
        losses2 = self._step_model(model2, optim2, num_iters=num_iters)
        ref_osd = optim2.state_dict()
        # Same losses rule out model drift as a source of error
        for i, (l1, l2) in enumerate(zip(losses1, losses2)):
            assert l1 == l2, f"Losses differ on iter {i}: {l1:.5f} {l2:.5f}"
        # The FSDP dict keys by names, the unwrapped one by IDs
        self._check_same_param_groups(fsdp_osd, ref_osd, check_same_param_keys=False)
        self._check_same_state(fsdp_osd, ref_osd, check_same_param_keys=False)

    def test_full_optim_state_dict_keys(self) -> None:
        """The full dict's keys are the full model state dict's keys, with nested
        units, ignored modules and activation checkpointing (no wrapper prefixes)."""
        model = NestedModel().to(self.device)
        wrapped_model = NestedModel.wrap(model, ignore_modules=True)
        apply_activation_checkpointing(
            model, check_fn=lambda module: isinstance(module, nn.Sequential)
        )
        optim = torch.optim.Adam(wrapped_model.parameters(), lr=1e-3)
        self._step_model(model, optim)
        optim_state_dict = FSDP.full_optim_state_dict(wrapped_model, optim, rank0_only=False)
        with FSDP.state_dict_type(wrapped_model, StateDictType.FULL_STATE_DICT):
            state_dict = wrapped_model.state_dict()
        self.assertEqual(optim_state_dict["state"].keys(), state_dict.keys())
        for key in optim_state_dict["state"]:
            self.assertNotIn(_CHECKPOINT_WRAPPED_MODULE, key)

    def test_full_optim_state_dict_nested_invalid(self) -> None:
        """Ranks whose optimizer lacks a state that rank 0's has make the full dict fail."""
        model = NestedModel.wrap(NestedModel().to(self.device), None)
        optim_input = list(model.parameters())
        if self.rank != 0:
            optim_input = optim_input[:-1]  # nonzero ranks miss one parameter's state
        optim = torch.optim.Adam(optim_input, lr=1e-3)
        self._step_model(model, optim, num_iters=3)
        error_regex = (
            "FSDP currently requires each rank to have at least the "
            "optimizer states needed by rank 0's optimizer but some ranks "
            "are missing some of those states"
        )
        with self.assertRaisesRegex(RuntimeError, error_regex):
            FSDP.full_optim_state_dict(model, optim)

    # -- loading into another wrapping, world size or optimizer order -----------------

    @parametrize("use_multiple_param_groups", [False, True])
    @parametrize("wrap_alt", [False, True])
    @parametrize("use_diff_optim_inputs", [False, True])
    def test_shard_full_optim_state_dict_nested(
        self, use_multiple_param_groups: bool, wrap_alt: bool, use_diff_optim_inputs: bool
    ) -> None:
        """``shard_full_optim_state_dict`` for nested units under a plain root."""
        self.run_subtests(
            {"use_optim_input": [False, True]},
            self._test_load_optim_state,
            model_class=_ModelClass.NESTED,
            use_multiple_param_groups=use_multiple_param_groups,
            halve_world_size=False,
            osd_comm_method=_OSDCommMethod.BROADCAST_OBJECT_LIST,
            use_diff_optim_inputs=use_diff_optim_inputs,
            wrap_alt=wrap_alt,
            num_iters=3,
        )
        self._test_load_optim_state_with_optim_state_dict(
            _ModelClass.NESTED,
            state_dict_settings=StateDictSettings(
                StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig()
            ),
            use_multiple_param_groups=False,
            halve_world_size=False,
            use_diff_optim_inputs=use_diff_optim_inputs,
            wrap_alt=wrap_alt,
            num_iters=3,
        )

    def test_shard_full_optim_state_dict_nested_halve_world_size(self) -> None:
        """``shard_full_optim_state_dict`` into a group of half the ranks (with
        the harder settings: two groups, reversed orders, the other wrapping)."""
        self.run_subtests(
            {"use_optim_input": [False, True]},
            self._test_load_optim_state,
            model_class=_ModelClass.NESTED,
            use_multiple_param_groups=True,
            halve_world_size=True,
            osd_comm_method=_OSDCommMethod.BROADCAST_OBJECT_LIST,
            use_diff_optim_inputs=True,
            wrap_alt=True,
            num_iters=3,
        )
        self._test_load_optim_state_with_optim_state_dict(
            _ModelClass.NESTED,
            state_dict_settings=StateDictSettings(
                StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig()
            ),
            use_multiple_param_groups=True,
            halve_world_size=True,
            use_diff_optim_inputs=True,
            wrap_alt=True,
            num_iters=3,
        )

    def test_shard_full_optim_state_dict_transformer(self) -> None:
        """``shard_full_optim_state_dict`` for an FSDP-root transformer with shared
        parameters, into a group of half the ranks."""
        self.run_subtests(
            {"use_optim_input": [False, True]},
            self._test_load_optim_state,
            model_class=_ModelClass.TRANSFORMER,
            use_multiple_param_groups=False,
            halve_world_size=True,
            osd_comm_method=_OSDCommMethod.BROADCAST_OBJECT_LIST,
            use_diff_optim_inputs=False,
            num_iters=3,
        )
        self._test_load_optim_state_with_optim_state_dict(
            _ModelClass.TRANSFORMER,
            state_dict_settings=StateDictSettings(
                StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig()
            ),
            use_multiple_param_groups=False,
            halve_world_size=True,
            use_diff_optim_inputs=False,
            num_iters=3,
        )

    @parametrize("use_multiple_param_groups", [False, True])
    @parametrize("wrap_alt", [False, True])
    @parametrize("use_diff_optim_inputs", [False, True])
    def test_scatter_full_optim_state_dict_nested(
        self, use_multiple_param_groups: bool, wrap_alt: bool, use_diff_optim_inputs: bool
    ) -> None:
        """``scatter_full_optim_state_dict`` (only rank 0 has the dict) for nested units."""
        self.run_subtests(
            {"use_optim_input": [False, True]},
            self._test_load_optim_state,
            model_class=_ModelClass.NESTED,
            use_multiple_param_groups=use_multiple_param_groups,
            halve_world_size=False,
            osd_comm_method=_OSDCommMethod.SCATTER_FULL_OSD,
            use_diff_optim_inputs=use_diff_optim_inputs,
            wrap_alt=wrap_alt,
            num_iters=3,
        )
        self._test_load_optim_state_with_optim_state_dict(
            _ModelClass.NESTED,
            state_dict_settings=StateDictSettings(
                StateDictType.FULL_STATE_DICT,
                FullStateDictConfig(),
                FullOptimStateDictConfig(rank0_only=True),
            ),
            use_multiple_param_groups=use_multiple_param_groups,
            halve_world_size=False,
            use_diff_optim_inputs=use_diff_optim_inputs,
            wrap_alt=wrap_alt,
            num_iters=3,
        )

    def test_scatter_full_optim_state_dict_nested_halve_world_size(self) -> None:
        """``scatter_full_optim_state_dict`` into a group of half the ranks."""
        self.run_subtests(
            {"use_optim_input": [False, True]},
            self._test_load_optim_state,
            model_class=_ModelClass.NESTED,
            use_multiple_param_groups=True,
            halve_world_size=True,
            osd_comm_method=_OSDCommMethod.SCATTER_FULL_OSD,
            use_diff_optim_inputs=True,
            wrap_alt=True,
            num_iters=3,
        )
        self._test_load_optim_state_with_optim_state_dict(
            _ModelClass.NESTED,
            state_dict_settings=StateDictSettings(
                StateDictType.FULL_STATE_DICT,
                FullStateDictConfig(),
                FullOptimStateDictConfig(rank0_only=True),
            ),
            use_multiple_param_groups=True,
            halve_world_size=True,
            use_diff_optim_inputs=True,
            wrap_alt=True,
            num_iters=3,
        )

    def test_scatter_full_optim_state_dict_transformer(self) -> None:
        """``scatter_full_optim_state_dict`` for the transformer, into half the ranks."""
        self.run_subtests(
            {"use_optim_input": [False, True]},
            self._test_load_optim_state,
            model_class=_ModelClass.TRANSFORMER,
            use_multiple_param_groups=False,
            halve_world_size=True,
            osd_comm_method=_OSDCommMethod.SCATTER_FULL_OSD,
            use_diff_optim_inputs=False,
            num_iters=3,
        )
        self._test_load_optim_state_with_optim_state_dict(
            _ModelClass.TRANSFORMER,
            state_dict_settings=StateDictSettings(
                StateDictType.FULL_STATE_DICT,
                FullStateDictConfig(),
                FullOptimStateDictConfig(rank0_only=True),
            ),
            use_multiple_param_groups=False,
            halve_world_size=True,
            use_diff_optim_inputs=False,
            num_iters=3,
        )

    def test_flatten_sharded_optim_state_dict_nested(self) -> None:
        """``flatten_sharded_optim_state_dict`` for nested units, into the other wrapping."""
        self._test_load_optim_state(
            _ModelClass.NESTED,
            use_multiple_param_groups=False,
            halve_world_size=False,
            osd_comm_method=_OSDCommMethod.FLATTEN_SHARDED_OSD,
            use_diff_optim_inputs=False,
            use_optim_input=False,
            wrap_alt=True,
            num_iters=3,
        )
        self._test_load_optim_state_with_optim_state_dict(
            _ModelClass.NESTED,
            state_dict_settings=StateDictSettings(
                StateDictType.SHARDED_STATE_DICT,
                ShardedStateDictConfig(),
                ShardedOptimStateDictConfig(),
            ),
            use_multiple_param_groups=False,
            halve_world_size=False,
            use_diff_optim_inputs=False,
            wrap_alt=True,
            num_iters=3,
        )

    def test_flatten_sharded_optim_state_dict_transformer(self) -> None:
        """``flatten_sharded_optim_state_dict`` for the transformer."""
        self._test_load_optim_state(
            _ModelClass.TRANSFORMER,
            use_multiple_param_groups=False,
            halve_world_size=False,
            osd_comm_method=_OSDCommMethod.FLATTEN_SHARDED_OSD,
            use_diff_optim_inputs=False,
            use_optim_input=False,
            num_iters=3,
        )
        self._test_load_optim_state_with_optim_state_dict(
            _ModelClass.TRANSFORMER,
            state_dict_settings=StateDictSettings(
                StateDictType.SHARDED_STATE_DICT,
                ShardedStateDictConfig(),
                ShardedOptimStateDictConfig(),
            ),
            use_multiple_param_groups=False,
            halve_world_size=False,
            use_diff_optim_inputs=False,
            num_iters=3,
        )

    def test_use_orig_params(self) -> None:
        """``optim_state_dict`` / ``optim_state_dict_to_load`` with ``use_orig_params``."""
        full_settings = [
            StateDictSettings(
                StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig()
            ),
            StateDictSettings(
                StateDictType.FULL_STATE_DICT,
                FullStateDictConfig(),
                FullOptimStateDictConfig(rank0_only=True),
            ),
        ]
        for settings in full_settings:
            self.run_subtests(
                {"halve_world_size": [True, False], "wrap_alt": [True, False]},
                self._test_load_optim_state_with_optim_state_dict,
                model_class=_ModelClass.NESTED,
                state_dict_settings=settings,
                use_multiple_param_groups=False,
                use_diff_optim_inputs=False,
                num_iters=3,
                fsdp_kwargs={"use_orig_params": True},
            )
        self.run_subtests(
            {"wrap_alt": [True, False]},
            self._test_load_optim_state_with_optim_state_dict,
            model_class=_ModelClass.NESTED,
            state_dict_settings=StateDictSettings(
                StateDictType.SHARDED_STATE_DICT,
                ShardedStateDictConfig(),
                ShardedOptimStateDictConfig(),
            ),
            use_multiple_param_groups=False,
            halve_world_size=False,  # a sharded dict cannot move to another world size
            use_diff_optim_inputs=False,
            num_iters=3,
            fsdp_kwargs={"use_orig_params": True},
        )

    def _new_group(self, halve_world_size: bool) -> dist.ProcessGroup | None:
        """The even ranks' group (None on odd ranks, which stop), or the default group."""
        if not halve_world_size:
            return self.process_group
        ranks = [r for r in range(self.world_size) if r % 2 == 0]
        new_group = dist.new_group(ranks=ranks)
        return new_group if self.rank in ranks else None

    def _test_load_optim_state(
        self,
        model_class: _ModelClass,
        use_multiple_param_groups: bool,
        halve_world_size: bool,
        osd_comm_method: _OSDCommMethod,
        use_diff_optim_inputs: bool,
        use_optim_input: bool,
        num_iters: int,
        **new_model_kwargs: Any,
    ) -> None:
        """A dict saved from a model on every rank, loaded through
        ``osd_comm_method`` into a model on (maybe) half the ranks with (maybe) another
        wrapping and optimizer order, equals that model's local optimizer state."""
        initializer = self._initializer(model_class)
        osd_method: Callable[..., OSD]
        if osd_comm_method == _OSDCommMethod.OPTIM_STATE_DICT:
            osd_method = FSDP.optim_state_dict
        elif osd_comm_method == _OSDCommMethod.FLATTEN_SHARDED_OSD:
            osd_method = FSDP.sharded_optim_state_dict
        else:
            osd_method = FSDP.full_optim_state_dict
        model1, optim1, optim_input1 = initializer(
            wrap=True, use_multiple_param_groups=use_multiple_param_groups
        )
        self._step_model(model1, optim1, num_iters=num_iters)
        fsdp_osd1 = (
            osd_method(model1, optim1, optim_input1)
            if use_optim_input
            else osd_method(model1, optim1)
        )
        new_group = self._new_group(halve_world_size)
        if new_group is None:
            return
        model2, optim2, optim_input2 = initializer(
            wrap=True,
            group=new_group,
            use_multiple_param_groups=use_multiple_param_groups,
            use_diff_optim_inputs=use_diff_optim_inputs,
            **new_model_kwargs,  # `wrap_alt` changes the wrapping
        )
        self._step_model(model2, optim2, num_iters=num_iters)
        fsdp_osd2 = (
            osd_method(model2, optim2, optim_input2, group=new_group)
            if use_optim_input
            else osd_method(model2, optim2, group=new_group)
        )
        # Both dicts converted for the second model
        convert = self._osd_converter(osd_comm_method, model2, optim2, optim_input2, new_group)
        sharded_osd1 = convert(fsdp_osd1, use_optim_input)
        sharded_osd2 = convert(fsdp_osd2, use_optim_input)
        local_osd2 = optim2.state_dict()
        # Sanity check: the second model's own dict round-trips
        self._check_same_param_groups(sharded_osd2, local_osd2, check_same_param_keys=True)
        self._check_same_state(sharded_osd2, local_osd2, check_same_param_keys=True)
        # The first model's dict resharded for the second model is its local state
        self._check_same_param_groups(sharded_osd1, local_osd2, check_same_param_keys=True)
        self._check_same_state(sharded_osd1, local_osd2, check_same_param_keys=True)
        optim2.load_state_dict(sharded_osd2)
        self._step_model(model2, optim2, num_iters=num_iters)

    def _osd_converter(
        self,
        osd_comm_method: _OSDCommMethod,
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_input: OptimInput,
        group: dist.ProcessGroup,
    ) -> Callable[[OSD, bool], OSD]:
        """How a saved dict becomes ``optim``'s state under ``osd_comm_method``."""

        def broadcast(osd: OSD, use_optim_input: bool) -> OSD:
            osd = self._broadcast_full_osd(osd, group=group)
            if use_optim_input:
                return FSDP.shard_full_optim_state_dict(osd, model, optim_input=optim_input)
            return FSDP.shard_full_optim_state_dict(osd, model, optim=optim)

        def scatter(osd: OSD, use_optim_input: bool) -> OSD:
            osd_or_none = osd if self.rank == 0 else None
            if use_optim_input:
                return FSDP.scatter_full_optim_state_dict(
                    osd_or_none, model, optim_input=optim_input, group=group
                )
            return FSDP.scatter_full_optim_state_dict(osd_or_none, model, optim=optim, group=group)

        def flatten(osd: OSD, use_optim_input: bool) -> OSD:
            return FSDP.flatten_sharded_optim_state_dict(osd, model, optim=optim)

        def to_load(osd: OSD, use_optim_input: bool) -> OSD:
            return FSDP.optim_state_dict_to_load(model, optim, osd)

        return {
            _OSDCommMethod.BROADCAST_OBJECT_LIST: broadcast,
            _OSDCommMethod.SCATTER_FULL_OSD: scatter,
            _OSDCommMethod.FLATTEN_SHARDED_OSD: flatten,
            _OSDCommMethod.OPTIM_STATE_DICT: to_load,
        }[osd_comm_method]

    def _test_load_optim_state_with_optim_state_dict(
        self,
        model_class: _ModelClass,
        state_dict_settings: StateDictSettings,
        use_multiple_param_groups: bool,
        halve_world_size: bool,
        use_diff_optim_inputs: bool,
        num_iters: int,
        **new_model_kwargs: Any,
    ) -> None:
        """``_test_load_optim_state`` through ``optim_state_dict`` and
        ``optim_state_dict_to_load`` under ``state_dict_settings`` (with rank-0-only
        full dicts, other ranks load ``{}`` and get their part from rank 0)."""
        initializer = self._initializer(model_class)
        settings = (
            state_dict_settings.state_dict_type,
            state_dict_settings.state_dict_config,
            state_dict_settings.optim_state_dict_config,
        )
        model1, optim1, _ = initializer(
            wrap=True, use_multiple_param_groups=use_multiple_param_groups
        )
        FSDP.set_state_dict_type(model1, *settings)
        self._step_model(model1, optim1, num_iters=num_iters)
        fsdp_osd1 = FSDP.optim_state_dict(model1, optim1)
        new_group = self._new_group(halve_world_size)
        if new_group is None:
            return
        model2, optim2, _ = initializer(
            wrap=True,
            group=new_group,
            use_multiple_param_groups=use_multiple_param_groups,
            use_diff_optim_inputs=use_diff_optim_inputs,
            **new_model_kwargs,
        )
        FSDP.set_state_dict_type(model2, *settings)
        self._step_model(model2, optim2, num_iters=num_iters)
        fsdp_osd2 = FSDP.optim_state_dict(model2, optim2, group=new_group)
        use_orig_params = new_model_kwargs.get("fsdp_kwargs", {}).get("use_orig_params", False)
        if _torch_aliases_orig_param_states(
            self.device, use_orig_params, state_dict_settings, new_group.size()
        ):
            if fsdp_osd2:  # empty on ranks other than 0 under rank0_only
                self._assert_states_alias(fsdp_osd2)
            return
        sharded_osd2 = FSDP.optim_state_dict_to_load(model2, optim2, fsdp_osd2, group=new_group)
        local_osd2 = optim2.state_dict()
        self._check_same_param_groups(sharded_osd2, local_osd2, check_same_param_keys=True)
        self._check_same_state(sharded_osd2, local_osd2, check_same_param_keys=True)
        sharded_osd1 = FSDP.optim_state_dict_to_load(model2, optim2, fsdp_osd1, group=new_group)
        self._check_same_param_groups(sharded_osd1, local_osd2, check_same_param_keys=True)
        self._check_same_state(sharded_osd1, local_osd2, check_same_param_keys=True)
        optim2.load_state_dict(sharded_osd2)
        self._step_model(model2, optim2, num_iters=num_iters)

    # -- unmanaged parameters and rekeying ---------------------------------------------

    @parametrize("state_dict_type", STATE_DICT_TYPES)
    @parametrize("add_to_fsdp_module", [False, True])
    def test_shard_full_optim_state_dict_unmanaged_params(
        self, state_dict_type: StateDictType, add_to_fsdp_module: bool
    ) -> None:
        """A parameter without saved state inside a unit is an error (its unit's
        other parameters have Adam's scalar "step", it has none); one outside every
        unit is left out of the flattened dict (model parallelism)."""
        use_optim_input = _optim_input_values(state_dict_type)
        self.run_subtests(
            {"use_optim_input": use_optim_input},
            self._test_shard_full_optim_state_dict_unmanaged_params,
            state_dict_type=state_dict_type,
            add_to_fsdp_module=add_to_fsdp_module,
        )

    def _test_shard_full_optim_state_dict_unmanaged_params(
        self, state_dict_type: StateDictType, add_to_fsdp_module: bool, use_optim_input: bool
    ) -> None:
        num_iters = 1
        model, optim, optim_input = self._init_nested_model(wrap=True)
        self._step_model(model, optim, num_iters=num_iters)
        if state_dict_type == StateDictType.FULL_STATE_DICT:
            fsdp_osd = (
                FSDP.full_optim_state_dict(model, optim, optim_input, rank0_only=False)
                if use_optim_input
                else FSDP.full_optim_state_dict(model, optim, rank0_only=False)
            )
        else:
            fsdp_osd = FSDP.sharded_optim_state_dict(model, optim)
        # The same structure with one more parameter
        model = NestedModel().to(self.device)
        model, unmanaged_params = NestedModel.wrap_with_unmanaged_params(model, add_to_fsdp_module)
        optim_input = list(model.parameters())
        optim = torch.optim.Adam(optim_input, lr=1e-3)

        def flatten() -> OSD:
            if state_dict_type == StateDictType.SHARDED_STATE_DICT:
                return FSDP.flatten_sharded_optim_state_dict(fsdp_osd, model, optim=optim)
            if use_optim_input:
                return FSDP.shard_full_optim_state_dict(fsdp_osd, model, optim_input=optim_input)
            return FSDP.shard_full_optim_state_dict(fsdp_osd, model, optim=optim)

        if add_to_fsdp_module:
            error_prefix = (
                "^(All unflattened parameters comprising a "
                "single flat parameter must have scalar state with the "
                "same value and dtype)"
            )
            with self.assertRaisesRegex(ValueError, error_prefix):
                flatten()
            return
        flattened_osd = flatten()
        for unmanaged_param in unmanaged_params:
            NestedModel.add_unmanaged_param_entry(flattened_osd, unmanaged_param, num_iters)
        optim.load_state_dict(flattened_osd)

    @parametrize("state_dict_type", STATE_DICT_TYPES)
    @parametrize("use_multiple_param_groups", [False, True])
    def test_rekey_optim_state_dict_to_ids(
        self, state_dict_type: StateDictType, use_multiple_param_groups: bool
    ) -> None:
        """A wrapped model's dict rekeyed to IDs for the unwrapped model is that
        model's optimizer state dict."""
        use_optim_input = _optim_input_values(state_dict_type)
        self.run_subtests(
            {"use_optim_input": use_optim_input},
            self._test_rekey_optim_state_dict_to_ids,
            state_dict_type=state_dict_type,
            use_multiple_param_groups=use_multiple_param_groups,
        )

    def _test_rekey_optim_state_dict_to_ids(
        self,
        state_dict_type: StateDictType,
        use_multiple_param_groups: bool,
        use_optim_input: bool,
    ) -> None:
        num_iters = 3
        model1, optim1, optim_input1 = self._init_nested_model(
            wrap=True, use_multiple_param_groups=use_multiple_param_groups
        )
        self._step_model(model1, optim1, num_iters=num_iters)
        if state_dict_type == StateDictType.FULL_STATE_DICT:
            fsdp_osd = (
                FSDP.full_optim_state_dict(model1, optim1, optim_input1)
                if use_optim_input
                else FSDP.full_optim_state_dict(model1, optim1)
            )
            fsdp_osd = self._broadcast_full_osd(fsdp_osd)  # every rank has the full dict
        else:
            fsdp_osd = FSDP.sharded_optim_state_dict(model1, optim1)
        model2, optim2, optim_input2 = self._init_nested_model(
            wrap=False, use_multiple_param_groups=use_multiple_param_groups
        )
        self._step_model(model2, optim2, num_iters=num_iters)
        rekeyed_osd = (
            FSDP.rekey_optim_state_dict(
                fsdp_osd, OptimStateKeyType.PARAM_ID, model2, optim_input=optim_input2
            )
            if use_optim_input
            else FSDP.rekey_optim_state_dict(
                fsdp_osd, OptimStateKeyType.PARAM_ID, model2, optim=optim2
            )
        )
        osd = optim2.state_dict()
        self._check_same_param_groups(rekeyed_osd, osd, check_same_param_keys=True)
        self._check_same_state(rekeyed_osd, osd, check_same_param_keys=True)
        if state_dict_type != StateDictType.SHARDED_STATE_DICT:
            optim2.load_state_dict(rekeyed_osd)
            self._step_model(model2, optim2, num_iters=num_iters)

    def test_rekey_optim_state_dict_to_names(self) -> None:
        """An unwrapped model's optimizer state rekeyed to names, then sharded for
        the wrapped model, is the wrapped model's local optimizer state."""
        self.run_subtests(
            {"use_optim_input": [False, True]},
            self._test_rekey_optim_state_dict_to_names,
            use_multiple_param_groups=False,
        )

    def _test_rekey_optim_state_dict_to_names(
        self, use_multiple_param_groups: bool, use_optim_input: bool
    ) -> None:
        num_iters = 3
        model1, optim1, optim_input1 = self._init_nested_model(
            wrap=True, use_multiple_param_groups=use_multiple_param_groups
        )
        self._step_model(model1, optim1, num_iters=num_iters)
        model2, optim2, optim_input2 = self._init_nested_model(
            wrap=False, use_multiple_param_groups=use_multiple_param_groups
        )
        self._step_model(model2, optim2, num_iters=num_iters)
        osd2 = optim2.state_dict()
        rekeyed_osd = (
            FSDP.rekey_optim_state_dict(
                osd2, OptimStateKeyType.PARAM_NAME, model2, optim_input=optim_input2
            )
            if use_optim_input
            else FSDP.rekey_optim_state_dict(
                osd2, OptimStateKeyType.PARAM_NAME, model2, optim=optim2
            )
        )
        sharded_osd = (
            FSDP.shard_full_optim_state_dict(rekeyed_osd, model1, optim_input=optim_input1)
            if use_optim_input
            else FSDP.shard_full_optim_state_dict(rekeyed_osd, model1, optim=optim1)
        )
        osd1 = optim1.state_dict()
        self._check_same_param_groups(sharded_osd, osd1, check_same_param_keys=True)
        self._check_same_state(sharded_osd, osd1, check_same_param_keys=True)
        optim1.load_state_dict(sharded_osd)
        self._step_model(model1, optim1, num_iters=num_iters)

    def test_optim_input_warning(self) -> None:
        """Every API that takes ``optim_input`` warns that it is deprecated."""

        def should_check_method(method_name: str) -> bool:
            return method_name not in (
                "sharded_optim_state_dict",
                "flatten_sharded_optim_state_dict",
            )

        def get_warning_context() -> AbstractContextManager[Any]:
            return self.assertWarnsRegex(FutureWarning, "`optim_input` argument is deprecated")

        self._run_on_all_optim_state_apis(should_check_method, get_warning_context, None)

    def _run_on_all_optim_state_apis(
        self,
        should_check_method_fn: Callable[[str], bool],
        context_fn: Callable[[], AbstractContextManager[Any]],
        fsdp_kwargs: dict[str, Any] | None,
    ) -> None:
        """Calls every optimizer state-dict API inside ``context_fn()``, except the
        methods ``should_check_method_fn`` rejects."""
        model, optim, optim_input = self._init_nested_model(
            wrap=True, use_multiple_param_groups=False, fsdp_kwargs=fsdp_kwargs
        )
        self._step_model(model, optim, num_iters=2)
        fsdp_osd: OSD = {}
        if should_check_method_fn("sharded_optim_state_dict"):
            with context_fn():
                fsdp_osd = FSDP.sharded_optim_state_dict(model, optim)
        if should_check_method_fn("flatten_sharded_optim_state_dict"):
            with context_fn():
                FSDP.flatten_sharded_optim_state_dict(fsdp_osd, model, optim)
        if should_check_method_fn("full_optim_state_dict"):
            with context_fn():
                fsdp_osd = FSDP.full_optim_state_dict(
                    model, optim, optim_input=optim_input, rank0_only=False
                )
        if should_check_method_fn("shard_full_optim_state_dict"):
            with context_fn():
                FSDP.shard_full_optim_state_dict(fsdp_osd, model, optim_input=optim_input)
        if should_check_method_fn("scatter_full_optim_state_dict"):
            with context_fn():
                FSDP.scatter_full_optim_state_dict(fsdp_osd, model, optim_input=optim_input)
        nonwrapped_model, nonwrapped_optim, nonwrapped_optim_input = self._init_nested_model(
            wrap=False, use_multiple_param_groups=False
        )
        if should_check_method_fn("rekey_optim_state_dict"):
            with context_fn():
                FSDP.rekey_optim_state_dict(
                    fsdp_osd,
                    OptimStateKeyType.PARAM_ID,
                    nonwrapped_model,
                    optim_input=nonwrapped_optim_input,
                )
        self._step_model(nonwrapped_model, nonwrapped_optim, num_iters=2)
        osd = nonwrapped_optim.state_dict()
        if should_check_method_fn("rekey_optim_state_dict"):
            with context_fn():
                FSDP.rekey_optim_state_dict(
                    osd,
                    OptimStateKeyType.PARAM_NAME,
                    nonwrapped_model,
                    optim_input=nonwrapped_optim_input,
                )

    # -- corner cases of optim_state_dict / optim_state_dict_to_load -------------------

    @parametrize("state_dict_type", STATE_DICT_TYPES)
    def test_save_load_without_0th_param_state(self, state_dict_type: StateDictType) -> None:
        """Saving and loading Adam state when the first parameter has none (it is
        unused): loading and stepping again do not fail (Adam's ``__setstate__``
        reads the first state's "step")."""

        class Model(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin1 = nn.Linear(5, 5)
                self.lin2 = nn.Linear(5, 5)
                self.relu = nn.ReLU()

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.relu(self.lin2(x))  # `lin1` is never used

        model = Model().to(self.device)
        model.lin1 = FSDP(model.lin1)
        model.lin2 = FSDP(model.lin2)
        fsdp_model = FSDP(model)
        optim = torch.optim.Adam(fsdp_model.parameters(), lr=1e-2)
        fsdp_model(torch.randn((2, 5), device=self.device)).sum().backward()
        optim.step()
        if state_dict_type == StateDictType.FULL_STATE_DICT:
            fsdp_osd = FSDP.full_optim_state_dict(fsdp_model, optim, rank0_only=False)
            flattened_osd = FSDP.shard_full_optim_state_dict(fsdp_osd, fsdp_model)
        else:
            fsdp_osd = FSDP.sharded_optim_state_dict(fsdp_model, optim)
            flattened_osd = FSDP.flatten_sharded_optim_state_dict(fsdp_osd, fsdp_model, optim)
        optim.load_state_dict(flattened_osd)
        fsdp_model(torch.randn((2, 5), device=self.device)).sum().backward()
        optim.step()

    def test_compatible_with_trec(self) -> None:
        """A ``_NamedOptimizer`` (keyed by names, as TorchRec's) and a plain
        optimizer give the same ``optim_state_dict`` for a model whose FSDP part
        every rank shares and whose other part differs by rank; a named dict loads
        back through ``optim_state_dict_to_load(is_named_optimizer=True)``."""
        from torch.distributed.optim import _NamedOptimizer

        device = self.device

        class DenseModel(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.net1 = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
                self.net2 = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
                self.net3 = nn.Linear(32, 64)
                self.net4 = nn.Sequential(nn.ReLU(), nn.Linear(64, 8))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.net4(self.net3(self.net2(self.net1(x))))

        class FakeMPModel(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(0)
                self.dense = FSDP(DenseModel().to(device), use_orig_params=True)
                if dist.get_rank() == 0:
                    self.sparse0 = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
                else:
                    self.sparse1 = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                sparse = self.sparse0(x) if dist.get_rank() == 0 else self.sparse1(x)
                dist.all_reduce(sparse)
                return self.dense(sparse)

        models = [FakeMPModel().to(device), FakeMPModel().to(device)]
        optims = [
            torch.optim.Adam(models[0].parameters(), lr=1e-2),
            _NamedOptimizer(
                models[1].named_parameters(),
                torch.optim.Adam,
                [{"params": models[1].parameters()}],
                models[1],
                lr=1e-2,
            ),
        ]
        state_dicts = []
        batch = torch.rand(5, 8, device=device)
        for model, optim in zip(models, optims):
            # Eager state initialisation, then one step
            for param in model.parameters():
                if param.requires_grad:
                    param.grad = torch.zeros_like(param)
            optim.step()
            model(batch).sum().backward()
            optim.step()
            state_dicts.append(copy.deepcopy(FSDP.optim_state_dict(model, optim)))
        self._check_same_param_groups(state_dicts[0], state_dicts[1], check_same_param_keys=False)
        self._check_same_state(state_dicts[0], state_dicts[1], check_same_param_keys=True)
        for _ in range(5):  # the named optimizer moves on
            models[1](torch.rand(5, 8, device=device)).sum().backward()
            optims[1].step()
        state_dict_to_load = FSDP.optim_state_dict_to_load(
            models[1], optims[1], state_dicts[1], is_named_optimizer=True
        )
        optims[1].load_state_dict(state_dict_to_load)
        state_dicts[1] = FSDP.optim_state_dict(models[1], optims[1])
        self._check_same_param_groups(state_dicts[0], state_dicts[1], check_same_param_keys=False)
        self._check_same_state(state_dicts[0], state_dicts[1], check_same_param_keys=True)

    def _step_with_zero_grads(
        self, model: nn.Module, optim: torch.optim.Optimizer, batch: torch.Tensor
    ) -> None:
        """Eager state initialisation (an optimizer step on zero gradients), then
        a forward and backward without a step."""
        for param in model.parameters():
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
        optim.step()
        model(batch).sum().backward()

    def test_optim_state_without_param_groups(self) -> None:
        """A dict without "param_groups" converts both ways without gaining one."""

        class SimpleModel(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(0)
                self.net1 = nn.Sequential(nn.Linear(2, 4), nn.ReLU())

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.net1(x)

        model = FSDP(SimpleModel().to(self.device))
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        batch = torch.rand(3, 2, device=self.device)
        self._step_with_zero_grads(model, optim, batch)
        original_osd = copy.deepcopy(optim.state_dict())
        original_osd_no_param_groups = copy.deepcopy(original_osd)
        original_param_groups = copy.deepcopy(original_osd_no_param_groups.pop("param_groups"))
        original_fsdp_optim_state_dict = copy.deepcopy(
            FSDP.optim_state_dict(model, optim, optim_state_dict=original_osd_no_param_groups)
        )
        self.assertEqual(None, original_fsdp_optim_state_dict.get("param_groups"))
        self._step_with_zero_grads(model, optim, batch)  # the optimizer moves on
        state_dict_to_load = FSDP.optim_state_dict_to_load(
            model, optim, original_fsdp_optim_state_dict
        )
        state_dict_to_load["param_groups"] = original_param_groups
        optim.load_state_dict(state_dict_to_load)
        self.assertEqual(original_osd, optim.state_dict())
        fsdp_optim_state = FSDP.optim_state_dict(model, optim)
        self._check_same_state(
            original_fsdp_optim_state_dict, fsdp_optim_state, check_same_param_keys=True
        )
        self.assertEqual(original_param_groups, optim.state_dict()["param_groups"])

    def test_with_empty_optimizer_state(self) -> None:
        """An optimizer without state yet gives a dict with an empty "state"."""
        model = FSDP(TestDummyModel().to(self.device))
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        state_dict = optim.state_dict()
        gathered_state_dict = FSDP.optim_state_dict(model, optim)
        self.assertEqual(gathered_state_dict["state"], state_dict["state"])

    def test_interface_arguments(self) -> None:
        """``optim_state_dict(optim_state_dict=...)``, ``load_directly``, CPU offload by
        default, sharded values on the device without offload, and ``rank0_only``."""
        model = FSDP(TestDummyModel().to(self.device))
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)

        def step() -> None:
            loss = model(model.get_input())
            loss.backward(loss)
            optim.step()

        step()
        original_osd = copy.deepcopy(optim.state_dict())
        osd = FSDP.optim_state_dict(model, optim, optim_state_dict=original_osd)
        self._check_same_state(FSDP.optim_state_dict(model, optim), osd, check_same_param_keys=True)
        step()
        FSDP.optim_state_dict_to_load(model, optim, osd, load_directly=True)
        self._check_same_state(optim.state_dict(), original_osd, check_same_param_keys=True)
        # Default settings: plain tensors, offloaded to the CPU
        osd = FSDP.optim_state_dict(model, optim, optim_state_dict=original_osd)
        for s in _state_values(osd):
            self.assertFalse(isinstance(s, ShardedTensor))
            self.assertEqual(s.device.type, "cpu")
        # Sharded without offloading: the local shards stay on the test's device
        with FSDP.state_dict_type(
            model,
            StateDictType.SHARDED_STATE_DICT,
            ShardedStateDictConfig(),
            ShardedOptimStateDictConfig(offload_to_cpu=False),
        ):
            osd = FSDP.optim_state_dict(model, optim, optim_state_dict=original_osd)
            for s in _state_values(osd):
                if s.dim() == 0:
                    continue
                self.assertTrue(isinstance(s, ShardedTensor))
                if s.local_shards():
                    self.assertEqual(s.local_shards()[0].tensor.device.type, self.device.type)
        # Full, rank 0 only, offloaded
        with FSDP.state_dict_type(
            model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(),
            FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True),
        ):
            osd = FSDP.optim_state_dict(model, optim, optim_state_dict=original_osd)
            if dist.get_rank() > 0:
                self.assertEqual(osd, {})
            else:
                for s in _state_values(osd):
                    if s.dim() == 0:
                        continue
                    self.assertEqual(s.device.type, "cpu")
                    self.assertFalse(isinstance(s, ShardedTensor))

    def test_state_dict_with_none_tensor_state(self) -> None:
        """Non-tensor states (a float, None) survive the round trip."""

        def _run_test(use_orig_params: bool, optimizer_has_tensor_state: bool) -> None:
            model = FSDP(TestDummyModel().to(self.device), use_orig_params=use_orig_params)
            optimizer_cls = torch.optim.Adam if optimizer_has_tensor_state else torch.optim.SGD
            optim = optimizer_cls(model.parameters(), lr=1e-2)
            loss = model(model.get_input())
            loss.backward(loss)
            optim.step()
            original_osd = copy.deepcopy(optim.state_dict())
            for state in original_osd["state"].values():
                state["value1"] = 2.74
                state["value2"] = None
            osd = FSDP.optim_state_dict(model, optim, optim_state_dict=original_osd)
            osd_to_load = FSDP.optim_state_dict_to_load(model, optim, osd)
            for state in osd_to_load["state"].values():
                self.assertEqual(state["value1"], 2.74)
                self.assertEqual(state["value2"], None)

        self.run_subtests(
            {"use_orig_params": [False, True], "optimizer_has_tensor_state": [False, True]},
            _run_test,
        )

    def test_with_no_shard(self) -> None:
        """Under ``NO_SHARD`` the round trip gives back the optimizer state exactly."""

        def _run_test(use_orig_params: bool) -> None:
            model = FSDP(
                TestDummyModel().to(self.device),
                sharding_strategy=ShardingStrategy.NO_SHARD,
                use_orig_params=use_orig_params,
            )
            optim = torch.optim.Adam(model.parameters(), lr=1e-2)
            loss = model(model.get_input())
            loss.backward(loss)
            optim.step()
            original_osd = copy.deepcopy(optim.state_dict())
            osd = FSDP.optim_state_dict(model, optim)
            osd_to_load = FSDP.optim_state_dict_to_load(model, optim, osd)
            optim.load_state_dict(osd_to_load)
            self.assertEqual(original_osd, optim.state_dict())

        self.run_subtests({"use_orig_params": [False, True]}, _run_test)

    def test_no_grad(self) -> None:
        """Parameters whose ``requires_grad`` toggles between steps (state appears,
        then stops changing) round-trip through ``load_directly``."""
        model = TestDummyModel(no_grad=True).to(self.device)
        fsdp_model = FSDP(copy.deepcopy(model), use_orig_params=True)
        fsdp_optim = torch.optim.Adam(fsdp_model.parameters(), lr=1e-2)
        for i in range(5):
            requires_grad = i % 2 == 1
            fsdp_model.net1[0].weight.requires_grad = requires_grad
            fsdp_model.net1[0].bias.requires_grad = requires_grad
            batch = fsdp_model.get_input()
            fsdp_model(batch).sum().backward()
            fsdp_optim.step()
            orig_state_dict = copy.deepcopy(fsdp_optim.state_dict())
            optim_state_dict = FSDP.optim_state_dict(fsdp_model, fsdp_optim)
            settings = FSDP.get_state_dict_type(fsdp_model)
            if _torch_aliases_orig_param_states(self.device, True, settings, self.world_size):
                self._assert_states_alias(optim_state_dict)
                continue
            FSDP.optim_state_dict_to_load(
                fsdp_model,
                fsdp_optim,
                FSDP.optim_state_dict(fsdp_model, fsdp_optim),
                load_directly=True,
            )
            self._check_same_state(
                fsdp_optim.state_dict(), orig_state_dict, check_same_param_keys=True
            )
