"""``torch.distributed.fsdp._traversal_utils`` for the FSDP under test:
``_get_fsdp_states`` and ``_get_fsdp_handles`` of a module tree.

Upstream tests import it as ``traversal_utils``; ``import upstream.fsdp_traversal
as traversal_utils`` keeps their code. Under ``--fsdp-impl torch`` these are
torch's own functions. Under ``--fsdp-impl local`` they walk the tree the same
way (depth first in ``modules()`` order, each unit once): a unit's state is its
``FullyShardedDataParallel`` wrapper, as in torch's wrapper path (``_handle``,
``_is_root``, ``sharding_strategy``, ...), or, for a module given
``fully_shard``, our ``FSDPState`` (``handle``, ``is_root``); a handle is the
unit's ``FlatParamHandle``, and units without parameters have none. Under another
implementation (``--fsdp-impl mypkg.fsdp``) the states are the instances of its
``FullyShardedDataParallel`` in the tree (the wrapper path), and the handles, its
private flat-parameter objects, are not known: asking for them skips the test.
"""

from __future__ import annotations

import unittest
from typing import Any

from torch import nn

from fsdptest.api import IMPL, IMPLEMENTATION, FlatParamHandle, FullyShardedDataParallel

if IMPL == "torch":
    import torch.distributed.fsdp._traversal_utils as _torch_traversal

    def _get_fsdp_states(module: nn.Module) -> list[Any]:
        """The FSDP states in the tree rooted at ``module``, in ``modules()`` order."""
        return list(_torch_traversal._get_fsdp_states(module))

    def _get_fsdp_handles(module: nn.Module) -> list[FlatParamHandle]:
        """The flat-parameter handles of the units in the tree rooted at ``module``."""
        return list(_torch_traversal._get_fsdp_handles(module))

elif IMPL == "local":
    from fsdp import _registry
    from fsdp._runtime import FSDPState

    def _local_units(module: nn.Module) -> list[tuple[nn.Module, FSDPState]]:
        """(owner, state) of every unit under ``module`` (itself included), once each."""
        units: list[tuple[nn.Module, FSDPState]] = []
        seen: set[int] = set()
        for submodule in module.modules():
            state = _registry.state_of(submodule)
            if state is not None and id(state) not in seen:
                seen.add(id(state))
                units.append((submodule, state))
        return units

    def _get_fsdp_states(module: nn.Module) -> list[Any]:
        """The FSDP states in the tree rooted at ``module``, in ``modules()`` order."""
        return [
            owner if isinstance(owner, FullyShardedDataParallel) else state
            for owner, state in _local_units(module)
        ]

    def _get_fsdp_handles(module: nn.Module) -> list[FlatParamHandle]:
        """The flat-parameter handles of the units in the tree rooted at ``module``."""
        return [state.handle for _, state in _local_units(module) if state.handle is not None]

else:

    def _get_fsdp_states(module: nn.Module) -> list[Any]:
        """The FSDP wrappers in the tree rooted at ``module``, in ``modules()`` order."""
        return [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]

    def _get_fsdp_handles(module: nn.Module) -> list[FlatParamHandle]:
        raise unittest.SkipTest(
            "needs the flat-parameter handles of each unit, private to this project's and "
            f"torch's FSDP, which the FSDP under test ({IMPLEMENTATION.describe()}) does not have"
        )


__all__ = ["_get_fsdp_handles", "_get_fsdp_states"]
