"""``FSDP.state_dict_type`` as a context restores the settings in effect before it.

Settings installed by ``set_state_dict_type`` (a type, its state-dict config and
its optimizer config, with every field drawn away from its default) are in
effect before a ``state_dict_type`` context of another type and configs; after
the context, whether it was left normally or by an exception, and after two
nested contexts, ``get_state_dict_type`` of the root and of every inner unit
gives the earlier type and config fields back, and the root's ``state_dict()``
saves by them again (the kind of its values, its keys and which ranks get
them). ``set_state_dict_type`` returns the settings it replaced. Torch's
context has no ``finally``: left by an exception it keeps its own settings
(``KnownDefects.state_dict_type_context_kept_after_exception``, asserted).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Any

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from fsdptest import FSDPTest
from fsdptest.api import (
    ADAPTER,
    FSDP,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictType,
)
from fsdptest.limitations import torch_local_offload_fails

_FULL, _SHARDED, _LOCAL = (
    StateDictType.FULL_STATE_DICT,
    StateDictType.SHARDED_STATE_DICT,
    StateDictType.LOCAL_STATE_DICT,
)


@dataclasses.dataclass(frozen=True)
class Settings:
    """A type and its two configs, given as their fields (built fresh when used)."""

    kind: StateDictType
    offload: bool = False
    rank0_only: bool = False
    optim_offload: bool = True
    optim_rank0_only: bool = False

    def configs(self) -> tuple[Any, Any]:
        if self.kind is _FULL:
            config: Any = FullStateDictConfig(
                offload_to_cpu=self.offload, rank0_only=self.rank0_only
            )
            optim: Any = FullOptimStateDictConfig(
                offload_to_cpu=self.optim_offload, rank0_only=self.optim_rank0_only
            )
        elif self.kind is _SHARDED:
            config = ShardedStateDictConfig(offload_to_cpu=self.offload)
            optim = ShardedOptimStateDictConfig(offload_to_cpu=self.optim_offload)
        else:
            config = LocalStateDictConfig(offload_to_cpu=self.offload)
            optim = LocalOptimStateDictConfig(offload_to_cpu=self.optim_offload)
        return config, optim

    def install(self, model: nn.Module) -> Any:
        return FSDP.set_state_dict_type(model, self.kind, *self.configs())

    def context(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return FSDP.state_dict_type(model, self.kind, *self.configs())


def _fields(settings: Any) -> tuple[object, ...]:
    """What a ``StateDictSettings`` says: its type, and each config's type and
    user-facing fields."""
    config, optim = settings.state_dict_config, settings.optim_state_dict_config
    return (
        settings.state_dict_type,
        type(config).__name__,
        config.offload_to_cpu,
        getattr(config, "rank0_only", None),
        type(optim).__name__,
        optim.offload_to_cpu,
        getattr(optim, "rank0_only", None),
    )


BEFORE = (
    Settings(_FULL, rank0_only=True, optim_offload=False, optim_rank0_only=True),
    Settings(_FULL, offload=True, rank0_only=True, optim_rank0_only=True),
    Settings(_FULL, offload=True, optim_offload=False),
    Settings(_SHARDED, optim_offload=False),
    Settings(_SHARDED, offload=True),
    Settings(_LOCAL, optim_offload=False),
    Settings(_LOCAL, offload=True),
)
INSIDE = (Settings(_FULL), Settings(_SHARDED, offload=True), Settings(_LOCAL))


_NO_LONGER_KEPT = (
    "torch's FSDP restored the settings after an exception in a state_dict_type context: "
    "KnownDefects.state_dict_type_context_kept_after_exception no longer holds"
)


class Leaves(Exception):
    """Raised inside a context to leave it by an exception."""


class TestStateDictTypeContext(FSDPTest):
    world_size = 2

    def _model(self) -> nn.Module:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 5), nn.Linear(5, 2)).to(self.device)
        net[1] = FSDP(net[1], device_id=self.device)
        return FSDP(net, device_id=self.device)

    def test_context_restores_the_settings_before_it(self) -> None:
        """Every earlier setting x context setting x nesting x leaving by an exception."""
        configs = [
            {"before": b, "inside": i, "nested": n, "raises": r}
            for b, i, n, r in itertools.product(BEFORE, INSIDE, (False, True), (False, True))
            if i.kind is not b.kind or n
        ]
        self.run_subtests({"config": configs}, lambda config: self._check(**config))

    def _check(self, before: Settings, inside: Settings, nested: bool, raises: bool) -> None:
        model = self._model()
        replaced = before.install(model)
        self.assertEqual(_fields(replaced)[:2], (_FULL, "FullStateDictConfig"))
        expected = _fields(FSDP.get_state_dict_type(model))
        saved_before = self._saved(model, before)
        with contextlib.suppress(Leaves), inside.context(model):
            self.assertEqual(_fields(FSDP.get_state_dict_type(model))[0], inside.kind)
            if nested:
                with BEFORE[-1].context(model):
                    pass
            if raises:
                raise Leaves
        if raises and ADAPTER.known_defects.state_dict_type_context_kept_after_exception:
            kept = _fields(FSDP.get_state_dict_type(model))[0]
            self.assertEqual(kept, inside.kind, msg=_NO_LONGER_KEPT)
            return
        for unit in (model, model.module[1]):
            self.assertEqual(_fields(FSDP.get_state_dict_type(unit)), expected)
        self.assertEqual(self._saved(model, before), saved_before)

    def _saved(self, model: nn.Module, settings: Settings) -> tuple[object, ...] | None:
        """What ``state_dict()`` gives under ``settings``: its keys and the kind of
        each value (None where offloading is beyond the FSDP under test on this
        run: torch's, see fsdptest.limitations)."""
        if (
            settings.offload
            and settings.kind is _FULL
            and ADAPTER.limitations.offload_to_cpu_on_cpu
        ):
            return None
        if settings.offload and settings.kind is _LOCAL and torch_local_offload_fails():
            return None
        state = model.state_dict()
        kinds = [
            type(v).__name__ if isinstance(v, ShardedTensor) else "tensor" for v in state.values()
        ]
        return tuple(state), tuple(kinds)
