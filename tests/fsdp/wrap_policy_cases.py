"""Models, policies and cases shared by ``tests/fsdp/test_wrap_policies.py``: a fake
wrapper standing in for FullyShardedDataParallel, small models with the module
kinds the policies single out, and the auto-wrap cases run through ours and
torch's ``fsdp.wrap``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import torch
import torch.distributed.fsdp._wrap_utils as torch_wrap_utils
from torch import nn
from torch.nn import TransformerDecoderLayer, TransformerEncoderLayer
from torch.nn.modules.batchnorm import _BatchNorm

import fsdp.wrap as our_wrap
from fsdp import _registry
from fsdp.api import MixedPrecision, ShardingStrategy
from fsdp.wrap import (
    _auto_wrap,
)

Kwargs = dict[str, Any]
MIXED = MixedPrecision(param_dtype=torch.bfloat16)
ALREADY_WRAPPED = "FSDP auto wrapping requires modules to not already have FSDP applied but found"
FROZEN_PREFIX = "layers.0.attn has both parameters with requires_grad=True and False."
IGNORE_FROZEN_WARNING = "ignore:.*has both parameters with requires_grad=True and False:UserWarning"


class _FakeState:
    """What the registry maps a unit to (the unit owns it, the registry refers to it weakly)."""


class FakeFSDP(nn.Module):
    """Stands in for the wrapper class: holds the module and records its kwargs."""

    module: nn.Module
    kwargs: Kwargs
    state: _FakeState

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        self.module = module
        self.kwargs = kwargs
        self.state = _FakeState()
        _registry.register(self, self.state)


class Recorder:
    """An ``fsdp_fn`` that remembers the modules it wrapped, in call order."""

    wrapped: list[nn.Module]

    def __init__(self) -> None:
        self.wrapped = []

    def __call__(self, module: nn.Module, **kwargs: Any) -> FakeFSDP:
        self.wrapped.append(module)
        return FakeFSDP(module, **kwargs)


# ----------------------------------------------------------------- models


def nested_sequential() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(5, 5), nn.Linear(5, 5), nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5))
    )


class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(10, 10, bias=False)
        self.bn1 = nn.BatchNorm1d(10)
        self.bn2 = nn.BatchNorm2d(10)
        self.bn3 = nn.BatchNorm3d(10)
        self.sync_bn = nn.SyncBatchNorm(10)


class BatchNormContainer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn_container = BatchNormNet()
        self.head = nn.Linear(10, 10)


class LoraAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(32, 32, bias=False)
        self.lora_A = nn.Linear(32, 8, bias=False)
        self.lora_B = nn.Linear(8, 32, bias=False)
        self.k_proj = nn.Linear(32, 32, bias=False)
        self.v_proj = nn.Linear(32, 32, bias=False)
        self.o_proj = nn.Linear(32, 32, bias=False)
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            proj.weight.requires_grad_(False)


class LoraMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj1 = nn.Linear(32, 128, bias=False)
        self.proj2 = nn.Linear(128, 32, bias=False)
        self.proj1.weight.requires_grad_(False)
        self.proj2.weight.requires_grad_(False)


class LoraDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = LoraAttention()
        self.mlp = LoraMLP()
        self.inp_layernorm = nn.LayerNorm(32)
        self.post_attn_layernorm = nn.LayerNorm(32)
        self.inp_layernorm.requires_grad_(False)
        self.post_attn_layernorm.requires_grad_(False)


class LoraModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(100, 32)
        self.layers = nn.ModuleList([LoraDecoder() for _ in range(4)])
        self.norm = nn.LayerNorm(32)
        self.embed_tokens.requires_grad_(False)
        self.norm.requires_grad_(False)


class TinyTransformer(nn.Module):
    """Embedding, encoder-decoder and an output projection tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.transformer = nn.Transformer(
            d_model=8,
            nhead=2,
            num_encoder_layers=2,
            num_decoder_layers=2,
            dim_feedforward=16,
            batch_first=True,
        )
        self.out = nn.Linear(8, 20, bias=False)
        self.out.weight = self.embed.weight


class SharedChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.seq = nn.Sequential(self.shared, nn.Linear(4, 4))


TRANSFORMER_LAYERS = {TransformerEncoderLayer, TransformerDecoderLayer}
TRANSFORMER_LAYER_NAMES = {
    f"transformer.{stack}.layers.{i}" for stack in ("encoder", "decoder") for i in (0, 1)
}


# ---------------------------------------------------------------- helpers


def root_kwargs(**overrides: Any) -> Kwargs:
    """What FSDP's constructor passes down, minus the process group."""
    kwargs: Kwargs = {
        "sharding_strategy": ShardingStrategy.FULL_SHARD,
        "mixed_precision": None,
        "use_orig_params": False,
    }
    return {**kwargs, **overrides}


def auto_wrap(
    model: nn.Module,
    policy: Any,
    kwargs: Kwargs | None = None,
    ignored: tuple[nn.Module, ...] = (),
    fsdp_fn: Callable[..., nn.Module] = FakeFSDP,
) -> nn.Module:
    ignored_params = {p for module in ignored for p in module.parameters()}
    kwargs = root_kwargs() if kwargs is None else kwargs
    _auto_wrap(model, policy, set(ignored), ignored_params, kwargs, fsdp_fn)
    return model


def torch_auto_wrap(
    model: nn.Module, policy: Any, kwargs: Kwargs, ignored: tuple[nn.Module, ...] = ()
) -> nn.Module:
    """Torch's auto-wrap pass with the same fake wrapper (it mutates ``kwargs``)."""
    ignored_modules = {sub for module in ignored for sub in module.modules()}
    ignored_params = {p for module in ignored for p in module.parameters()}
    torch_wrap_utils._auto_wrap(model, policy, ignored_modules, ignored_params, kwargs, FakeFSDP)
    return model


def wrapped(model: nn.Module) -> dict[str, Kwargs]:
    """Name of every fake unit under ``model`` mapped to the kwargs it was built with."""
    return {name: m.kwargs for name, m in model.named_modules() if isinstance(m, FakeFSDP)}


def lora_lambda(module: nn.Module) -> bool | Kwargs:
    if isinstance(module, LoraAttention):
        return {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}
    return isinstance(module, (LoraMLP, LoraDecoder))


# ------------------------------------------------------ parity with torch


class Case(NamedTuple):
    """A model, a policy built from a wrap module (``fsdp.wrap`` or torch's), and
    the names of the modules to ignore."""

    model: Callable[[], nn.Module]
    policy: Callable[[ModuleType], Any]
    ignored: tuple[str, ...] = ()


class Outcome(NamedTuple):
    model: nn.Module
    warnings: list[str]


def _size(min_num_params: int) -> Callable[[ModuleType], Any]:
    return lambda w: functools.partial(w.size_based_auto_wrap_policy, min_num_params=min_num_params)


def bn_container_policy(w: ModuleType) -> Any:
    def wrap_bn_container(module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        return recurse or isinstance(module, BatchNormNet)

    individually = functools.partial(w._wrap_module_cls_individually, module_classes=[_BatchNorm])
    return functools.partial(w._or_policy, policies=[wrap_bn_container, individually])


CASES: dict[str, Case] = {
    "size40_nested": Case(nested_sequential, _size(40)),
    "size0_nested": Case(nested_sequential, _size(0)),
    "size40_nested_ignored": Case(nested_sequential, _size(40), ("1", "2.0")),
    "size40_mha_leaf": Case(
        lambda: nn.Sequential(nn.Linear(10, 10), nn.MultiheadAttention(100, 1)), _size(40)
    ),
    "size40_custom_leaf": Case(
        lambda: nn.Sequential(nn.Linear(10, 10), nn.ModuleList([nn.Linear(10, 10)])),
        lambda w: functools.partial(
            w.size_based_auto_wrap_policy,
            min_num_params=40,
            force_leaf_modules=w.size_based_auto_wrap_policy.FORCE_LEAF_MODULES | {nn.Linear},
        ),
    ),
    "size40_module_list": Case(
        lambda: nn.Sequential(nn.ModuleList([nn.Linear(10, 10)]), nn.Linear(3, 3)), _size(40)
    ),
    "size300_transformer": Case(TinyTransformer, _size(300)),
    "size100_batchnorm": Case(BatchNormContainer, _size(100)),
    "always_transformer": Case(TinyTransformer, lambda w: w.always_wrap_policy),
    "always_batchnorm": Case(BatchNormContainer, lambda w: w.always_wrap_policy),
    "transformer_policy": Case(
        TinyTransformer,
        lambda w: functools.partial(
            w.transformer_auto_wrap_policy, transformer_layer_cls=TRANSFORMER_LAYERS
        ),
    ),
    "module_wrap_policy": Case(TinyTransformer, lambda w: w.ModuleWrapPolicy(TRANSFORMER_LAYERS)),
    "module_wrap_policy_callable": Case(
        TinyTransformer,
        lambda w: functools.partial(
            w._or_policy, policies=[w.ModuleWrapPolicy(TRANSFORMER_LAYERS)]
        ),
    ),
    "module_wrap_policy_ignored": Case(
        LoraModel, lambda w: w.ModuleWrapPolicy({LoraAttention, LoraMLP}), ("layers.1",)
    ),
    "module_wrap_policy_batchnorm": Case(
        BatchNormContainer, lambda w: w.ModuleWrapPolicy({BatchNormNet})
    ),
    "lambda_policy": Case(
        LoraModel,
        lambda w: functools.partial(
            w.lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear)
        ),
    ),
    "custom_policy": Case(LoraModel, lambda w: w.CustomPolicy(lora_lambda)),
    "custom_policy_ignored": Case(LoraModel, lambda w: w.CustomPolicy(lora_lambda), ("layers.2",)),
    "bn_individually": Case(
        BatchNormNet,
        lambda w: functools.partial(w._wrap_module_cls_individually, module_classes=[_BatchNorm]),
    ),
    "bn_or_container": Case(BatchNormContainer, bn_container_policy),
}


def run_case(case: Case, wrap_module: ModuleType, kwargs: Kwargs) -> Outcome:
    torch.manual_seed(0)
    model = case.model()
    ignored = tuple(model.get_submodule(name) for name in case.ignored)
    run = auto_wrap if wrap_module is our_wrap else torch_auto_wrap
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(model, case.policy(wrap_module), dict(kwargs), ignored)
    return Outcome(model, [str(w.message) for w in caught])


def without_policy_key(units: dict[str, Kwargs]) -> dict[str, Kwargs]:
    # Torch's _Policy path passes auto_wrap_policy=None; ours leaves the key out.
    return {
        name: {k: v for k, v in kw.items() if k != "auto_wrap_policy"} for name, kw in units.items()
    }
