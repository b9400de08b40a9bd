"""State-dict options across ranks, and ``sync_module_states``, at world sizes 2 and 3;
then torch's semantics of buffers, warnings and local loads, at two ranks.

What is pinned down, for every sharding strategy, with and without
``use_orig_params``, on a model with nested units, a tied parameter (the output
projection is the embedding), a module registered under two names, persistent
float and integer buffers, batch-norm statistics and a non-persistent buffer:

- every ``StateDictType`` with ``rank0_only`` and ``offload_to_cpu``: the keys
  (those of the unwrapped model's ``state_dict()``, every alias included; for
  ``LOCAL_STATE_DICT`` one ``_flat_param`` per unit plus the buffers, and with
  ``use_orig_params`` the original parameters' local parts too), the value
  types (``ShardedTensor`` for sharded parameters and flat shards, plain tensors
  otherwise), the values (equal to the unwrapped model's), where they live, and
  which ranks get them. ``NO_SHARD`` units save full state dicts whatever the
  type and config (torch's documented fallback).
- round trips: a state dict of one model loads (strictly) into a model built
  from another seed, also after a rank-0-only save broadcast to every rank, and
  the full parameters and buffers are then the first model's. A local state
  dict with ``use_orig_params`` loads strictly too; torch's FSDP loads it
  through the original parameters and leaves its flat parameters as unexpected
  keys, so only a non-strict load succeeds there (asserted).
- ``sync_module_states=True``: ranks that start from different parameters and
  buffers all end with rank 0's.
- buffers: in ``buffer_dtype`` from lazy initialisation on; full and sharded
  state dicts of a unit with buffer mixed precision copy every buffer of its
  subtree back to its original dtype; local state dicts hold the buffers as
  they live. Warnings: ``NO_SHARD`` on every save and load, a full state dict
  offloaded on every rank. A local load refuses a plain tensor.

Torch's failures on a CPU-only run (full state dicts with ``offload_to_cpu``,
``sync_module_states``) are asserted there (see fsdptest.limitations).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._state_dict_utils import _gather_state_dict

from fsdptest import FSDPTest
from fsdptest.api import (
    ADAPTER,
    FLAT_PARAM,
    FSDP,
    FullStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from fsdptest.limitations import (
    TORCH_OFFLOAD_TO_CPU_ERROR,
    assert_cannot_offload_full_state_dict,
    assert_cannot_offload_local_state_dict,
    assert_cannot_sync_module_states,
    torch_local_offload_fails,
    torch_on_cpu,
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
# Every strategy x use_orig_params x option: the contents and round-trip tests' subtests.
OPTION_MATRIX = {
    "strategy": ALL_STRATEGIES,
    "use_orig_params": [False, True],
    "option": OPTIONS,
}


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
        dict offloaded to the CPU on a CPU-only run, its local state dict offloaded
        on accelerator ranks); returns whether it did."""
        local = kind is StateDictType.LOCAL_STATE_DICT
        if local and sharded and offload and torch_local_offload_fails():
            model = _wrap(_model(seed=1), ShardingStrategy.FULL_SHARD, False, nested=True)
            assert_cannot_offload_local_state_dict(self, model)
            return True
        if not (torch_on_cpu() and sharded and kind is StateDictType.FULL_STATE_DICT and offload):
            return False
        assert_cannot_offload_full_state_dict(self, self.rank)
        return True

    # -- what a state dict holds ------------------------------------------------------------

    def test_state_dict_contents(self) -> None:
        """Keys, value types, values, devices and ranks of every type and option."""
        self.run_subtests(OPTION_MATRIX, self._check_contents)

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
        # use_orig_params: the module's own entries for its original parameters
        # too, each the view of this rank's part of the shard
        expected_keys = set(reference) if use_orig_params else buffer_keys
        self.assertEqual(sorted(state_dict), sorted(expected_keys | flat_keys))
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
        for key in buffer_keys:  # buffers as the module holds them, also when offloading
            self.assertEqual(state_dict[key], reference[key], key, rtol=0, atol=0)
            self.assertEqual(state_dict[key].device, self.device, key)
        for key in sorted(expected_keys & param_keys):  # the same order on every rank
            value = state_dict[key]
            self.assertIs(type(value), torch.Tensor, key)
            self.assertEqual(value.dim(), 1, key)
            numel = torch.tensor([value.numel()], device=self.device)
            dist.all_reduce(numel)
            self.assertEqual(numel.item(), reference[key].numel(), key)

    # -- round trips -------------------------------------------------------------------------------

    def test_round_trip(self) -> None:
        """A state dict of one model loads into a model of another seed; the
        second model then has the first one's parameters, buffers and outputs."""
        self.run_subtests(OPTION_MATRIX, self._check_round_trip)

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
        # Torch's FSDP leaves a local state dict's flat parameter key in place
        # when the flat parameter is not registered (use_orig_params=True), and
        # loads through the original parameters' views (see fsdp._state_dict.kinds).
        torch_local_orig = (
            ADAPTER.known_defects.local_state_dict_keeps_flat_param_key
            and kind is StateDictType.LOCAL_STATE_DICT
            and sharded
            and use_orig_params
        )
        unexpected: list[str] = []
        with FSDP.state_dict_type(target, kind):
            if torch_local_orig:
                with self.assertRaisesRegex(RuntimeError, 'Unexpected key.*"_flat_param"'):
                    target.load_state_dict(state_dict)
                unexpected = sorted(prefix + FLAT_PARAM for prefix in UNIT_PREFIXES)
            result = target.load_state_dict(state_dict, strict=not torch_local_orig)
        self.assertEqual(list(result.missing_keys), [])
        self.assertEqual(sorted(result.unexpected_keys), unexpected)
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
        if torch_on_cpu():
            assert_cannot_sync_module_states(self)
            return
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


# -- buffers, warnings and local loads (torch's semantics, at two ranks) -------------------------

# fp32 values that fp16 rounds: a buffer that went through fp16 shows it
THIRDS = torch.arange(1, 5, dtype=torch.float32) / 3


class BufferedLinear(nn.Module):
    """A linear layer with a float buffer fp16 cannot hold exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("thirds", THIRDS.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.thirds


def _fp16_buffers() -> MixedPrecision:
    return MixedPrecision(buffer_dtype=torch.float16)


class TestStateDictBuffers(FSDPTest):
    world_size = 2

    def test_buffers_take_buffer_dtype_at_lazy_init(self) -> None:
        """Buffers are cast to ``buffer_dtype`` when the tree initialises (a
        state dict before any forward initialises it): the saved value went
        through that dtype and comes back in the original one."""
        model = FSDP(BufferedLinear().to(self.device), mixed_precision=_fp16_buffers())
        state_dict = model.state_dict()
        self.assertEqual(model.module.thirds.dtype, torch.float16)
        self.assertEqual(state_dict["thirds"].dtype, torch.float32)
        rounded = THIRDS.to(torch.float16).to(torch.float32)
        self.assertEqual(state_dict["thirds"].cpu(), rounded, rtol=0, atol=0)
        self.assertNotEqual(rounded, THIRDS)

    def test_buffer_precision_copies_every_buffer_of_the_subtree(self) -> None:
        """A unit with buffer mixed precision saves every managed buffer below it,
        also those of a nested unit without mixed precision, as full-precision
        copies; without it the entries are the module's own tensors."""
        self.run_subtests(
            {"mixed_precision": [_fp16_buffers(), None], "kind": _UNFLATTENED_TYPES},
            self._check_subtree_buffers,
        )

    def _check_subtree_buffers(
        self, mixed_precision: MixedPrecision | None, kind: StateDictType
    ) -> None:
        norm = nn.BatchNorm1d(4).to(self.device)
        model = FSDP(
            nn.Sequential(nn.Linear(4, 4).to(self.device), FSDP(norm, mixed_precision=None)),
            mixed_precision=mixed_precision,
        )
        with FSDP.state_dict_type(model, kind):
            state_dict = model.state_dict()
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            value, buffer = state_dict[f"1.{name}"], getattr(norm, name)
            self.assertEqual(value.dtype, buffer.dtype, name)
            self.assertEqual(value, buffer, name, rtol=0, atol=0)
            copied = value.data_ptr() != buffer.data_ptr()
            self.assertEqual(copied, mixed_precision is not None, name)

    def test_local_state_dict_keeps_buffers_as_they_live(self) -> None:
        """A local state dict holds the module's own buffers: in ``buffer_dtype``
        and on the device, also with ``offload_to_cpu`` (which moves the flat
        shard only)."""
        model = FSDP(BufferedLinear().to(self.device), mixed_precision=_fp16_buffers())
        model(torch.ones(2, 4, device=self.device)).sum().backward()
        if torch_local_offload_fails():
            assert_cannot_offload_local_state_dict(self, model)
            return
        config = LocalStateDictConfig(offload_to_cpu=True)
        with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT, config):
            state_dict = model.state_dict()
        buffer = model.module.thirds
        self.assertEqual(state_dict["thirds"].dtype, torch.float16)
        self.assertEqual(state_dict["thirds"].device, self.device)
        self.assertEqual(state_dict["thirds"].data_ptr(), buffer.data_ptr())
        for shard in state_dict[FLAT_PARAM].local_shards():
            self.assertEqual(shard.tensor.device, torch.device("cpu"))


_UNFLATTENED_TYPES = [StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT]
NO_SHARD_WARNING = "When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will"
OFFLOAD_WARNING = "offload_to_cpu=True and rank0_only=False"


def _warnings_of(fn: Callable[[], Any]) -> tuple[list[str], Any, RuntimeError | None]:
    """The messages of every warning ``fn()`` emits, what it returned and what it raised."""
    result, raised = None, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = fn()
        except RuntimeError as error:
            raised = error
    return [str(w.message) for w in caught], result, raised


class TestStateDictWarnings(FSDPTest):
    world_size = 2

    def test_no_shard_warns_on_every_save_and_load(self) -> None:
        """A ``NO_SHARD`` unit says on each save and load that it uses full state
        dicts, whatever the type (also the default full one)."""
        self.run_subtests(
            {"kind": [StateDictType.FULL_STATE_DICT, StateDictType.LOCAL_STATE_DICT]},
            self._check_no_shard_warnings,
        )

    def _check_no_shard_warnings(self, kind: StateDictType) -> None:
        model = FSDP(nn.Linear(4, 4).to(self.device), sharding_strategy=ShardingStrategy.NO_SHARD)
        with FSDP.state_dict_type(model, kind):
            for _ in range(2):
                messages, saved, raised = _warnings_of(model.state_dict)
                self.assertIsNone(raised)
                self.assertTrue(any(NO_SHARD_WARNING in m for m in messages), messages)
                self.assertEqual(sorted(saved), ["bias", "weight"])
                messages, _, raised = _warnings_of(partial(model.load_state_dict, saved))
                self.assertIsNone(raised)
                # torch's load message lacks a space ("full_state_dict willbe returned")
                self.assertTrue(any(NO_SHARD_WARNING[:-5] in m for m in messages), messages)

    def test_full_offload_without_rank0_only_warns(self) -> None:
        """Offloading a full state dict on every rank warns of redundant CPU
        copies (torch's summon_full_params warning)."""
        model = FSDP(nn.Linear(4, 4, bias=False).to(self.device))
        config = FullStateDictConfig(offload_to_cpu=True, rank0_only=False)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            messages, _, raised = _warnings_of(model.state_dict)
        self.assertTrue(any(OFFLOAD_WARNING in m for m in messages), messages)
        if torch_on_cpu():  # then fails (see fsdptest.limitations)
            self.assertIsNotNone(raised)
            self.assertIn(TORCH_OFFLOAD_TO_CPU_ERROR, str(raised))
        else:
            self.assertIsNone(raised)


class TestLocalStateDictLoad(FSDPTest):
    world_size = 2

    def test_local_state_dict_needs_sharded_tensors(self) -> None:
        """A flat shard given as a plain tensor is refused."""
        model = FSDP(nn.Linear(4, 4).to(self.device))
        with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            state_dict = model.state_dict()
            shards = state_dict[FLAT_PARAM].local_shards()
            state_dict[FLAT_PARAM] = shards[0].tensor.clone()
            with self.assertRaisesRegex(AssertionError, "should be ShardedTensor"):
                model.load_state_dict(state_dict)
