"""The rank side of the property search: an example trained under FSDP and under
its reference (``fsdptest.properties.reference``) in lockstep, every property
checked as it goes.

[Note: The properties]
On the same data (each rank its own, seeded by rank, step and microbatch):

- loss: every microbatch's loss equals the reference's;
- gradients: after ``zero_grad`` and after each step's last backward, FSDP's
  gradient is None exactly where the reference's is (per original parameter
  held in this rank's shard with ``use_orig_params=True``, per flat parameter
  otherwise: None iff the reference's gradients of all its parameters are);
  with ``use_orig_params=True`` and no offloading, the full gradients
  (``summon_full_params(with_grads=True)``) equal the reference's;
- clipping: ``clip_grad_norm_`` returns the reference's total norm;
- sharding: after every step, and after a state-dict round trip or a
  summoned edit, every flat parameter holds ``1/S`` of its padded numel
  (``S`` the ranks it is sharded over: 1 for ``NO_SHARD``, the shard group
  for hybrid strategies) and, sharded, has freed its unsharded storage;
- state dicts: a full state dict has the reference model's keys and values;
  saving, zeroing the parameters and loading gives back the same full
  parameters (full, sharded and local state dicts);
- at the end, the full parameters equal the reference's.

Each failure message starts with the property's name in brackets. A broken
property is noted and training goes on to the end, where every rank raises
what it noted: the ranks keep running the same collectives, so a property that
breaks on one rank only ends the example cleanly instead of leaving the other
ranks stuck in a collective (which would cost the pool).

[Note: Property tolerances]
In full precision FSDP and DDP compute the same operations on the same values,
but not on the same memory: a flat parameter's views start at any element, and
CPU kernels may round differently for another alignment (the search found
losses one ulp apart in the first forward, under both implementations). So fp32
is compared with ``REORDERED_FP32`` (torch's fp32 defaults), which a wrong
gradient (a divide factor, a dropped microbatch) still exceeds by orders of
magnitude after one step. Under mixed precision the reference rounds as FSDP
does up to the order of reductions and accumulations (see [Note: The
mixed-precision reference]), and a rounding of an operand is relative to the
operand, not to a result that cancels: losses, norms and gradients (of order
one here) are compared to ``LOW_PRECISION_ULPS`` machine epsilons of the least
precise dtype in use, relative and absolute, and parameters, which move by
``LR`` times such differences summed over the steps with momentum (at most
``1 / (1 - MOMENTUM)`` times one), to that times ``LR / (1 - MOMENTUM)``
absolute. That is loose (0.125 for bf16): mixed-precision examples find what
breaks (errors, wrong dtypes, gross errors); full-precision ones find the
arithmetic.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdptest.api import (
    ADAPTER,
    FSDP,
    NO_RESHARD_AFTER_FORWARD_STRATEGIES,
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
    StateDictType,
    clean_tensor_name,
    handle_fqns,
    size_based_auto_wrap_policy,
)
from fsdptest.parity import REORDERED_FP32, Tolerance
from fsdptest.properties.examples import (
    NO_SYNC,
    Between,
    Config,
    Example,
    Precision,
    Prefetch,
    Step,
    Wrap,
)
from fsdptest.properties.modules import BlockModule, Head, TiedLinear, TiedLinears, batch, build
from fsdptest.properties.reference import dtype_of, inner_model, reference
from harness.assertions import Assertions
from harness.testcase import current_device

LR, MOMENTUM = 1e-2, 0.9
LOW_PRECISION_ULPS = 16
EDIT_SCALE, EDIT_SHIFT = 0.75, 0.01  # the summoned edit: p <- 0.75 p + 0.01

Grads = dict[str, "torch.Tensor | None"]


class Tolerances(NamedTuple):
    values: Tolerance  # losses, norms, gradients
    parameters: Tolerance


def tolerances(example: Example) -> Tolerances:
    """See [Note: Property tolerances]."""
    precision = example.config.mixed_precision
    dtypes = [] if precision is None else _low_dtypes(precision)
    if not dtypes:
        return Tolerances(REORDERED_FP32, REORDERED_FP32)
    ulps = LOW_PRECISION_ULPS * max(torch.finfo(d).eps for d in dtypes)
    moved = ulps * LR / (1 - MOMENTUM)
    return Tolerances(Tolerance(rtol=ulps, atol=ulps), Tolerance(rtol=ulps, atol=moved))


def _low_dtypes(precision: Precision) -> list[torch.dtype]:
    fields = (precision.param_dtype, precision.reduce_dtype, precision.buffer_dtype)
    return [d for d in map(dtype_of, fields) if d is not None]


def process_groups(example: Example, rank: int) -> tuple[Any, Any] | None:
    """The (shard, replicate) groups of a hybrid example: ``replicas`` blocks of
    consecutive ranks; None for the default group. Every rank creates every group."""
    if not example.config.sharding.is_hybrid():
        return None
    world, replicas = example.world_size, example.config.replicas
    shards = world // replicas
    shard_layout = [list(range(r * shards, (r + 1) * shards)) for r in range(replicas)]
    replicate_layout = [list(range(s, world, shards)) for s in range(shards)]
    return _own_group(shard_layout, rank), _own_group(replicate_layout, rank)


def _own_group(layout: list[list[int]], rank: int) -> Any:
    groups = {tuple(ranks): dist.new_group(ranks) for ranks in layout}
    return next(group for ranks, group in groups.items() if rank in ranks)


def fsdp_kwargs(example: Example, model: nn.Module, groups: Any) -> dict[str, Any]:
    config = example.config
    return {
        "process_group": groups,
        "sharding_strategy": ShardingStrategy[config.sharding.value],
        "use_orig_params": config.use_orig_params,
        "mixed_precision": _mixed_precision(config.mixed_precision),
        "cpu_offload": CPUOffload(offload_params=config.offload_params),
        "backward_prefetch": _prefetch(config.backward_prefetch),
        "forward_prefetch": config.forward_prefetch,
        "auto_wrap_policy": _policy(config),
        "ignored_modules": [model.blocks[i] for i in config.ignored_blocks],  # type: ignore[index]
        "sync_module_states": config.sync_module_states,
    }


def _mixed_precision(precision: Precision | None) -> MixedPrecision | None:
    if precision is None:
        return None
    ignored = (_BatchNorm, nn.LayerNorm) if precision.norms_in_full_precision else (_BatchNorm,)
    return MixedPrecision(
        param_dtype=dtype_of(precision.param_dtype),
        reduce_dtype=dtype_of(precision.reduce_dtype),
        buffer_dtype=dtype_of(precision.buffer_dtype),
        keep_low_precision_grads=precision.keep_low_precision_grads,
        cast_forward_inputs=precision.cast_forward_inputs,
        cast_root_forward_inputs=precision.cast_root_forward_inputs,
        _module_classes_to_ignore=ignored,
    )


def _prefetch(prefetch: Prefetch) -> BackwardPrefetch | None:
    return None if prefetch is Prefetch.NONE else BackwardPrefetch[prefetch.value]


def _policy(config: Config) -> Any:
    """See [Note: What keeps a drawn model wrappable] in fsdptest.properties.modules."""
    if config.wrap is Wrap.BLOCKS:
        return ModuleWrapPolicy({BlockModule})
    if config.wrap is Wrap.SIZE:
        return functools.partial(
            size_based_auto_wrap_policy,
            min_num_params=config.min_num_params,
            force_leaf_modules={TiedLinears},
            exclude_wrap_modules={nn.ModuleList, nn.ModuleDict, nn.Embedding, Head, TiedLinear},
        )
    return None


class Lockstep:
    """An example's FSDP model and its reference, trained together on one rank."""

    case: Assertions
    example: Example
    rank: int
    fsdp: nn.Module
    reference: DDP
    tolerances: Tolerances
    broken: list[str]  # what each broken property said, in order
    _optims: tuple[torch.optim.Optimizer, torch.optim.Optimizer]

    def __init__(self, case: Assertions, example: Example, rank: int) -> None:
        self.case = case
        self.example = example
        self.rank = rank
        seed_offset = 7919 * rank if example.config.sync_module_states else 0
        model = build(example, current_device(), seed_offset)
        self.reference = reference(example, copy.deepcopy(model))  # DDP syncs rank 0's
        groups = process_groups(example, rank)
        self.fsdp = FSDP(model, **fsdp_kwargs(example, model, groups))
        self.tolerances = tolerances(example)
        self.broken = []
        self._optims = (
            torch.optim.SGD(self.fsdp.parameters(), lr=LR, momentum=MOMENTUM, foreach=False),
            torch.optim.SGD(self.reference.parameters(), lr=LR, momentum=MOMENTUM, foreach=False),
        )

    def run(self) -> None:
        """Trains through the schedule; raises what every broken property said."""
        for index, step in enumerate(self.example.steps):
            self.step(index, step)
            self.check_sharding(f"after step {index}")
            self.between(index, step.then)
        self.check_parameters("at the end")
        if self.broken:
            more = f"\n\n(and {len(self.broken) - 3} more)" if len(self.broken) > 3 else ""
            raise AssertionError("\n\n".join(self.broken[:3]) + more)

    # -- one step --------------------------------------------------------------------------

    def step(self, index: int, step: Step) -> None:
        for optim in self._optims:
            optim.zero_grad(set_to_none=step.set_to_none)
        self.check_grads_none(f"step {index} after zero_grad")
        for micro, kind in enumerate(step.microbatches):
            data = batch(self.example, self.rank, index, micro, current_device())
            losses = [self._backward(m, data, kind) for m in (self.fsdp, self.reference)]
            self._equal(losses[0], losses[1], f"[loss] step {index}, microbatch {micro} ({kind})")
        self.check_grads_none(f"step {index} after backward")
        self.check_grads(f"step {index} after backward")
        clip = step.clip.arguments()
        if clip is not None:
            self.check_clip(index, *clip)
        for optim in self._optims:
            optim.step()

    def _backward(self, model: nn.Module, data: Any, kind: str) -> torch.Tensor:
        sync = model.no_sync() if kind == NO_SYNC else contextlib.nullcontext()
        with sync:
            loss = data.loss(model(data.inputs))
            loss.backward()
        return loss.detach().to(current_device())

    def check_clip(self, index: int, max_norm: float, norm_type: float) -> None:
        fsdp_norm = self.fsdp.clip_grad_norm_(max_norm, norm_type)  # type: ignore[operator]
        ref_norm = torch.nn.utils.clip_grad_norm_(self.reference.parameters(), max_norm, norm_type)
        self._equal(fsdp_norm.to(ref_norm.device), ref_norm, f"[clip] step {index}: total norm")

    # -- between steps ---------------------------------------------------------------------

    def between(self, index: int, then: Between) -> None:
        if then is Between.NOTHING:
            return
        if then in (Between.SUMMON_EDIT, Between.SUMMON_EDIT_OFFLOADED):
            self._edit(offload_to_cpu=then is Between.SUMMON_EDIT_OFFLOADED)
        else:
            self.check_state_dict_round_trip(index, then)
        self.check_sharding(f"after step {index}'s {then.value}")

    @torch.no_grad()
    def _edit(self, offload_to_cpu: bool) -> None:
        """Edits every parameter once; a tied parameter summoned under two names
        (torch's FSDP does that under ``MixedPrecision``) is edited once if both
        views share memory."""
        summon = FSDP.summon_full_params(self.fsdp, writeback=True, offload_to_cpu=offload_to_cpu)
        with summon:
            edited: set[int] = set()
            for _, param in self.fsdp.named_parameters(remove_duplicate=False):
                if param.numel() and param.data_ptr() not in edited:
                    edited.add(param.data_ptr())
                    param.mul_(EDIT_SCALE).add_(EDIT_SHIFT)
        for param in inner_model(self.reference).parameters():
            param.mul_(EDIT_SCALE).add_(EDIT_SHIFT)

    def check_state_dict_round_trip(self, index: int, then: Between) -> None:
        kind = StateDictType[then.name]
        where = f"[state dict] after step {index}, {kind.name}"
        before = self.full_parameters()
        with FSDP.state_dict_type(self.fsdp, kind):
            saved = saved_copy(self.fsdp.state_dict())
        if kind is StateDictType.FULL_STATE_DICT:
            self._equal_state(saved, inner_model(self.reference).state_dict(), where)
        _zero_parameters(self.fsdp)
        with FSDP.state_dict_type(self.fsdp, kind):
            self.fsdp.load_state_dict(saved)
        self._expect(self.full_parameters(), before, f"{where}: loaded parameters")

    # -- checks ----------------------------------------------------------------------------

    def check_parameters(self, when: str) -> None:
        model = inner_model(self.reference)
        expected = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
        self._equal(self.full_parameters(), expected, f"[parameters] {when}", parameters=True)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """By every name (a tied parameter under each of its names: whether the
        summoned module shows it once or twice is not the property)."""
        with FSDP.summon_full_params(self.fsdp):
            named = self.fsdp.named_parameters(remove_duplicate=False)
            return {clean_tensor_name(n): p.detach().clone() for n, p in named}

    def check_sharding(self, when: str) -> None:
        """See [Note: The properties]."""
        shard_size = self.example.config.shard_size(self.example.world_size)
        for path, unit in _units(self.fsdp):
            handle = unit._handle
            flat = handle.flat_param
            unpadded = flat._unpadded_unsharded_size.numel()
            what = f"[sharding] {when}: unit {path or '(root)'}"
            if not handle.uses_sharded_strategy:
                self._expect(flat.numel(), unpadded, f"{what} holds its whole flat parameter")
                continue
            expected = -(-unpadded // shard_size)
            self._expect(
                (flat.numel(), flat._sharded_size.numel(), flat._padded_unsharded_size.numel()),
                (expected, expected, expected * shard_size),
                f"{what} holds 1/{shard_size} of {unpadded} elements (numel, sharded, padded)",
            )
            if not _keeps_frozen_unsharded(unit):
                storage = flat._full_param_padded.untyped_storage().size()
                self._expect(storage, 0, f"{what} freed its storage")

    def check_grads_none(self, when: str) -> None:
        """See [Note: The properties]."""
        expected = _reference_grads(self.reference)
        wrong = {}
        for what, grad, names in self._fsdp_grads():
            ddp_none = all(expected.get(n) is None for n in names)
            if (grad is None) != ddp_none:
                wrong[what] = "None, DDP's is not" if grad is None else "a tensor, DDP's is None"
        self._expect(wrong, {}, f"[gradients] {when}: None where DDP's is not, or the reverse")

    def _fsdp_grads(self) -> Iterator[tuple[str, torch.Tensor | None, list[str]]]:
        """(what, its gradient, the reference parameters it stands for): each original
        parameter in this rank's shard with ``use_orig_params=True``, else each flat
        parameter, plus the parameters FSDP does not manage (ignored modules)."""
        flat_params: set[int] = set()
        if not self.example.config.use_orig_params:
            for path, unit in _units(self.fsdp):
                flat = unit._handle.flat_param
                flat_params.add(id(flat))
                names = [
                    clean_tensor_name(f"{path}.{f}".lstrip(".")) for f in handle_fqns(unit._handle)
                ]
                yield f"flat parameter of {path or '(root)'} {names}", flat.grad, names
        for name, param in self.fsdp.named_parameters():
            if id(param) not in flat_params and param.numel() > 0:  # empty: outside this shard
                yield clean_tensor_name(name), param.grad, [clean_tensor_name(name)]

    def check_grads(self, when: str) -> None:
        config = self.example.config
        if not config.use_orig_params or config.offload_params:
            return  # summon_full_params(with_grads=True) needs both
        precision = config.mixed_precision
        if (
            ADAPTER.known_defects.cannot_summon_low_precision_grads
            and precision is not None
            and precision.keep_low_precision_grads
        ):
            # Torch's FSDP cannot gather low-precision gradients: unshard_grad
            # assigns the fp16 gradient to the fp32 flat parameter and raises
            # (asserted in suites/test_property_findings.py).
            return
        with FSDP.summon_full_params(self.fsdp, with_grads=True):
            actual = {clean_tensor_name(n): p.grad for n, p in self.fsdp.named_parameters()}
            actual = {n: None if g is None else g.detach().clone() for n, g in actual.items()}
        expected = _reference_grads(self.reference)
        present = {n: g for n, g in actual.items() if g is not None and expected.get(n) is not None}
        self._equal(present, {n: expected[n] for n in present}, f"[gradients] {when}: values")

    # -- comparisons -----------------------------------------------------------------------

    def _equal(self, actual: object, expected: object, what: str, parameters: bool = False) -> None:
        tol = self.tolerances.parameters if parameters else self.tolerances.values
        self._expect(actual, expected, what, exact_dtype=False, rtol=tol.rtol, atol=tol.atol)

    def _expect(self, actual: object, expected: object, what: str, **kwargs: Any) -> None:
        """``assertEqual``, noting a failure instead of raising it (see [Note: The properties])."""
        try:
            self.case.assertEqual(actual, expected, what, **kwargs)
        except AssertionError as error:
            self.broken.append(f"{what}:\n{error}")

    def _equal_state(
        self, actual: dict[str, Any], expected: dict[str, torch.Tensor], what: str
    ) -> None:
        self._expect(sorted(actual), sorted(expected), f"{what}: keys")
        common = sorted(set(actual) & set(expected))
        self._equal(
            {k: actual[k].to(expected[k].device) for k in common},
            {k: expected[k] for k in common},
            f"{what}: values",
            parameters=True,
        )


def _keeps_frozen_unsharded(unit: Any) -> bool:
    """Torch's FSDP reshards a unit without gradients after backward from a hook
    on its forward's inputs that require gradients; where none do (frozen layers
    first in a model of float features), a strategy that keeps parameters
    unsharded from forward to backward keeps them after the step too (asserted
    in suites/test_property_findings.py)."""
    strategy = unit.sharding_strategy
    return (
        ADAPTER.known_defects.keeps_frozen_units_unsharded
        and not unit._handle.flat_param.requires_grad
        and strategy in NO_RESHARD_AFTER_FORWARD_STRATEGIES
    )


def _units(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """(path from the root, unit) of every FSDP unit that has a flat parameter."""
    for name, module in model.named_modules():
        if isinstance(module, FSDP) and module._handle is not None:
            yield clean_tensor_name(name), module


def _reference_grads(reference: DDP) -> Grads:
    """By every name of each parameter (tied ones included)."""
    model = inner_model(reference)
    return {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}


@torch.no_grad()
def _zero_parameters(model: nn.Module) -> None:
    with FSDP.summon_full_params(model, writeback=True):
        for param in model.parameters():
            param.zero_()


def check_example(case: Assertions, example: Example) -> None:
    """Trains ``example`` under FSDP and its reference and checks every property."""
    Lockstep(case, example, dist.get_rank()).run()


def saved_copy(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``state_dict`` as a checkpoint holds it: every tensor cloned, a
    ShardedTensor rebuilt from clones of its local shards. ``copy.deepcopy`` of a
    ShardedTensor whose local shards live in pinned memory (a LOCAL_STATE_DICT of
    CPU-offloaded units on accelerator ranks, both FSDPs) fails: the copies are
    not pinned and ShardedTensor checks them against its metadata; clones here
    keep the pinning."""
    return {key: _saved_value(value) for key, value in state_dict.items()}


def _saved_value(value: Any) -> Any:
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    if isinstance(value, ShardedTensor):
        shards = [Shard(_clone(s.tensor), s.metadata) for s in value.local_shards()]
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, sharded_tensor_metadata=value.metadata(), process_group=value._process_group
        )
    if type(value) in (torch.Tensor, nn.Parameter):
        return _clone(value)
    return copy.deepcopy(value)  # DTensors and the rest


def _clone(tensor: torch.Tensor) -> torch.Tensor:
    clone = tensor.detach().clone()
    if tensor.device.type == "cpu" and tensor.is_pinned():
        clone = clone.pin_memory()
    return clone.requires_grad_(tensor.requires_grad)
