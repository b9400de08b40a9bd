"""Constructor arguments: ``ignored_modules``, ``ignored_states`` and the flat
parameter's padding metadata.

Torch's semantics (``torch/distributed/fsdp/_init_utils.py``, upstream
``test_fsdp_ignored_modules.py``): ``ignored_states`` takes parameters or
modules (a list, a set or a generator) and means what ``ignored_modules`` means;
ignored parameters are not flattened, not sharded and not reduced, so they train
locally; a unit inherits the ignored modules of the units nested in it, so ranks
that ignore different modules still build the same flat parameters. With
``use_orig_params=True`` each original parameter starts at a 16-byte-aligned
offset of the flat parameter and the flat parameter is padded to a multiple of
the world size; ``_numels_with_padding`` lists the segments and
``_is_padding_mask`` marks the padding. With ``use_orig_params=False`` there is
no padding segment at all (the world-size padding happens when sharding).

The flat parameter also describes what it holds, under torch's names:
``_num_params``, ``_fqns``, ``_shapes``, ``_strides``, ``_contiguities`` and
``_numels`` of each parameter (relative to the unit's module, in flat order),
``_param_infos`` / ``_shared_param_infos`` (a tied parameter is flattened once and
listed as shared) and ``_modules``. With ``use_orig_params=True`` ``_params`` are the
original parameter variables and ``_shared_params`` their tied aliases; a variable
the user replaces takes its place in ``_params`` at the writeback. Without it both
are ``None``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdptest import FSDPTest
from fsdptest.api import (
    FSDP,
    CPUOffload,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
    torch_refuses_cpu_offload,
)
from harness import current_device

ALL_STRATEGIES = [
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.NO_SHARD,
]
IGNORE_FORMS = [
    "ignored_modules",
    "states_list_of_params",
    "states_set_of_params",
    "states_generator_of_params",
    "states_list_of_modules",
]


class Net(nn.Module):
    """layer0, layer1 (three Linears), layer2, layer3; layer1 is the one ignored."""

    def __init__(self) -> None:
        super().__init__()
        self.layer0 = nn.Linear(3, 5)
        self.layer1 = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 4), nn.Linear(4, 4))
        self.layer2 = nn.Linear(4, 2)
        self.layer3 = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in (self.layer0, self.layer1, self.layer2, self.layer3):
            x = torch.tanh(layer(x))
        return x


def _net() -> Net:
    torch.manual_seed(0)
    return Net().to(current_device())


def _numel(params: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() for p in params)


def _input(rank: int, step: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 3, generator=generator).to(current_device())


def _ignore_kwargs(form: str, module: nn.Module) -> dict[str, object]:
    """``module`` (and its subtree) ignored in the way ``form`` names."""
    params = list(module.parameters())
    if form == "ignored_modules":
        return {"ignored_modules": [module]}
    if form == "states_list_of_params":
        return {"ignored_states": params}
    if form == "states_set_of_params":
        return {"ignored_states": set(params)}
    if form == "states_generator_of_params":
        return {"ignored_states": (p for p in params)}
    return {"ignored_states": [module]}


def _padding_numel(flat_param: torch.Tensor) -> int:
    pairs = zip(flat_param._numels_with_padding, flat_param._is_padding_mask)
    return sum(numel for numel, is_padding in pairs if is_padding)


def _managed_numel_in_summon(model: nn.Module, use_orig_params: bool) -> int:
    """Elements the units of ``model`` flatten, without padding, read inside a summon.

    With ``use_orig_params=False`` torch's flat parameters have no padding
    segment, so the padding metadata is read only with ``use_orig_params=True``.
    """
    total = 0
    with FSDP.summon_full_params(model):
        for unit in FSDP.fsdp_modules(model):
            if unit._handle is None:
                continue
            flat_param = unit._handle.flat_param
            padding = _padding_numel(flat_param) if use_orig_params else 0
            total += flat_param.numel() - padding
    return total


def _agree_across_ranks(test: FSDPTest, tensors: list[torch.Tensor]) -> None:
    local = torch.stack([t.detach().double().sum() for t in tensors]).to(current_device())
    gathered = [torch.empty_like(local) for _ in range(test.world_size)]
    dist.all_gather(gathered, local)
    for other in gathered[1:]:
        test.assertEqual(other, gathered[0], rtol=0, atol=0)


def _summoned(model: nn.Module, module: nn.Module) -> list[torch.Tensor]:
    with FSDP.summon_full_params(model):
        return [p.detach().clone() for p in module.parameters()]


def _train(model: nn.Module, rank: int, steps: int) -> None:
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(steps):
        optim.zero_grad()
        model(_input(rank, step)).sum().backward()
        optim.step()


class _IgnoredStates(FSDPTest):
    def test_each_ignore_form_leaves_params_unflattened_and_local(self) -> None:
        """Every ignore form flattens only the other layers; ignored params train locally."""
        config = {"form": IGNORE_FORMS, "use_orig_params": [False, True]}
        self.run_subtests(config, self._check_ignore_form)

    def _check_ignore_form(self, form: str, use_orig_params: bool) -> None:
        model = _net()
        reference = copy.deepcopy(model)
        ignored = list(model.layer1.parameters())
        shapes = [p.shape for p in ignored]
        expected = _numel(model.parameters()) - _numel(ignored)
        wrapped = FSDP(model, use_orig_params=use_orig_params, **_ignore_kwargs(form, model.layer1))
        self._check_flattened(wrapped, expected, use_orig_params)
        self.assertEqual(
            [id(p) for p in wrapped.module.layer1.parameters()], [id(p) for p in ignored]
        )
        self.assertEqual([p.shape for p in ignored], shapes)
        self._check_local_gradients(wrapped, reference, ignored)
        before = [p.detach().clone() for p in ignored]
        _train(wrapped, self.rank, steps=2)
        for old, new in zip(before, ignored):
            self.assertNotEqual(new.detach(), old, msg="an ignored parameter did not train")

    def _check_flattened(self, wrapped: nn.Module, expected: int, use_orig_params: bool) -> None:
        """Inside a summon the flat parameter holds exactly the non-ignored
        elements (plus padding segments); outside, its shard of them."""
        self.assertEqual(_managed_numel_in_summon(wrapped, use_orig_params), expected)
        with FSDP.summon_full_params(wrapped):
            unsharded = wrapped._handle.flat_param.numel()
        sharded = wrapped._handle.flat_param.numel()
        self.assertEqual(sharded, math.ceil(unsharded / self.world_size))

    def _check_local_gradients(
        self, wrapped: nn.Module, reference: nn.Module, ignored: list[nn.Parameter]
    ) -> None:
        x = _input(self.rank, step=10)
        wrapped(x).sum().backward()
        reference(x).sum().backward()
        for param, ref in zip(ignored, reference.layer1.parameters()):
            # The same local computation: exact, and not averaged over ranks.
            self.assertEqual(param.grad, ref.grad, rtol=0, atol=0)
        wrapped.zero_grad(set_to_none=True)

    def test_nested_unit_inside_ignored_module_trains(self) -> None:
        """An FSDP unit nested in an ignored module trains and stays in sync across ranks."""
        config = {
            "form": ["ignored_modules", "states_list_of_params"],
            "use_orig_params": [False, True],
        }
        self.run_subtests(config, self._check_nested_in_ignored)

    def _check_nested_in_ignored(self, form: str, use_orig_params: bool) -> None:
        model = _net()
        expected = _numel(model.parameters()) - _numel(model.layer1.parameters())
        model.layer1[1] = FSDP(model.layer1[1], use_orig_params=use_orig_params)
        wrapped = FSDP(model, use_orig_params=use_orig_params, **_ignore_kwargs(form, model.layer1))
        with FSDP.summon_full_params(wrapped):
            root_flat = wrapped._handle.flat_param
            padding = _padding_numel(root_flat) if use_orig_params else 0
            self.assertEqual(root_flat.numel() - padding, expected)
        nested = model.layer1[1]
        before = _summoned(wrapped, nested)
        _train(wrapped, self.rank, steps=3)
        after = _summoned(wrapped, nested)
        for old, new in zip(before, after):
            self.assertNotEqual(new, old, msg="the nested unit did not train")
        _agree_across_ranks(self, after)
        _agree_across_ranks(self, _summoned(wrapped, wrapped.module.layer0))

    def test_ignored_modules_with_orig_params_trains(self) -> None:
        """ignored_modules with use_orig_params=True trains the managed params in sync."""
        config = {"use_auto_wrap": [False, True], "strategy": ALL_STRATEGIES}
        self.run_subtests(config, self._check_orig_params_training)

    def _check_orig_params_training(self, use_auto_wrap: bool, strategy: ShardingStrategy) -> None:
        model = _net()
        policy = ModuleWrapPolicy({nn.Linear}) if use_auto_wrap else None
        wrapped = FSDP(
            model,
            ignored_modules=[model.layer1],
            use_orig_params=True,
            sharding_strategy=strategy,
            auto_wrap_policy=policy,
        )
        self.assertEqual(FSDP.fsdp_modules(model.layer1), [])
        managed = [model.layer0, model.layer2, model.layer3]
        before = [_summoned(wrapped, m) for m in managed]
        _train(wrapped, self.rank, steps=3)
        for module, old in zip(managed, before):
            new = _summoned(wrapped, module)
            for a, b in zip(old, new):
                self.assertNotEqual(b, a, msg="a managed parameter did not train")
            _agree_across_ranks(self, new)


class TestIgnoredStatesWorld2(_IgnoredStates):
    world_size = 2


class TestIgnoredStatesWorld3(_IgnoredStates):
    world_size = 3


def _expected_layout(
    numels: list[int], align: int, world_size: int
) -> tuple[list[int], list[bool]]:
    """Torch's segments: padding before each parameter to an ``align`` boundary
    and at the end to a multiple of ``world_size`` (none when ``align`` is 0)."""
    segments: list[int] = []
    mask: list[bool] = []
    total = 0
    for numel in numels:
        pad = (align - total % align) % align if align else 0
        if pad:
            segments.append(pad)
            mask.append(True)
            total += pad
        segments.append(numel)
        mask.append(False)
        total += numel
    pad = (world_size - total % world_size) % world_size if align else 0
    if pad:
        segments.append(pad)
        mask.append(True)
    return segments, mask


class _PaddingMetadata(FSDPTest):
    def test_numels_with_padding_and_mask_match_torch_layout(self) -> None:
        """_numels_with_padding/_is_padding_mask follow torch's alignment and world-size padding."""
        config = {
            "use_orig_params": [False, True],
            "ignore_layer1": [False, True],
            "param_dtype": [None, torch.float16],
        }
        self.run_subtests(config, self._check_layout)

    def _check_layout(
        self, use_orig_params: bool, ignore_layer1: bool, param_dtype: torch.dtype | None
    ) -> None:
        model = _net()
        ignored = [model.layer1] if ignore_layer1 else []
        numels = [
            p.numel()
            for name, p in model.named_parameters()
            if not (ignore_layer1 and name.startswith("layer1."))
        ]
        wrapped = FSDP(
            model,
            ignored_modules=ignored,
            use_orig_params=use_orig_params,
            mixed_precision=MixedPrecision(param_dtype=param_dtype) if param_dtype else None,
        )
        flat_param = wrapped._handle.flat_param
        align = 16 // (param_dtype or torch.float32).itemsize if use_orig_params else 0
        segments, mask = _expected_layout(numels, align, self.world_size)
        self.assertEqual(list(flat_param._numels_with_padding), segments)
        self.assertEqual(list(flat_param._is_padding_mask), mask)
        padded = sum(segments)
        self.assertEqual(flat_param.numel(), math.ceil(padded / self.world_size))
        with FSDP.summon_full_params(wrapped):
            self.assertEqual(wrapped._handle.flat_param.numel(), padded)


class TestPaddingMetadataWorld2(_PaddingMetadata):
    world_size = 2


class TestPaddingMetadataWorld3(_PaddingMetadata):
    world_size = 3


class _Tied(nn.Module):
    """An embedding whose weight the output projection shares, and a Linear between."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 6, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.lin(self.embed(x))))


class _FlatParamContents(FSDPTest):
    def test_flat_param_describes_its_parameters(self) -> None:
        """The flat parameter's metadata names, shapes and (use_orig_params) holds the
        original parameters, the tied one listed once plus as shared."""
        config = {
            "strategy": ALL_STRATEGIES,
            "use_orig_params": [False, True],
            "offload": [False, True],
        }
        self.run_subtests(config, self._check_contents)

    def _check_contents(
        self, strategy: ShardingStrategy, use_orig_params: bool, offload: bool
    ) -> None:
        if torch_refuses_cpu_offload(CPUOffload(offload_params=offload)):
            self.skipTest("torch's FSDP cannot offload parameters on CPU ranks")
        module = _Tied().to(current_device())
        originals = [module.embed.weight, module.lin.weight, module.lin.bias]
        wrapped = FSDP(
            module,
            sharding_strategy=strategy,
            use_orig_params=use_orig_params,
            cpu_offload=CPUOffload(offload_params=offload),
        )
        flat_param = wrapped._handle.flat_param
        self.assertEqual(flat_param._num_params, 3)
        self.assertEqual(list(flat_param._fqns), ["embed.weight", "lin.weight", "lin.bias"])
        self.assertEqual(list(flat_param._shapes), [(6, 4), (4, 4), (4,)])
        self.assertEqual(list(flat_param._numels), [24, 16, 4])
        self.assertEqual([tuple(s) for s in flat_param._strides], [(4, 1), (4, 1), (1,)])
        self.assertEqual(list(flat_param._contiguities), [True, True, True])
        infos = [(i.module_name, i.param_name) for i in flat_param._param_infos]
        self.assertEqual(infos, [("embed", "weight"), ("lin", "weight"), ("lin", "bias")])
        (shared,) = flat_param._shared_param_infos
        self.assertEqual(
            (shared.module_name, shared.param_name, shared.prim_module_name),
            ("out", "weight", "embed"),
        )
        self.assertEqual(
            {id(m) for m in flat_param._modules}, {id(module.embed), id(module.lin), id(module.out)}
        )
        if not use_orig_params:
            self.assertIsNone(flat_param._params)
            self.assertIsNone(flat_param._shared_params)
            return
        self.assertEqual([id(p) for p in flat_param._params], [id(p) for p in originals])
        self.assertEqual([id(p) for p in flat_param._shared_params], [id(module.embed.weight)])
        # A replaced variable is written back and takes the old one's place in
        # _params, where this rank holds part of the parameter (a rank holding none
        # of it keeps its empty one).
        in_shard = module.lin.weight.numel() > 0
        replacement = nn.Parameter(torch.full_like(module.lin.weight, 2.0))
        module.lin.weight = replacement
        with FSDP.summon_full_params(wrapped):
            pass
        self.assertIs(flat_param._params[1], module.lin.weight)
        self.assertEqual(flat_param._params[1] is replacement, in_shard)
        self.assertTrue(torch.all(module.lin.weight == 2.0))


class TestFlatParamContentsWorld2(_FlatParamContents):
    world_size = 2


class TestFlatParamContentsWorld3(_FlatParamContents):
    world_size = 3


class _InvalidArguments(FSDPTest):
    def test_fsdp_instance_in_ignored_modules_raises(self) -> None:
        """An FSDP unit cannot be an ignored module."""
        model = _net()
        model.layer1 = FSDP(model.layer1)
        with self.assertRaisesRegex(ValueError, "should not include FSDP modules"):
            FSDP(model, ignored_modules=[model.layer1])

    def test_params_in_ignored_modules_raise(self) -> None:
        """ignored_modules takes modules only."""
        model = _net()
        with self.assertRaisesRegex(
            ValueError,
            r"ignored_modules expects nn.Module list elements but got types "
            r"\[<class 'torch.nn.parameter.Parameter'>\]",
        ):
            FSDP(model, ignored_modules=set(model.layer1.parameters()))

    def test_both_ignored_modules_and_states_raise(self) -> None:
        """ignored_modules and ignored_states exclude each other."""
        model = _net()
        with self.assertRaisesRegex(
            ValueError, "Cannot pass both ignored_modules and ignored_states at the same time"
        ):
            FSDP(
                model,
                ignored_modules=[model.layer1],
                ignored_states=set(model.layer1.parameters()),
            )

    def test_mixed_ignored_states_raise(self) -> None:
        """ignored_states mixing parameters and modules raises, listing the sorted types."""
        model = _net()
        mixed = set(model.layer1.parameters()) | set(model.layer1.children())
        with self.assertRaisesRegex(
            ValueError,
            r"ignored_states expects all nn.Parameter or all nn.Module list elements but got "
            r"types \[<class 'torch.nn.modules.linear.Linear'>, "
            r"<class 'torch.nn.parameter.Parameter'>\]",
        ):
            FSDP(model, ignored_states=mixed)

    def test_ignoring_the_wrapped_module_warns_and_ignores_all(self) -> None:
        """Ignoring the wrapped module warns; nothing is flattened, forward is unchanged."""
        model = _net()
        reference = copy.deepcopy(model)
        params = list(model.parameters())
        with self.assertWarnsRegex(
            UserWarning,
            "Trying to ignore the top-level module passed into the FSDP constructor itself "
            "will result in all parameters being ignored",
        ):
            wrapped = FSDP(model, ignored_modules=[model])
        self.assertIsNone(wrapped._handle)
        self.assertEqual([id(p) for p in wrapped.parameters()], [id(p) for p in params])
        x = _input(self.rank)
        self.assertEqual(wrapped(x), reference(x), rtol=0, atol=0)


class TestInvalidArgumentsWorld2(_InvalidArguments):
    world_size = 2


class Scale(nn.Module):
    """A square matrix multiply, the module ranks ignore in different numbers."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim) / dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class PerRankNet(Net):
    """Net whose layer1 has ``num_scales`` extra Scale modules (rank-dependent)."""

    def __init__(self, num_scales: int) -> None:
        super().__init__()
        scales = [Scale(4) for _ in range(num_scales)]
        self.layer1 = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 4), *scales, nn.Linear(4, 4))


class _DifferentIgnoredPerRank(FSDPTest):
    @pytest.mark.dist_timeout(120)
    def test_root_inherits_children_ignored_modules(self) -> None:
        """Ranks ignoring different modules in a child: the root inherits them, no hang."""
        config = {"pass_to_root": [False, True], "ignore_modules": [True, False]}
        self.run_subtests(config, self._check_inherited)

    def _check_inherited(self, pass_to_root: bool, ignore_modules: bool) -> None:
        torch.manual_seed(0)
        model = PerRankNet(num_scales=self.rank + 1).to(current_device())
        scales = [m for m in model.modules() if isinstance(m, Scale)]
        params = [p for m in scales for p in m.parameters()]
        child_kwargs = (
            {"ignored_modules": scales}
            if ignore_modules
            else {"ignored_states": (p for p in params)}
        )
        model.layer1 = FSDP(model.layer1, **child_kwargs)
        model.layer3 = FSDP(model.layer3)
        root_kwargs: dict[str, object] = {}
        if pass_to_root:
            root_kwargs = (
                {"ignored_modules": scales} if ignore_modules else {"ignored_states": set(params)}
            )
        wrapped = FSDP(model, **root_kwargs)
        numels = [torch.tensor(float(u._handle.flat_param.numel())) for u in _units(wrapped)]
        _agree_across_ranks(self, numels)
        _train(wrapped, self.rank, steps=3)


def _units(model: nn.Module) -> list[nn.Module]:
    return [unit for unit in FSDP.fsdp_modules(model) if unit._handle is not None]


class TestDifferentIgnoredPerRankWorld2(_DifferentIgnoredPerRank):
    world_size = 2


class TestDifferentIgnoredPerRankWorld3(_DifferentIgnoredPerRank):
    world_size = 3
