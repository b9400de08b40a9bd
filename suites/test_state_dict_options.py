"""State-dict options across ranks, and ``sync_module_states``, at world sizes 2 and 3.

What is pinned down, for every sharding strategy, with and without
``use_orig_params``, on a model with nested units, a tied parameter (the output
projection is the embedding), a module registered under two names, persistent
float and integer buffers, batch-norm statistics and a non-persistent buffer:

- every ``StateDictType`` with ``rank0_only`` and ``offload_to_cpu``: the keys
  (those of the unwrapped model's ``state_dict()``, every alias included; for
  ``LOCAL_STATE_DICT`` one ``_flat_param`` per unit plus the buffers), the value
  types (``ShardedTensor`` for sharded parameters and flat shards, plain tensors
  otherwise), the values (equal to the unwrapped model's), where they live, and
  which ranks get them. ``NO_SHARD`` units save full state dicts whatever the
  type and config (torch's documented fallback).
- round trips: a state dict of one model loads (strictly) into a model built
  from another seed, also after a rank-0-only save broadcast to every rank, and
  the full parameters and buffers are then the first model's.
- ``sync_module_states=True``: ranks that start from different parameters and
  buffers all end with rank 0's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._state_dict_utils import _gather_state_dict

from fsdptest import FSDPTest
from fsdptest.api import (
    FLAT_PARAM,
    FSDP,
    IMPL,
    FullStateDictConfig,
    LocalStateDictConfig,
    ModuleWrapPolicy,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from harness import current_device

ALL_STRATEGIES = [
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.NO_SHARD,
]
VOCAB, WIDTH = 11, 7  # sizes that divide by neither 2 nor 3
UNIT_PREFIXES = ("", "block1.", "block2.")  # the units of the nested wrapping
# (type, rank0_only, offload_to_cpu); rank0_only exists for full state dicts only
OPTIONS = [
    (StateDictType.FULL_STATE_DICT, False, False),
    (StateDictType.FULL_STATE_DICT, True, False),
    (StateDictType.FULL_STATE_DICT, False, True),
    (StateDictType.FULL_STATE_DICT, True, True),
    (StateDictType.SHARDED_STATE_DICT, False, False),
    (StateDictType.SHARDED_STATE_DICT, False, True),
    (StateDictType.LOCAL_STATE_DICT, False, False),
    (StateDictType.LOCAL_STATE_DICT, False, True),
]
# See [Note: torch's offload_to_cpu on a CPU-only run] in test_fsdp_state_dict.py.
TORCH_OFFLOAD_TO_CPU_FAILURE = "out of bounds for storage of size 0"


class Block(nn.Module):
    """An inner unit with its own buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("scale", torch.rand(WIDTH) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x) * self.scale)


class TiedNet(nn.Module):
    """Tied embedding and output projection, a module under two names, buffers."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.block1 = Block()
        self.shared = nn.Linear(WIDTH, WIDTH)
        self.shared_alias = self.shared
        self.norm = nn.BatchNorm1d(WIDTH)
        self.block2 = Block()
        self.head = nn.Linear(WIDTH, VOCAB)
        self.head.weight = self.embed.weight
        self.register_buffer("offset", torch.randn(WIDTH))
        self.register_buffer("steps", torch.randint(0, 100, (3,)))
        self.register_buffer("scratch", torch.randn(WIDTH), persistent=False)
        with torch.no_grad():  # batch-norm statistics that differ from their defaults
            self.norm.running_mean.copy_(torch.randn(WIDTH))
            self.norm.running_var.copy_(torch.rand(WIDTH) + 0.5)
            self.norm.num_batches_tracked.fill_(seed + 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.offset
        h = self.shared(self.block1(h))
        h = self.shared_alias(self.block2(self.norm(h)))
        return self.head(h)


def _model(seed: int) -> TiedNet:
    return TiedNet(seed).to(current_device())


def _wrap(
    module: nn.Module,
    strategy: ShardingStrategy,
    use_orig_params: bool,
    nested: bool,
    **kwargs: Any,
) -> nn.Module:
    policy = ModuleWrapPolicy({Block}) if nested else None
    return FSDP(
        module,
        sharding_strategy=strategy,
        use_orig_params=use_orig_params,
        auto_wrap_policy=policy,
        **kwargs,
    )


def _input(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (5,), generator=generator).to(current_device())


def _config(kind: StateDictType, rank0_only: bool, offload: bool) -> Any:
    if kind is StateDictType.FULL_STATE_DICT:
        return FullStateDictConfig(rank0_only=rank0_only, offload_to_cpu=offload)
    if kind is StateDictType.SHARDED_STATE_DICT:
        return ShardedStateDictConfig(offload_to_cpu=offload)
    return LocalStateDictConfig(offload_to_cpu=offload)


def _option_name(option: tuple[StateDictType, bool, bool]) -> str:
    kind, rank0_only, offload = option
    return f"{kind.name}(rank0_only={rank0_only}, offload_to_cpu={offload})"


def _full_state(model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The full parameters and the persistent buffers (``scratch`` is not saved)."""
    with FSDP.summon_full_params(model):
        params = [p.detach().clone() for p in model.parameters()]
    buffers = [b.detach().clone() for n, b in model.named_buffers() if "scratch" not in n]
    return params, buffers


class _StateDictOptions(FSDPTest):
    def _torch_offload_to_cpu_fails(
        self, sharded: bool, kind: StateDictType, offload: bool
    ) -> bool:
        """Asserts torch's failure where it applies (a sharded unit's full state
        dict offloaded to the CPU on a CPU-only run); returns whether it did."""
        if not (
            IMPL == "torch"
            and self.device.type == "cpu"
            and sharded
            and kind is StateDictType.FULL_STATE_DICT
            and offload
        ):
            return False
        model = FSDP(nn.Linear(WIDTH, WIDTH).to(self.device))
        config = FullStateDictConfig(rank0_only=True, offload_to_cpu=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            if self.rank == 0:
                with self.assertRaisesRegex(RuntimeError, TORCH_OFFLOAD_TO_CPU_FAILURE):
                    model.state_dict()
            else:
                self.assertEqual(model.state_dict(), {})
        return True

    # -- what a state dict holds ------------------------------------------------------------

    def test_state_dict_contents(self) -> None:
        """Keys, value types, values, devices and ranks of every type and option."""
        config = {
            "strategy": ALL_STRATEGIES,
            "use_orig_params": [False, True],
            "option": OPTIONS,
        }
        self.run_subtests(config, self._check_contents)

    def _check_contents(
        self,
        strategy: ShardingStrategy,
        use_orig_params: bool,
        option: tuple[StateDictType, bool, bool],
    ) -> None:
        kind, rank0_only, offload = option
        sharded = strategy is not ShardingStrategy.NO_SHARD
        if self._torch_offload_to_cpu_fails(sharded, kind, offload):
            return
        reference = _model(seed=1).state_dict()
        model = _wrap(_model(seed=1), strategy, use_orig_params, nested=True)
        with FSDP.state_dict_type(model, kind, _config(kind, rank0_only, offload)):
            state_dict = model.state_dict()
        if not sharded:
            # NO_SHARD: a full state dict on every rank, on the compute device.
            self._check_full(state_dict, reference, offload=False)
        elif kind is StateDictType.FULL_STATE_DICT:
            if rank0_only and self.rank != 0:
                self.assertEqual(state_dict, {})
            else:
                self._check_full(state_dict, reference, offload)
        elif kind is StateDictType.SHARDED_STATE_DICT:
            self._check_sharded(state_dict, reference, offload)
        else:
            self._check_local(state_dict, reference, offload, use_orig_params)

    def _check_full(
        self, state_dict: dict[str, Any], reference: dict[str, torch.Tensor], offload: bool
    ) -> None:
        self.assertEqual(sorted(state_dict), sorted(reference))
        for key, value in state_dict.items():
            self.assertIs(type(value), torch.Tensor, key)
            self.assertEqual(value, reference[key], key, rtol=0, atol=0)
            expected_device = torch.device("cpu") if offload else self.device
            self.assertEqual(value.device, expected_device, key)
        # the tied weight and the shared module are there under every name
        self.assertEqual(state_dict["embed.weight"], state_dict["head.weight"], rtol=0, atol=0)
        self.assertEqual(state_dict["shared.bias"], state_dict["shared_alias.bias"], rtol=0, atol=0)

    def _check_sharded(
        self, state_dict: dict[str, Any], reference: dict[str, torch.Tensor], offload: bool
    ) -> None:
        self.assertEqual(sorted(state_dict), sorted(reference))
        param_keys = {name for name, _ in _model(seed=1).named_parameters(remove_duplicate=False)}
        for key, value in state_dict.items():
            if key in param_keys:
                self.assertIsInstance(value, ShardedTensor, key)
                for shard in value.local_shards():
                    expected = torch.device("cpu") if offload else self.device
                    self.assertEqual(shard.tensor.device, expected, key)
            else:
                self.assertIs(type(value), torch.Tensor, key)
        gathered = _gather_state_dict(state_dict)
        for key, value in gathered.items():
            self.assertEqual(value, reference[key], key, rtol=0, atol=0)

    def _check_local(
        self,
        state_dict: dict[str, Any],
        reference: dict[str, torch.Tensor],
        offload: bool,
        use_orig_params: bool,
    ) -> None:
        flat_keys = {prefix + FLAT_PARAM for prefix in UNIT_PREFIXES}
        param_keys = {name for name, _ in _model(seed=1).named_parameters(remove_duplicate=False)}
        buffer_keys = set(reference) - param_keys
        if IMPL == "torch" and use_orig_params:
            # Torch keeps the original parameters' (sharded) entries beside the
            # flat shards: the reason it cannot load this state dict back.
            expected_keys = flat_keys | buffer_keys | (param_keys & set(state_dict))
        else:
            expected_keys = flat_keys | buffer_keys
        self.assertEqual(sorted(state_dict), sorted(expected_keys))
        numels = 0
        for key in flat_keys:
            value = state_dict[key]
            self.assertIsInstance(value, ShardedTensor, key)
            numels += value.size().numel()
            for shard in value.local_shards():
                expected = torch.device("cpu") if offload else self.device
                self.assertEqual(shard.tensor.device, expected, key)
        # the flat shards cover each parameter once (alignment padding aside)
        unique = sum(p.numel() for p in _model(seed=1).parameters())
        self.assertGreaterEqual(numels, unique)
        if not use_orig_params:
            self.assertEqual(numels, unique)
        for key in buffer_keys:
            self.assertEqual(state_dict[key], reference[key], key, rtol=0, atol=0)

    # -- round trips -------------------------------------------------------------------------------

    def test_round_trip(self) -> None:
        """A state dict of one model loads into a model of another seed; the
        second model then has the first one's parameters, buffers and outputs."""
        config = {
            "strategy": ALL_STRATEGIES,
            "use_orig_params": [False, True],
            "option": OPTIONS,
        }
        self.run_subtests(config, self._check_round_trip)

    def _check_round_trip(
        self,
        strategy: ShardingStrategy,
        use_orig_params: bool,
        option: tuple[StateDictType, bool, bool],
    ) -> None:
        kind, rank0_only, offload = option
        sharded = strategy is not ShardingStrategy.NO_SHARD
        if self._torch_offload_to_cpu_fails(sharded, kind, offload):
            return
        source = _wrap(_model(seed=1), strategy, use_orig_params, nested=True)
        target = _wrap(_model(seed=2), strategy, use_orig_params, nested=True)
        # a step on both, so that the loaded values are not the initial ones; the
        # same input on every rank keeps the batch-norm statistics rank-independent,
        # so that rank 0's state dict is every rank's
        for model in (source, target):
            model(_input(0)).sum().backward()
            torch.optim.SGD(model.parameters(), lr=0.1).step()
        with FSDP.state_dict_type(source, kind, _config(kind, rank0_only, offload)):
            state_dict = source.state_dict()
        if rank0_only and sharded:
            state_dict = self._broadcast_from_rank0(state_dict)
        local_orig = kind is StateDictType.LOCAL_STATE_DICT and sharded and use_orig_params
        with FSDP.state_dict_type(target, kind):
            if IMPL == "torch" and local_orig:
                # Torch's local state dict keeps the original parameters' entries,
                # which its load does not expect (see _check_local).
                with self.assertRaisesRegex(RuntimeError, "Unexpected key"):
                    target.load_state_dict(state_dict)
                return
            result = target.load_state_dict(state_dict, strict=True)
        self.assertEqual(list(result.missing_keys), [])
        self.assertEqual(list(result.unexpected_keys), [])
        self.assertEqual(_full_state(target), _full_state(source), rtol=0, atol=0)
        x = _input(100 + self.rank)
        self.assertEqual(target(x), source(x), rtol=0, atol=0)

    def _broadcast_from_rank0(self, state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Rank 0's full state dict on every rank (shapes from the unwrapped model,
        so that no object collective is needed)."""
        result = {}
        for key, like in _model(seed=0).state_dict().items():
            tensor = state_dict[key].to(self.device) if self.rank == 0 else torch.empty_like(like)
            dist.broadcast(tensor, src=0)
            result[key] = tensor
        return result

    # -- sync_module_states ---------------------------------------------------------------------

    def test_sync_module_states_from_rank0(self) -> None:
        """Ranks built from different seeds (parameters and buffers) all hold
        rank 0's values after construction with ``sync_module_states=True``."""
        config = {
            "strategy": ALL_STRATEGIES,
            "use_orig_params": [False, True],
            "nested": [False, True],
        }
        self.run_subtests(config, self._check_sync_module_states)

    def _check_sync_module_states(
        self, strategy: ShardingStrategy, use_orig_params: bool, nested: bool
    ) -> None:
        reference = _model(seed=10)  # rank 0's model
        model = _wrap(
            _model(seed=10 + self.rank),
            strategy,
            use_orig_params,
            nested,
            sync_module_states=True,
            device_id=self.device,
        )
        with FSDP.summon_full_params(model):
            params = [p.detach().clone() for p in model.parameters()]
        buffers = [b.detach().clone() for b in model.buffers()]  # non-persistent ones too
        self.assertEqual(params, [p.detach() for p in reference.parameters()], rtol=0, atol=0)
        self.assertEqual(buffers, [b.detach() for b in reference.buffers()], rtol=0, atol=0)
        x = _input(7)
        # same input on every rank: every rank computes rank 0's output (same math)
        self.assertEqual(model(x), reference(x), rtol=0, atol=0)
        gathered = [torch.empty_like(b) for b in buffers for _ in range(self.world_size)]
        for index, buffer in enumerate(model.buffers()):
            chunk = gathered[index * self.world_size : (index + 1) * self.world_size]
            dist.all_gather(chunk, buffer.detach().contiguous())
            for other in chunk[1:]:
                self.assertEqual(other, chunk[0], rtol=0, atol=0)


class TestStateDictOptionsWorldSize2(_StateDictOptions):
    world_size = 2


class TestStateDictOptionsWorldSize3(_StateDictOptions):
    world_size = 3
