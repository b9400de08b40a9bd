"""What every unit's forward sees under mixed precision, observed, against the
rules of torch's FSDP.

A probe records, in each forward of the root's module and of two nested units'
modules, the dtype of every input (a float32 activation, and through a keyword
container a float64, an int64 and a float32 tensor), of the module's parameter
and of its buffer. An oracle (``expected_forward``) says what each should be:

- the root casts the floating-point inputs of its forward to ``param_dtype``
  when ``cast_root_forward_inputs`` and the root is not computing in full
  precision in eval;
- every unit casts its own inputs when ``cast_forward_inputs`` and it is not
  computing in full precision;
- a unit computes in full precision (fp32 parameters) when its module is in
  eval mode and ``FSDP_USE_FULL_PREC_IN_EVAL=1`` was set when it was built;
  otherwise its parameters are in ``param_dtype``;
- buffers are in ``buffer_dtype``, and in their own dtype while the model
  computes in full precision (checked where every unit is in the same mode:
  torch decides every buffer's dtype by the root's mode, ours by its unit's).

Integer inputs are never cast. The programs cross the flags with the modes of
the units (all training, all in eval, the root in eval and a unit training,
...), forward prefetch (the next unit is all-gathered by the one before, in the
precision of the next unit's mode), the sharding strategies and
``use_orig_params``, and run forwards in training and in eval in turn, so that a
precision that leaks from one forward into the next is seen too.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Any
from unittest import mock

import torch
from torch import nn

from fsdptest import FSDPTest
from fsdptest.api import _FSDP_USE_FULL_PREC_IN_EVAL, FSDP, MixedPrecision, ShardingStrategy

WIDTH = 4
UNITS = ("root", "u1", "u2")


@dataclasses.dataclass(frozen=True)
class Seen:
    """One forward of one module: the dtypes of its inputs, parameter and buffer."""

    unit: str
    x: torch.dtype
    aux: tuple[torch.dtype, ...]  # float64, int64, float32 (in a list), in order
    param: torch.dtype
    buffer: torch.dtype


class Probe:
    """What the modules' forwards saw, in order."""

    def __init__(self) -> None:
        self.seen: list[Seen] = []

    def record(self, unit: str, x: torch.Tensor, aux: dict[str, Any], module: nn.Module) -> None:
        dtypes = (aux["f64"].dtype, aux["ids"].dtype, aux["f32"][0].dtype)
        weight = module.lin.weight
        self.seen.append(Seen(unit, x.dtype, dtypes, weight.dtype, module.scale.dtype))


class ProbedLinear(nn.Module):
    """A linear layer and a float buffer; computes in its weight's dtype (so that
    no dtype raises and every cast is the FSDP's), recording what it receives."""

    scale: torch.Tensor

    def __init__(self, name: str, probe: Probe) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, WIDTH))
        self.name = name
        self.probe = probe

    def step(self, x: torch.Tensor, aux: dict[str, Any]) -> torch.Tensor:
        self.probe.record(self.name, x, aux, self)
        dtype = self.lin.weight.dtype
        return torch.tanh(self.lin(x.to(dtype))) * self.scale.to(dtype)

    def forward(self, x: torch.Tensor, aux: dict[str, Any]) -> torch.Tensor:
        return self.step(x, aux)


class ProbedNet(ProbedLinear):
    """The root: its own linear, then two units."""

    def __init__(self, probe: Probe) -> None:
        super().__init__("root", probe)
        self.u1: nn.Module = ProbedLinear("u1", probe)
        self.u2: nn.Module = ProbedLinear("u2", probe)

    def forward(self, x: torch.Tensor, aux: dict[str, Any]) -> torch.Tensor:
        return self.u2(self.u1(self.step(x, aux), aux), aux)


# -- the oracle ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration: the mixed precision, the environment switch, the
    units' modes in eval (``modes``: whether each of root, u1, u2 trains), and
    the unit arguments."""

    mp: MixedPrecision
    full_prec_in_eval: bool
    modes: tuple[bool, bool, bool]
    forward_prefetch: bool
    sharding_strategy: ShardingStrategy
    use_orig_params: bool

    def full_precision(self, training: bool) -> bool:
        uses_mp = self.mp.param_dtype is not None or self.mp.reduce_dtype is not None
        return self.full_prec_in_eval and not training and uses_mp


def expected_forward(case: Case, modes: tuple[bool, bool, bool]) -> list[Seen]:
    """What one forward shows with the units in ``modes`` (see the module note)."""
    mp, low = case.mp, case.mp.param_dtype
    x_dtype, aux = torch.float32, (torch.float64, torch.int64, torch.float32)
    root_aux = aux
    seen = []
    for index, (unit, training) in enumerate(zip(UNITS, modes)):
        full = case.full_precision(training)
        casts = mp.cast_forward_inputs and not full
        if index == 0:
            casts |= mp.cast_root_forward_inputs and (training or not case.full_prec_in_eval)
        unit_aux = root_aux if index else aux  # the root hands its aux to each unit
        if casts and low is not None:
            x_dtype, unit_aux = low, tuple(low if d.is_floating_point else d for d in unit_aux)
        if index == 0:
            root_aux = unit_aux
        param = torch.float32 if low is None or full else low
        buffer = torch.float32 if mp.buffer_dtype is None or full else mp.buffer_dtype
        seen.append(Seen(unit, x_dtype, unit_aux, param, buffer))
        x_dtype = param  # the module computes in its parameters' dtype
    return seen


def _without_buffers(seen: list[Seen]) -> list[Seen]:
    return [dataclasses.replace(s, buffer=torch.float32) for s in seen]


# -- the test --------------------------------------------------------------------------------------

# (root, u1, u2) trains: all, none, the root in eval and a unit training, and the reverse.
MODES = (
    (True, True, True),
    (False, False, False),
    (False, True, False),
    (False, False, True),
    (True, False, True),
)
_STRATEGIES = (
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.NO_SHARD,
)


def _cases() -> list[Case]:
    """Every flag x environment x modes x forward prefetch; the dtypes, buffer
    dtype, strategy and use_orig_params rotate through the combinations."""
    cases = []
    rotation = itertools.cycle(itertools.product(_STRATEGIES, (False, True)))
    flags = itertools.product((False, True), (False, True), (False, True), MODES, (False, True))
    for index, (root_cast, cast, env, modes, prefetch) in enumerate(flags):
        low = (torch.float16, torch.bfloat16)[index % 2]
        buffer = (None, low, torch.float16)[index % 3]
        mp = MixedPrecision(
            param_dtype=low,
            reduce_dtype=(low, None)[index % 2],
            buffer_dtype=buffer,
            cast_forward_inputs=cast,
            cast_root_forward_inputs=root_cast,
        )
        strategy, orig = next(rotation)
        cases.append(Case(mp, env, modes, prefetch, strategy, orig))
    return cases


class TestMixedPrecisionForwardInputs(FSDPTest):
    """Every unit's forward sees the input, parameter and buffer dtypes of the
    rules, in training and in eval, with and without forward prefetch."""

    world_size = 2

    def test_forward_dtypes_follow_the_rules(self) -> None:
        """80 configurations, five forwards each (two with a backward)."""
        self.run_subtests({"case": _cases()}, self._check)

    def _build(self, case: Case, probe: Probe) -> nn.Module:
        kwargs: dict[str, Any] = {
            "mixed_precision": case.mp,
            "forward_prefetch": case.forward_prefetch,
            "sharding_strategy": case.sharding_strategy,
            "use_orig_params": case.use_orig_params,
            "device_id": self.device,
        }
        torch.manual_seed(0)
        net = ProbedNet(probe).to(self.device)
        net.u1 = FSDP(net.u1, **kwargs)
        net.u2 = FSDP(net.u2, **kwargs)
        return FSDP(net, **kwargs)

    def _forward(self, model: nn.Module, backward: bool) -> None:
        x = torch.randn(3, WIDTH, device=self.device)
        aux = {
            "f64": torch.randn(WIDTH, dtype=torch.float64, device=self.device),
            "ids": torch.arange(WIDTH, device=self.device),
            "f32": [torch.randn(WIDTH, device=self.device)],
        }
        out = model(x, aux=aux)
        if backward:
            out.float().sum().backward()
            model.zero_grad()

    def _set_modes(self, model: Any, modes: tuple[bool, bool, bool]) -> None:
        model.train(modes[0])
        model.module.u1.train(modes[1])
        model.module.u2.train(modes[2])

    def _check(self, case: Case) -> None:
        probe = Probe()
        env = {_FSDP_USE_FULL_PREC_IN_EVAL: "1" if case.full_prec_in_eval else "0"}
        with mock.patch.dict(os.environ, env):
            model = self._build(case, probe)
            # training (records the forward order the prefetch follows), the
            # case's modes twice, training again, the case's modes again
            program = [((True,) * 3, True), (case.modes, False), (case.modes, False)]
            program += [((True,) * 3, True), (case.modes, False)]
            for step, (modes, backward) in enumerate(program):
                self._set_modes(model, modes)
                self._forward(model, backward)
                seen, expected = probe.seen, expected_forward(case, modes)
                if len(set(modes)) > 1:  # buffers follow the root (torch) or each unit (ours)
                    seen, expected = _without_buffers(seen), _without_buffers(expected)
                self.assertEqual(seen, expected, msg=f"forward {step} (units training: {modes})")
                probe.seen = []
