"""In-process tests of ``fsdp.wrap``: policies, ``enable_wrap``/``wrap`` and the
auto-wrap pass, with a fake wrapper standing in for FullyShardedDataParallel.

Where the behaviour is a pure function of the model, ours is compared with
torch's (``torch.distributed.fsdp.wrap`` and ``_wrap_utils``) run on a deep copy.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed.fsdp._wrap_utils as torch_wrap_utils
import torch.distributed.fsdp.wrap as torch_wrap
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import fsdp.wrap as our_wrap
from fsdp.api import MixedPrecision, ShardingStrategy
from fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    _or_policy,
    _Policy,
    _validate_frozen_params,
    _wrap_module_cls_individually,
    always_wrap_policy,
    enable_wrap,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)
from tests.fsdp.wrap_policy_cases import (
    ALREADY_WRAPPED,
    CASES,
    FROZEN_PREFIX,
    IGNORE_FROZEN_WARNING,
    MIXED,
    TRANSFORMER_LAYER_NAMES,
    TRANSFORMER_LAYERS,
    BatchNormContainer,
    BatchNormNet,
    Case,
    FakeFSDP,
    LoraAttention,
    LoraDecoder,
    LoraMLP,
    LoraModel,
    Recorder,
    SharedChild,
    TinyTransformer,
    auto_wrap,
    bn_container_policy,
    lora_lambda,
    nested_sequential,
    root_kwargs,
    run_case,
    torch_auto_wrap,
    without_policy_key,
    wrapped,
)


@pytest.mark.parametrize("mixed_precision", [None, MIXED], ids=["full", "mixed"])
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_auto_wrap_same_units_and_kwargs_as_torch(
    case: Case, mixed_precision: MixedPrecision | None
) -> None:
    """Ours wraps exactly the modules torch wraps, each with the same kwargs, and
    warns with the same texts."""
    # use_orig_params=True: the LoRA models warn about their frozen parameters.
    kwargs = root_kwargs(mixed_precision=mixed_precision, use_orig_params=True)
    ours, theirs = run_case(case, our_wrap, kwargs), run_case(case, torch_wrap, kwargs)
    assert wrapped(ours.model) == without_policy_key(wrapped(theirs.model))
    assert all("auto_wrap_policy" not in kw for kw in wrapped(ours.model).values())
    assert ours.warnings == theirs.warnings


@pytest.mark.parametrize(
    "make_policy",
    [
        lambda w: w.ModuleWrapPolicy({LoraAttention, LoraMLP, nn.LayerNorm}),
        lambda w: w.CustomPolicy(lora_lambda),
    ],
    ids=["module_wrap_policy", "custom_policy"],
)
def test_run_policy_selects_same_modules_as_torch(make_policy: Callable[[ModuleType], Any]) -> None:
    """``_run_policy`` returns the same targets and kwargs as torch's, on the same model."""
    model = LoraModel()
    # Closed under submodules, as FSDP's constructor passes it to torch's.
    ignored = set(model.layers[3].modules())
    kwargs = root_kwargs()
    ours = make_policy(our_wrap)._run_policy(model, ignored, kwargs)
    theirs = make_policy(torch_wrap)._run_policy(model, ignored, dict(kwargs))
    assert ours == theirs
    assert kwargs == root_kwargs()


@pytest.mark.parametrize("recurse", [True, False])
@pytest.mark.parametrize("numel", [0, 39, 40, 10**9])
def test_size_based_policy_answers_like_torch(recurse: bool, numel: int) -> None:
    """The size-based answer matches torch's for every module class it treats specially."""
    modules = [nn.Linear(1, 1), nn.MultiheadAttention(4, 1), nn.ModuleList(), nn.ModuleDict()]
    for module in modules:
        for extra in ({}, {"min_num_params": 40}, {"force_leaf_modules": {nn.Linear}}):
            ours = size_based_auto_wrap_policy(module, recurse, numel, **extra)
            theirs = torch_wrap.size_based_auto_wrap_policy(module, recurse, numel, **extra)
            assert ours == theirs, (type(module), extra)


def test_size_based_policy_defaults_match_torch() -> None:
    """The default force-leaf and exclude sets are torch's."""
    assert size_based_auto_wrap_policy.FORCE_LEAF_MODULES == {nn.MultiheadAttention}
    assert size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES == {nn.ModuleList, nn.ModuleDict}


def test_post_order_wrap_calls_match_torch() -> None:
    """Units are built children first, in the same order as torch builds them."""
    torch.manual_seed(0)
    model = TinyTransformer()
    names = {m: name for name, m in model.named_modules()}
    ours, theirs = Recorder(), Recorder()
    kwargs = root_kwargs()
    auto_wrap(model, always_wrap_policy, dict(kwargs), fsdp_fn=ours)
    model = TinyTransformer()
    names.update({m: name for name, m in model.named_modules()})
    torch_wrap_utils._auto_wrap(model, always_wrap_policy, set(), set(), dict(kwargs), theirs)
    assert [names[m] for m in ours.wrapped] == [names[m] for m in theirs.wrapped]


# -------------------------------------------------------------- size-based


def test_size_based_wraps_only_subtree_over_min_params() -> None:
    """Two 30-numel linears stay unwrapped; their 60-numel parent is wrapped."""
    model = auto_wrap(
        nested_sequential(), functools.partial(size_based_auto_wrap_policy, min_num_params=40)
    )
    assert set(wrapped(model)) == {"2"}
    assert isinstance(model[2].module[0], nn.Linear)


def test_size_based_min_params_zero_wraps_every_submodule() -> None:
    """With ``min_num_params=0`` every module below the root is wrapped, never the root."""
    model = auto_wrap(
        nested_sequential(), functools.partial(size_based_auto_wrap_policy, min_num_params=0)
    )
    assert set(wrapped(model)) == {"0", "1", "2", "2.module.0", "2.module.1"}
    assert not isinstance(model, FakeFSDP)


def test_size_based_excludes_module_list_but_wraps_its_large_child() -> None:
    """A ModuleList is never wrapped; its child over the threshold is."""
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=40)
    model = auto_wrap(nn.Sequential(nn.ModuleList([nn.Linear(10, 10)])), policy)
    assert set(wrapped(model)) == {"0.0"}
    model = auto_wrap(nn.Sequential(nn.ModuleList([nn.Linear(5, 5), nn.Linear(5, 5)])), policy)
    assert wrapped(model) == {}


def test_size_based_force_leaf_multihead_attention_not_wrapped() -> None:
    """MultiheadAttention is a leaf: neither it nor its out_proj is wrapped."""
    model = nn.Sequential(nn.Linear(10, 10), nn.MultiheadAttention(100, 1))
    auto_wrap(model, functools.partial(size_based_auto_wrap_policy, min_num_params=40))
    assert set(wrapped(model)) == {"0"}
    assert isinstance(model[1].out_proj, nn.Linear)


def test_size_based_custom_force_leaf_wraps_nothing() -> None:
    """With Linear as a force-leaf class no module below the root is wrapped."""
    policy = functools.partial(
        size_based_auto_wrap_policy,
        min_num_params=40,
        force_leaf_modules=size_based_auto_wrap_policy.FORCE_LEAF_MODULES | {nn.Linear},
    )
    model = auto_wrap(nn.Sequential(nn.Linear(10, 10), nn.ModuleList([nn.Linear(10, 10)])), policy)
    assert wrapped(model) == {}


def test_size_based_shared_params_counted_once() -> None:
    """Tied weights count once toward the parent's numel (``parameters()`` deduplicates)."""
    model = TinyTransformer()
    numel = sum(p.numel() for p in model.parameters())
    calls: list[int] = []

    def spy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        if module is model:
            calls.append(nonwrapped_numel)
        return False

    auto_wrap(model, spy)
    assert calls == [numel]


# ------------------------------------------------- class-based policies


@pytest.mark.parametrize(
    "policy",
    [
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=TRANSFORMER_LAYERS),
        ModuleWrapPolicy(TRANSFORMER_LAYERS),
        functools.partial(_or_policy, policies=[ModuleWrapPolicy(TRANSFORMER_LAYERS)]),
    ],
    ids=["transformer_policy", "module_wrap_policy", "module_wrap_policy_in_or_policy"],
)
def test_transformer_layers_wrapped_and_nothing_else(policy: Any) -> None:
    """Exactly the encoder and decoder layers become units."""
    model = auto_wrap(TinyTransformer(), policy)
    assert set(wrapped(model)) == TRANSFORMER_LAYER_NAMES


def test_module_wrap_policy_as_function_policy() -> None:
    """As a function policy it always descends and wraps only its classes."""
    policy = ModuleWrapPolicy({nn.Linear})
    assert policy(nn.ReLU(), True, 0) and policy(module=nn.ReLU(), recurse=True, nonwrapped_numel=0)
    assert policy(module=nn.Linear(1, 1), recurse=False, nonwrapped_numel=-1)
    assert not policy(module=nn.ReLU(), recurse=False, nonwrapped_numel=10)


def test_module_wrap_policy_never_wraps_root() -> None:
    """A root of a selected class is left for the caller to wrap."""
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2))
    auto_wrap(model, ModuleWrapPolicy({nn.Sequential}))
    assert set(wrapped(model)) == {"0"}


def test_lambda_policy_wraps_modules_where_lambda_is_true() -> None:
    """``lambda_auto_wrap_policy`` wraps the modules its function picks."""
    policy = functools.partial(
        lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear)
    )
    model = auto_wrap(nested_sequential(), policy)
    assert set(wrapped(model)) == {"0", "1", "2.0", "2.1"}


def test_always_wrap_policy_wraps_every_submodule() -> None:
    """Every module below the root becomes a unit."""
    model = auto_wrap(nested_sequential(), always_wrap_policy)
    assert set(wrapped(model)) == {"0", "1", "2", "2.module.0", "2.module.1"}


# ------------------------------------------------------------ CustomPolicy


@pytest.mark.filterwarnings(IGNORE_FROZEN_WARNING)
def test_custom_policy_uniform_uses_root_kwargs() -> None:
    """``True`` wraps with the root kwargs, minus the policy itself."""
    policy = CustomPolicy(lambda m: isinstance(m, (LoraAttention, LoraMLP)))
    kwargs = root_kwargs(use_orig_params=True, auto_wrap_policy=policy)
    model = auto_wrap(LoraModel(), policy, kwargs)
    units = wrapped(model)
    assert set(units) == {f"layers.{i}.{sub}" for i in range(4) for sub in ("attn", "mlp")}
    assert all(kw == root_kwargs(use_orig_params=True) for kw in units.values())


@pytest.mark.filterwarnings(IGNORE_FROZEN_WARNING)
def test_custom_policy_dict_overrides_reach_fsdp_fn() -> None:
    """A returned dict overrides the root kwargs for that module only."""
    model = auto_wrap(LoraModel(), CustomPolicy(lora_lambda), root_kwargs(use_orig_params=True))
    units = wrapped(model)
    grad_op = ShardingStrategy.SHARD_GRAD_OP
    assert units["layers.0.module.attn"]["sharding_strategy"] is grad_op
    assert units["layers.0.module.mlp"]["sharding_strategy"] is ShardingStrategy.FULL_SHARD
    assert units["layers.0"]["sharding_strategy"] is ShardingStrategy.FULL_SHARD


@pytest.mark.parametrize("result", [1, None, "yes"])
def test_custom_policy_rejects_non_bool_non_dict(result: object) -> None:
    """Anything but a bool or a dict from ``lambda_fn`` is a ValueError."""

    def lambda_fn(module: nn.Module) -> Any:
        return result

    policy = CustomPolicy(lambda_fn)
    match = f"should return False/True or a kwarg dict, but it returned {result}"
    with pytest.raises(ValueError, match=match):
        auto_wrap(nn.Sequential(nn.Linear(1, 1)), policy)


def test_custom_policy_empty_dict_means_not_wrapped() -> None:
    """``{}`` is falsy: the module is not wrapped."""
    model = auto_wrap(nested_sequential(), CustomPolicy(lambda m: {}))
    assert wrapped(model) == {}


# -------------------------------------------- wrapping classes individually


@pytest.mark.parametrize("use_or_policy", [True, False])
def test_batchnorm_wrapped_individually(use_or_policy: bool) -> None:
    """Every _BatchNorm becomes a unit, the linear does not."""
    individually = functools.partial(_wrap_module_cls_individually, module_classes=[_BatchNorm])
    never = lambda *args, **kwargs: False
    policy = functools.partial(_or_policy, policies=[never, individually])
    model = auto_wrap(BatchNormNet(), policy if use_or_policy else individually)
    assert set(wrapped(model)) == {"bn1", "bn2", "bn3", "sync_bn"}


def test_batchnorm_wrapped_inside_wrapped_container() -> None:
    """An or-ed class policy still wraps BNs inside a container another policy wraps."""
    model = auto_wrap(BatchNormContainer(), bn_container_policy(our_wrap))
    inner = {f"bn_container.module.{bn}" for bn in ("bn1", "bn2", "bn3", "sync_bn")}
    assert set(wrapped(model)) == {"bn_container", *inner}


# ----------------------------------------------------- enable_wrap / wrap


def test_wrap_outside_context_returns_module_unchanged() -> None:
    """``wrap`` is a no-op outside ``enable_wrap``, even with overrides."""
    linear = nn.Linear(5, 5)
    assert wrap(linear, sharding_strategy=ShardingStrategy.NO_SHARD) is linear


def test_wrap_disabled_outside_context_then_enabled_inside() -> None:
    """A submodule wrapped at construction outside the context stays plain."""

    class MyModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = wrap(nn.Linear(5, 5), sharding_strategy=ShardingStrategy.NO_SHARD)

    model = MyModel()
    with enable_wrap(wrapper_cls=FakeFSDP, sharding_strategy=ShardingStrategy.FULL_SHARD):
        model = wrap(model)
    assert isinstance(model, FakeFSDP) and isinstance(model.module.lin, nn.Linear)
    assert wrap(nn.Linear(1, 1)).__class__ is nn.Linear


def test_wrap_overrides_win_over_context_kwargs() -> None:
    """Kwargs given to ``wrap`` override those of ``enable_wrap``."""
    with enable_wrap(wrapper_cls=FakeFSDP, sharding_strategy=ShardingStrategy.FULL_SHARD, x=1):
        layer = wrap(nn.Linear(5, 5), sharding_strategy=ShardingStrategy.NO_SHARD)
    assert isinstance(layer, FakeFSDP)
    assert layer.kwargs == {"sharding_strategy": ShardingStrategy.NO_SHARD, "x": 1}


def test_enable_wrap_does_not_nest_and_resets_after_error() -> None:
    """A nested context raises; the outer one is gone after its block, even on error."""
    with pytest.raises(RuntimeError), enable_wrap(wrapper_cls=FakeFSDP):
        with pytest.raises(NotImplementedError, match="do not supported nested autowrap"):
            with enable_wrap(wrapper_cls=FakeFSDP):
                pass
        raise RuntimeError
    linear = nn.Linear(1, 1)
    assert wrap(linear) is linear


# ---------------------------------------------------------- already wrapped


class AlreadyWrapped(nn.Module):
    def __init__(self, nested: bool) -> None:
        super().__init__()
        linear = lambda: nn.Linear(1, 1, bias=False)
        self.lin1 = nn.Sequential(linear(), FakeFSDP(linear())) if nested else FakeFSDP(linear())
        self.lin2 = FakeFSDP(linear())
        self.lin3 = FakeFSDP(linear())


@pytest.mark.parametrize("nested", [True, False])
def test_already_wrapped_submodule_raises_with_its_name(nested: bool) -> None:
    """The first module with FSDP applied is named, followed by the root's repr."""
    model = AlreadyWrapped(nested)
    name = "lin1.1" if nested else "lin1"
    with pytest.raises(ValueError) as error:
        auto_wrap(model, functools.partial(size_based_auto_wrap_policy, min_num_params=0))
    assert str(error.value) == f"{ALREADY_WRAPPED} {name} in\n{model}"


def test_already_wrapped_inside_ignored_module_still_raises() -> None:
    """The check covers ignored modules too."""
    model = AlreadyWrapped(nested=True)
    with pytest.raises(ValueError, match=f"{ALREADY_WRAPPED} lin1.1 in"):
        auto_wrap(model, always_wrap_policy, ignored=(model.lin1,))


# ----------------------------------------------------------- ignored modules


@pytest.mark.parametrize(
    "policy",
    [functools.partial(size_based_auto_wrap_policy, min_num_params=40), always_wrap_policy],
    ids=["size40", "always"],
)
def test_ignored_modules_not_wrapped_nor_counted(policy: Any) -> None:
    """Ignored modules are never wrapped and their numel never counts."""
    model = nested_sequential()
    auto_wrap(model, policy, ignored=(model[1], model[2][0]))
    if policy is always_wrap_policy:
        assert set(wrapped(model)) == {"0", "2", "2.module.1"}
    else:
        assert wrapped(model) == {}


def test_ignored_module_subtree_skipped_by_module_wrap_policy() -> None:
    """Passing only an ignored subtree root also excludes its descendants."""
    model = LoraModel()
    auto_wrap(model, ModuleWrapPolicy({LoraMLP}), ignored=(model.layers[0],))
    assert set(wrapped(model)) == {f"layers.{i}.mlp" for i in (1, 2, 3)}


# ----------------------------------------------------------- frozen params

FROZEN_POLICIES: dict[str, _Policy] = {
    "module_wrap_policy": ModuleWrapPolicy((LoraAttention, LoraMLP, LoraDecoder)),
    "custom_uniform": CustomPolicy(lambda m: isinstance(m, (LoraAttention, LoraMLP, LoraDecoder))),
    "custom_nonuniform": CustomPolicy(lora_lambda),
}


@pytest.mark.parametrize("policy", list(FROZEN_POLICIES.values()), ids=list(FROZEN_POLICIES))
def test_frozen_params_mixed_in_unit_raises_without_orig_params(policy: _Policy) -> None:
    """Mixed requires_grad in one unit is a ValueError with use_orig_params=False."""
    msg = f"{FROZEN_PREFIX} FSDP does not support wrapping such modules when use_orig_params=False."
    model = LoraModel()
    with pytest.raises(ValueError, match=msg):
        auto_wrap(model, policy, root_kwargs(use_orig_params=False))
    assert wrapped(model) == {}


@pytest.mark.parametrize("policy", list(FROZEN_POLICIES.values()), ids=list(FROZEN_POLICIES))
def test_frozen_params_mixed_in_unit_warns_with_orig_params(policy: _Policy) -> None:
    """Mixed requires_grad in one unit is a UserWarning with use_orig_params=True,
    one per offending unit, in post-order; the units are still built."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = auto_wrap(LoraModel(), policy, root_kwargs(use_orig_params=True))
    messages = [str(w.message) for w in caught if w.category is UserWarning]
    assert messages[0].startswith(f"{FROZEN_PREFIX} We do not recommend wrapping such modules")
    assert [m.split(" ")[0] for m in messages] == [f"layers.{i}.attn" for i in range(4)]
    assert "layers.0.module.attn" in wrapped(model)


def _lora_names(model: nn.Module, *needles: str) -> set[nn.Module]:
    return {m for name, m in model.named_modules() if any(n in name for n in needles)}


class FrozenStep(NamedTuple):
    modules_to_wrap: Callable[[LoraModel], set[nn.Module]]
    ignore_lora_a: bool
    expect_problem: bool


FROZEN_STEPS: dict[str, FrozenStep] = {
    "lora_only": FrozenStep(lambda m: _lora_names(m, "lora_A", "lora_B"), False, False),
    "lora_and_attn": FrozenStep(
        lambda m: _lora_names(m, "lora_A", "lora_B") | _lora_names(m, "attn"), False, False
    ),
    "attn_without_lora_a": FrozenStep(
        lambda m: (
            _lora_names(m, "lora_B") | {x for x in m.modules() if isinstance(x, LoraAttention)}
        ),
        False,
        True,
    ),
    "lora_a_ignored": FrozenStep(
        lambda m: (
            _lora_names(m, "lora_B") | {x for x in m.modules() if isinstance(x, LoraAttention)}
        ),
        True,
        False,
    ),
    "whole_model": FrozenStep(lambda m: {m}, False, True),
}


def _frozen_message(validate: Callable[..., None], step: FrozenStep, use_orig: bool) -> str | None:
    """The error or warning text of one validation, None if it passed silently."""
    model = LoraModel()
    ignored = {p for m in _lora_names(model, "lora_A") for p in m.parameters()}
    ignored = ignored if step.ignore_lora_a else set()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            validate(model, step.modules_to_wrap(model), ignored, use_orig)
        except ValueError as error:
            return str(error)
    return "\n---\n".join(str(w.message) for w in caught) or None


@pytest.mark.parametrize("use_orig_params", [True, False])
@pytest.mark.parametrize("step", list(FROZEN_STEPS.values()), ids=list(FROZEN_STEPS))
def test_validate_frozen_params_same_text_as_torch(step: FrozenStep, use_orig_params: bool) -> None:
    """Same first offender, same numels, same FQN lists, word for word."""
    ours = _frozen_message(_validate_frozen_params, step, use_orig_params)
    theirs = _frozen_message(torch_wrap_utils._validate_frozen_params, step, use_orig_params)
    assert ours == theirs
    assert (ours is not None) == step.expect_problem


def test_validate_frozen_params_names_attention_and_its_params() -> None:
    """The attention unit reports its own params only: lora_B belongs to its own unit."""
    model = LoraModel()
    to_wrap = _lora_names(model, "lora_B") | {
        m for m in model.modules() if isinstance(m, LoraAttention)
    }
    with pytest.raises(ValueError) as error:
        _validate_frozen_params(model, to_wrap, set(), use_orig_params=False)
    frozen = [f"layers.0.attn.{p}_proj.weight" for p in "qkvo"]
    assert str(error.value).startswith(FROZEN_PREFIX)
    assert str(error.value).endswith(
        "The following parameters have requires_grad=True:\n['layers.0.attn.lora_A.weight']\n"
        f"The following parameters have requires_grad=False:\n{frozen}"
    )


# ---------------------------------------------------------- mixed precision


@pytest.mark.parametrize(
    "policy",
    [
        ModuleWrapPolicy({nn.Linear}),
        functools.partial(size_based_auto_wrap_policy, min_num_params=1),
    ],
    ids=["module_wrap_policy", "size_based"],
)
def test_mixed_precision_batchnorm_wrapped_separately_in_full_precision(policy: Any) -> None:
    """BNs become units with mixed_precision=None; other units keep the root's."""
    model = BatchNormNet()
    with pytest.warns(UserWarning, match="These modules will be wrapped as separate FSDP") as rec:
        auto_wrap(model, policy, root_kwargs(mixed_precision=MIXED))
    units = wrapped(model)
    assert {n: kw["mixed_precision"] for n, kw in units.items()} == {
        "lin": MIXED,
        "bn1": None,
        "bn2": None,
        "bn3": None,
        "sync_bn": None,
    }
    text = str(rec[0].message)
    assert text.startswith("Both mixed precision and an auto_wrap_policy were specified to FSDP")
    assert "BatchNorm1d" in text and "SyncBatchNorm" in text


def test_mixed_precision_without_batchnorm_does_not_warn() -> None:
    """No instance of an ignored class, no warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = auto_wrap(
            nested_sequential(), always_wrap_policy, root_kwargs(mixed_precision=MIXED)
        )
    assert all(kw["mixed_precision"] == MIXED for kw in wrapped(model).values())


def test_mixed_precision_batchnorm_runs_in_float32_like_torch() -> None:
    """BN sees float32 inputs and returns the input's dtype, bitwise as torch's hooks do."""
    torch.manual_seed(0)
    ours = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    theirs = copy.deepcopy(ours)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        auto_wrap(ours, ModuleWrapPolicy({nn.Linear}), root_kwargs(mixed_precision=MIXED))
        torch_auto_wrap(
            theirs, torch_wrap.ModuleWrapPolicy({nn.Linear}), root_kwargs(mixed_precision=MIXED)
        )
    seen: list[torch.dtype] = []
    ours[1].module.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    out = ours[1].module(x)
    assert seen == [torch.float32] and out.dtype == torch.bfloat16
    assert torch.equal(out, theirs[1].module(x))
    assert ours[1].module(x.float()).dtype == torch.float32


# ------------------------------------------------------------- invariants


@pytest.mark.parametrize(
    "policy",
    [
        ModuleWrapPolicy({nn.Linear}),
        CustomPolicy(lambda m: isinstance(m, nn.Linear)),
        always_wrap_policy,
    ],
    ids=["module_wrap_policy", "custom_policy", "always"],
)
def test_root_kwargs_not_mutated(policy: Any) -> None:
    """The caller's dict is left as it was, policy key and mixed precision included."""
    kwargs = root_kwargs(mixed_precision=MIXED, auto_wrap_policy=policy)
    snapshot = dict(kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = auto_wrap(BatchNormContainer(), policy, kwargs)
    assert kwargs == snapshot
    assert all("auto_wrap_policy" not in kw for kw in wrapped(model).values())


def test_composable_policy_key_not_passed_to_children() -> None:
    """The composable form's ``policy`` kwarg is dropped like ``auto_wrap_policy``."""
    model = auto_wrap(
        nested_sequential(), always_wrap_policy, {"policy": always_wrap_policy, "x": 1}
    )
    assert all(kw == {"x": 1} for kw in wrapped(model).values())


def test_wrapped_children_before_parents() -> None:
    """Post-order: a unit is built after every unit below it."""
    recorder = Recorder()
    model = nested_sequential()
    expected = [model[0], model[1], model[2][0], model[2][1], model[2]]
    auto_wrap(model, always_wrap_policy, fsdp_fn=recorder)
    assert recorder.wrapped == expected


def test_shared_module_wrapped_once_for_every_parent() -> None:
    """A module under two parents becomes one unit that both parents hold."""
    recorder = Recorder()
    model = SharedChild()
    auto_wrap(model, ModuleWrapPolicy({nn.Linear}), fsdp_fn=recorder)
    assert isinstance(model.shared, FakeFSDP) and model.seq[0] is model.shared
    assert len(recorder.wrapped) == 2
