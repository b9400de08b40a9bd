"""What a run sets up and clears around its model (rank side): the process
groups of a hybrid scenario, the environment switch it builds its units under,
the unit attributes it observes, and the autograd hooks left by a run that
stopped in a forward."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

STATE_DICT_TYPES = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")
UNIT_ATTRIBUTES = (
    "rank",
    "world_size",
    "process_group",
    "_inter_node_pg",
    "sharding_strategy",
    "cpu_offload",
    "backward_prefetch",
    "forward_prefetch",
    "limit_all_gathers",
    "mixed_precision",
    "compute_device",
)


def unit_attribute(unit: nn.Module, name: str) -> Any:
    value = getattr(unit, name, None)
    if isinstance(value, dist.ProcessGroup):
        return ("group of ranks", tuple(dist.get_process_group_ranks(value)))
    return value


@contextlib.contextmanager
def full_prec_in_eval(on: bool) -> Iterator[None]:
    """``FSDP_USE_FULL_PREC_IN_EVAL`` as the scenario sets it while the units are
    built (both implementations read it then), restored afterwards."""
    name = "FSDP_USE_FULL_PREC_IN_EVAL"
    before = os.environ.get(name)
    os.environ[name] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def drop_parameter_hooks(model: nn.Module) -> None:
    """Removes the autograd hooks an implementation keeps on its parameters and
    clears their attributes, at the end of a run.

    [Note: Runs that stop in a forward]
    An FSDP hooks each flat parameter's AccumulateGrad node in its forward and
    removes the hook after the backward. A run that stops in between (a forward
    that raised) leaves it: the node keeps its hooks in C++, the hook the unit's
    state, the state the node (torch's through the flat parameter's
    ``_post_backward_hook_state``), a cycle the garbage collector cannot see, so
    the unit and its process groups would outlive the scenario. Hooks are
    removed through their handles (in the parameters' attributes, as torch keeps
    them); the model is not used after this."""
    with contextlib.suppress(Exception):
        for param in model.parameters():
            attributes = getattr(param, "__dict__", {})
            for value in list(attributes.values()):
                for item in value if isinstance(value, tuple) else (value,):
                    if isinstance(item, RemovableHandle):
                        item.remove()
            attributes.clear()


def own_group(layout: list[list[int]], rank: int) -> Any:
    groups = {tuple(ranks): dist.new_group(ranks) for ranks in layout}
    return next(group for ranks, group in groups.items() if rank in ranks)
