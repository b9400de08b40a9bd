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

from typing import Any

from torch import nn

from fsdptest.api import ADAPTER


def _get_fsdp_states(module: nn.Module) -> list[Any]:
    """The FSDP states in the tree rooted at ``module``, in ``modules()`` order."""
    return ADAPTER.fsdp_states(module)


def _get_fsdp_handles(module: nn.Module) -> list[Any]:
    """The flat-parameter handles of the units in the tree rooted at ``module``."""
    return ADAPTER.fsdp_handles(module)


__all__ = ["_get_fsdp_handles", "_get_fsdp_states"]
