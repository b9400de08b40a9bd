"""An FSDP implementation under another module name, for ``--fsdp-impl tests.harness.example_impl``.

It is this project's ``fsdp`` seen only through its public FSDP1 API, as a foreign
package would offer one: every public name at the top level (no ``wrap`` or
``sharded_grad_scaler`` submodule), none of the private seams. An adapter for
another package has the same shape: import or define each name, here or in
``wrap`` and ``sharded_grad_scaler`` submodules.
"""

from __future__ import annotations

from fsdp import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    FullyShardedDataParallel,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictSettings,
    StateDictType,
)
from fsdp.sharded_grad_scaler import ShardedGradScaler
from fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    _or_policy,
    _Policy,
    _wrap_module_cls_individually,
    always_wrap_policy,
    enable_wrap,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "CustomPolicy",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "ModuleWrapPolicy",
    "OptimStateKeyType",
    "ShardedGradScaler",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictSettings",
    "StateDictType",
    "_Policy",
    "_or_policy",
    "_wrap_module_cls_individually",
    "always_wrap_policy",
    "enable_wrap",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]
