"""Parameters a user replaces with new ``nn.Parameter`` objects (``use_orig_params``).

Between iterations an original parameter is a view of its part of the local
shard (empty on a rank that holds none of it). A user may replace it by
``setattr(module, name, nn.Parameter(...))`` with a tensor of that shape: the
FSDP writes the new values into its flat parameter before the next unshard and
keeps the new object as the parameter (``named_parameters()`` lists it; the
next backward gives it its gradient). Checked against an unwrapped reference
with the same replacement, every rank feeding the same input: the forward,
the full parameters (summoned), the listed objects, and two more SGD steps of
an optimizer over the new parameters. Crossed with every strategy (hybrid ones
over one shard group), which parameter is replaced (an inner unit's weight, the
root unit's bias, both), when (before the first forward, or after a training
step), at two and three ranks. A ``Parameter`` set inside
``summon_full_params`` is not written back (torch's FSDP copies the data of the
parameters it exposed, not new objects): asserted too.

The optimizer-state APIs after a replacement, with an optimizer built over
``model.parameters()`` right after it (the conformance search's "replace
parameters()"), trained beside the reference: a rank keeps a new object only
where FSDP writes it back, so the optimizer may hold one the model no longer
lists ([Note: Parameters the optimizer holds and the model does not list] in
fsdp._state_dict.optim_keys). With ``use_orig_params=True`` that is a rank whose
shard holds no elements of the replaced parameter (the old, empty one comes
back): there the saves raise ``KeyError`` and the loads ``KeyError`` (the name),
while the other ranks save the reference's state and load it back. With
``use_orig_params=False`` the replacement is dropped at the first forward on
every rank (training goes on as the reference without it): every save raises
``KeyError`` and every load ``AssertionError`` (the optimizer holds more
parameters than the model lists). Checked for ``optim_state_dict``,
``full_optim_state_dict`` (``rank0_only`` or not), ``sharded_optim_state_dict``
and ``optim_state_dict_to_load`` (of the reference's full dict, from every rank
or rank 0 alone, and of each saved form where every rank saved), crossed with
every strategy, target, before the first forward or after a step, both
``use_orig_params``, at two and three ranks.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fsdptest import FSDPTest
from fsdptest.api import (
    ADAPTER,
    FSDP,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ShardingStrategy,
    StateDictType,
    clean_tensor_name,
)

OSD = dict[str, Any]

_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
REPLACED_TIED_SKIP = (
    "torch's FSDP raises NotImplementedError ('Changing shared parameters is not supported "
    "yet') on some ranks only after a replaced tied parameter is edited in a summon, leaving "
    "the others in a collective (REPLACED_TIED_PARAMETERS in fsdptest.conformance.allowed)"
)
# Which parameters are replaced: (module index in the Sequential, parameter name).
TARGETS = {
    "inner weight": ((0, "weight"),),
    "root bias": ((2, "bias"),),
    "both": ((0, "weight"), (2, "bias")),
}
# The saves: each gives this rank a dict unless it is rank0_only (then only rank 0)
_SAVES: dict[str, tuple[Callable[[nn.Module, torch.optim.Optimizer], OSD], bool]] = {
    "optim_state_dict": (lambda m, o: FSDP.optim_state_dict(m, o), False),
    "full_optim_state_dict": (
        lambda m, o: FSDP.full_optim_state_dict(m, o, rank0_only=False),
        False,
    ),
    "full_optim_state_dict(rank0_only)": (lambda m, o: FSDP.full_optim_state_dict(m, o), True),
    "sharded_optim_state_dict": (lambda m, o: FSDP.sharded_optim_state_dict(m, o), False),
}
_LOAD_ERROR_WITH_FLAT_PARAMS = r"Expected len\(param_to_param_key\) <= len\(param_to_fqns\)"


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))


def _optim_keys_need_numpy(test: Callable[..., None]) -> Callable[..., None]:
    """Torch's FSDP sends optimizer state-dict keys by object collectives, which
    unpickle through numpy (``Limitations.optim_keys_need_numpy``)."""
    if not ADAPTER.limitations.optim_keys_need_numpy:
        return test
    reason = "torch's optimizer state-dict keys need numpy"
    return pytest.mark.requires_module("numpy", reason=reason)(test)


def _replace(net: nn.Module, targets: tuple[tuple[int, str], ...]) -> list[nn.Parameter]:
    new = []
    for index, name in targets:
        module = net[index]
        old = getattr(module, name)
        new.append(nn.Parameter(old.detach() * 2.0 + 0.25))
        setattr(module, name, new[-1])
    return new


def _momentum_sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    # one tensor state per parameter: torch's full dicts of a unit's parameters alias
    # the states on CPU ranks (KnownDefects.aliases_orig_param_optim_states_on_cpu)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _by_name(model: nn.Module, optim: torch.optim.Optimizer) -> OSD:
    """``optim``'s state dict keyed by ``model``'s parameter names (the full form)."""
    names = {param: name for name, param in model.named_parameters()}
    order = [names[param] for group in optim.param_groups for param in group["params"]]
    osd = optim.state_dict()
    groups = [{**g, "params": [order[i] for i in g["params"]]} for g in osd["param_groups"]]
    return {"state": {order[i]: v for i, v in osd["state"].items()}, "param_groups": groups}


class ReplacedParameters(FSDPTest):
    def test_replaced_parameters_are_picked_up(self) -> None:
        """Every strategy x target x before or after a step."""
        configs = [
            {"strategy": s, "target": t, "after_step": a}
            for s, t, a in itertools.product(ShardingStrategy, TARGETS, (False, True))
        ]
        self.run_subtests({"config": configs}, lambda config: self._check(**config))

    def _model(
        self, strategy: ShardingStrategy, use_orig_params: bool = True
    ) -> tuple[nn.Module, nn.Sequential]:
        kwargs: dict[str, object] = {
            "sharding_strategy": strategy,
            "use_orig_params": use_orig_params,
            "device_id": self.device,
        }
        if strategy in _HYBRID:
            kwargs["device_mesh"] = init_device_mesh(self.device.type, (1, self.world_size))
        net = _net().to(self.device)
        net[0] = FSDP(net[0], **kwargs)
        return FSDP(net, **kwargs), net

    def _step(self, model: nn.Module, params: list[nn.Parameter]) -> torch.Tensor:
        return self._train(model, torch.optim.SGD(params, lr=0.1))

    def _train(self, model: nn.Module, optim: torch.optim.Optimizer) -> torch.Tensor:
        x = torch.linspace(-1.0, 1.0, 12, device=self.device).reshape(4, 3)
        out = model(x)
        out.square().sum().backward()
        optim.step()
        optim.zero_grad()
        return out.detach()

    def _check(self, strategy: ShardingStrategy, target: str, after_step: bool) -> None:
        model, net = self._model(strategy)
        reference = _net().to(self.device)
        if after_step:
            self._step(model, list(model.parameters()))
            self._step(reference, list(reference.parameters()))
        _replace(_unwrapped(net), TARGETS[target])
        _replace(reference, TARGETS[target])
        listed = list(model.parameters())
        for index, name in TARGETS[target]:
            new = getattr(_unwrapped(net)[index], name)
            self.assertTrue(any(p is new for p in listed), f"{index}.{name} is listed")
        for _ in range(2):
            self.assertEqual(
                self._step(model, list(model.parameters())),
                self._step(reference, list(reference.parameters())),
            )
        self.assertEqual(_full(model), {n: p.detach() for n, p in reference.named_parameters()})

    @_optim_keys_need_numpy
    def test_optimizer_state_of_replaced_parameters(self) -> None:
        """Every strategy x target x before or after a step x use_orig_params: the
        optimizer-state APIs give torch's results (the module docstring says which)."""
        configs = [
            {"strategy": s, "target": t, "after_step": a, "use_orig_params": u}
            for s, t, a, u in itertools.product(
                ShardingStrategy, TARGETS, (False, True), (True, False)
            )
        ]
        self.run_subtests({"config": configs}, lambda config: self._check_optim_state(**config))

    def _check_optim_state(
        self, strategy: ShardingStrategy, target: str, after_step: bool, use_orig_params: bool
    ) -> None:
        model, net = self._model(strategy, use_orig_params)
        reference = _net().to(self.device)
        if after_step:
            self._step(model, list(model.parameters()))
            self._step(reference, list(reference.parameters()))
        new = self._replace_for_optim(net, reference, TARGETS[target], use_orig_params)
        # kept where FSDP writes it back: use_orig_params, on a rank holding elements of it
        kept = [use_orig_params and p.numel() > 0 for p in new]
        optim, ref_optim = _momentum_sgd(model.parameters()), _momentum_sgd(reference.parameters())
        for _ in range(2):
            self.assertEqual(self._train(model, optim), self._train(reference, ref_optim))
        listed = list(model.parameters())
        self.assertEqual([any(p is q for q in listed) for p in new], kept)
        self.assertEqual(_full(model), {n: p.detach() for n, p in reference.named_parameters()})
        expected, orphaned = _by_name(reference, ref_optim), not all(kept)
        saved = self._check_saves(model, optim, expected, orphaned)
        self._check_loads(model, optim, expected, saved, orphaned, use_orig_params)

    def _replace_for_optim(
        self,
        net: nn.Sequential,
        reference: nn.Sequential,
        targets: tuple[tuple[int, str], ...],
        use_orig_params: bool,
    ) -> list[nn.Parameter]:
        """New Parameters in the wrapped model, and with ``use_orig_params`` in the
        reference (without, FSDP drops them at the first forward). Without it their
        values come from the reference: torch's FSDP leaves the module's attribute a
        view of freed storage (``KnownDefects.freed_views_outside_forward``)."""
        if use_orig_params:
            _replace(reference, targets)
            return _replace(_unwrapped(net), targets)
        new = []
        for index, name in targets:
            new.append(nn.Parameter(getattr(reference[index], name).detach() * 2.0 + 0.25))
            setattr(_unwrapped(net)[index], name, new[-1])
        return new

    def _check_saves(
        self, model: nn.Module, optim: torch.optim.Optimizer, expected: OSD, orphaned: bool
    ) -> dict[str, OSD]:
        """Each save: ``KeyError`` where the optimizer holds a parameter the model does
        not list and the rank gets a dict, else the reference's state (sharded: its
        names)."""
        saved = {}
        for api, (save, rank0_only) in _SAVES.items():
            gets = not rank0_only or self.rank == 0
            if orphaned and gets:
                with self.assertRaises(KeyError, msg=api):
                    save(model, optim)
                continue
            saved[api] = save(model, optim)
            if not gets:
                self.assertEqual(saved[api], {}, msg=api)
            elif api.startswith("sharded"):
                self.assertEqual(sorted(saved[api]["state"]), sorted(expected["state"]), msg=api)
            else:
                self.assertEqual(saved[api], expected, msg=api)
        return saved

    def _check_loads(
        self,
        model: nn.Module,
        optim: torch.optim.Optimizer,
        expected: OSD,
        saved: dict[str, OSD],
        orphaned: bool,
        use_orig_params: bool,
    ) -> None:
        """``optim_state_dict_to_load`` of the reference's full dict (from every rank,
        from rank 0) and of each saved form where every rank saved: the optimizer's
        own state, or torch's error where it holds a parameter the model does not list."""
        full, sharded = StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT
        rank0 = (full, FullStateDictConfig(), FullOptimStateDictConfig(rank0_only=True))
        on_rank0 = expected if self.rank == 0 else {}
        loads: dict[str, tuple[OSD, tuple[Any, ...]]] = {
            "reference": (expected, (full,)),
            "reference from rank 0": (on_rank0, rank0),
        }
        if self._on_every_rank(not orphaned):
            loads["optim_state_dict"] = (saved["optim_state_dict"], (full,))
            loads["rank0_only"] = (saved["full_optim_state_dict(rank0_only)"], rank0)
            loads["sharded"] = (saved["sharded_optim_state_dict"], (sharded,))
        local = optim.state_dict()
        for name, (osd, settings) in loads.items():
            with FSDP.state_dict_type(model, *settings):
                if not orphaned:
                    loaded = FSDP.optim_state_dict_to_load(model, optim, osd)
                    self.assertEqual(loaded, local, msg=name)
                elif use_orig_params:
                    with self.assertRaises(KeyError, msg=name):
                        FSDP.optim_state_dict_to_load(model, optim, osd)
                else:
                    with self.assertRaisesRegex(AssertionError, _LOAD_ERROR_WITH_FLAT_PARAMS):
                        FSDP.optim_state_dict_to_load(model, optim, osd)

    def _on_every_rank(self, flag: bool) -> bool:
        agreed = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        return bool(agreed.item())

    def test_replaced_tied_parameter_stays_tied(self) -> None:
        """A tied weight replaced under both names by one new Parameter, edited
        in a summon, saved and trained: it stays one parameter and trains as the
        reference's. Torch's FSDP raises ``NotImplementedError`` ("Changing
        shared parameters is not supported yet") on some ranks only there (the
        conformance search found it: ``REPLACED_TIED_PARAMETERS``), which would
        leave the other ranks in a collective: skipped for it."""
        if not ADAPTER.is_project_fsdp:
            self.skipTest(REPLACED_TIED_SKIP)
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3)).to(self.device)
        net[2].weight = net[0].weight
        reference = copy.deepcopy(net)
        model = FSDP(net, use_orig_params=True, device_id=self.device)
        for m in (net, reference):
            new = nn.Parameter(m[0].weight.detach() * 0.5)
            m[0].weight = new
            m[2].weight = new
        with FSDP.summon_full_params(model), torch.no_grad():
            for p in model.parameters():
                p.mul_(0.75)
        with torch.no_grad():
            for p in reference.parameters():
                p.mul_(0.75)
        self.assertEqual(sorted(model.state_dict()), sorted(reference.state_dict()))
        for _ in range(2):
            self.assertEqual(
                self._step(model, list(model.parameters())),
                self._step(reference, list(reference.parameters())),
            )
        self.assertIs(net[0].weight, net[2].weight)
        self.assertEqual(_full(model), {n: p.detach() for n, p in reference.named_parameters()})

    @_optim_keys_need_numpy
    def test_replaced_before_the_first_forward(self) -> None:
        """Parameters replaced before the first forward, then calls that initialise
        FSDP lazily without an unshard (``check_is_root``, an optimizer state dict):
        the module keeps the user's Parameters until the first unshard writes them
        back (a lazy initialisation writes nothing back, as torch's), so an optimizer
        built over them saves under their names. After the first forward a rank keeps
        those of them holding elements of its shard."""
        self.run_subtests(
            {"strategy": list(ShardingStrategy), "target": list(TARGETS)},
            self._check_replaced_before_the_first_forward,
        )

    def _check_replaced_before_the_first_forward(
        self, strategy: ShardingStrategy, target: str
    ) -> None:
        model, net = self._model(strategy)
        new = _replace(_unwrapped(net), TARGETS[target])
        model.check_is_root()
        optim = _momentum_sgd(model.parameters())
        saved = FSDP.optim_state_dict(model, optim)
        listed = list(model.parameters())
        self.assertTrue(all(any(p is q for q in listed) for p in new))
        names = [n for g in saved["param_groups"] for n in g["params"]]
        self.assertEqual(names, [clean_tensor_name(n) for n, _ in model.named_parameters()])
        model(torch.ones(2, 3, device=self.device)).sum().backward()
        listed = list(model.parameters())
        self.assertEqual([any(p is q for q in listed) for p in new], [p.numel() > 0 for p in new])

    def test_parameter_set_inside_a_summon_is_not_written_back(self) -> None:
        model, net = self._model(ShardingStrategy.FULL_SHARD)
        before = _full(model)
        with FSDP.summon_full_params(model, writeback=True):
            _unwrapped(net)[0].weight = nn.Parameter(torch.full((5, 3), 0.5, device=self.device))
        self.assertEqual(_full(model), before)


def _unwrapped(net: nn.Sequential) -> nn.Sequential:
    """The Sequential whose children are the modules (the inner unit's module)."""
    unwrapped = nn.Sequential(*net)
    unwrapped[0] = net[0].module
    return unwrapped


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    with FSDP.summon_full_params(model):
        return {clean_tensor_name(n): p.detach().clone() for n, p in model.named_parameters()}


class TestReplacedParametersTwoRanks(ReplacedParameters):
    world_size = 2


class TestReplacedParametersThreeRanks(ReplacedParameters):
    world_size = 3
