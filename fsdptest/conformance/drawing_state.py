"""The state-dict rules of the conformance search's program machine: model and
optimizer state dicts saved under the settings in effect, and loaded, rekeyed
or set aside (see [Note: Programs are drawn by a rule-based state machine] in
fsdptest.conformance.drawing).

[Note: Optimizer state round trips]
A load needs a save of a kind it can read, and drawn apart the two seldom meet
in one program: a sample of 180 programs drew 76 saves and no load. So a save
is drawn with what follows it at once: nothing (the save is checked alone, and
a later rule may load it), a load through the loader of its API, or (for a
full dict) a scatter from rank 0. Shrinking still removes the load alone,
by drawing ``then=None``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from fsdptest.conformance import scenario as sc
from fsdptest.conformance.history import GradHistory
from fsdptest.conformance.target import Target

# What follows a save at once ([Note: Optimizer state round trips]); None first: what
# shrinking tends to.
ROUND_TRIPS: tuple[str | None, ...] = (None, None, "load", "scatter")


def settings_strategy(kinds: list[sc.StateDictKind]) -> st.SearchStrategy[sc.Settings]:
    return st.builds(
        sc.Settings,
        kind=st.sampled_from(kinds),
        configs=st.booleans(),
        offload_to_cpu=st.booleans(),
        rank0_only=st.booleans(),
        dtensor=st.booleans(),
        optim_offload=st.booleans().map(lambda b: not b),
        optim_rank0_only=st.booleans(),
    )


@dataclasses.dataclass
class Saved:
    """A state dict the program saved: the settings in effect then."""

    settings: sc.Settings


@dataclasses.dataclass
class SavedOptim:
    api: sc.OptimApi
    settings: sc.Settings  # in effect when saved
    rank0_only: bool  # only rank 0 holds it


class StateDictRules:
    """The rules of model and optimizer state dicts, mixed into ``ProgramMachine``
    (which defines the state they read)."""

    TARGET: Target
    net: sc.Net | None
    setup: sc.Setup
    pending: bool
    kept: bool
    settings: sc.Settings
    contexts: list[tuple[str, sc.Settings]]
    saved: list[Saved]
    saved_optim: list[SavedOptim]
    history: GradHistory
    _free: Callable[[], bool]
    _may_change_parameters: Callable[[], bool]
    _add: Callable[..., None]

    # -- state dicts ---------------------------------------------------------------------------

    def _kinds(self) -> list[sc.StateDictKind]:
        return self.TARGET.state_dict_kinds(self.setup)

    @precondition(lambda self: self.net is not None and not self.pending)
    @rule(data=st.data())
    def set_state_dict_type(self, data: st.DataObject) -> None:
        settings = self.TARGET.fit_settings(
            data.draw(settings_strategy(self._kinds()), label="settings"), self.setup
        )
        self._add(sc.SetStateDictType(settings))
        self.settings = settings  # until an enclosing state_dict_type context restores its own

    @precondition(lambda self: self.net is not None and not self.pending)
    @rule(data=st.data())
    def enter_state_dict_type(self, data: st.DataObject) -> None:
        settings = self.TARGET.fit_settings(
            data.draw(settings_strategy(self._kinds()), label="settings"), self.setup
        )
        self._add(sc.EnterStateDictType(settings))
        self.contexts.append(("state_dict_type", self.settings))
        self.settings = settings

    @precondition(
        lambda self: (
            self._free()
            and not (
                self.history.replaced
                and self.settings.kind is sc.StateDictKind.LOCAL
                and not self.TARGET.may_save_local_before_writeback()
            )
        )
    )
    @rule()
    def save_state_dict(self) -> None:
        self._add(sc.SaveStateDict())
        self.saved.append(Saved(self.settings))

    def _loadable(self) -> list[int]:
        """Slots saved under the kind in effect, by every rank."""
        return [
            i
            for i, saved in enumerate(self.saved)
            if saved.settings.kind is self.settings.kind
            and not (saved.settings.kind is sc.StateDictKind.FULL and saved.settings.rank0_only)
            and self.TARGET.may_load(self.setup, saved.settings.kind)
            and not (
                saved.settings.kind is sc.StateDictKind.LOCAL
                and self.kept
                and not self.TARGET.may_load_local_after_forward()
            )
        ]

    @precondition(
        lambda self: self._free() and bool(self._loadable()) and self._may_change_parameters()
    )
    @rule(
        data=st.data(),
        strict=st.booleans().map(lambda b: not b),
        edit=st.sampled_from(list(sc.LoadEdit)),
    )
    def load_state_dict(self, data: st.DataObject, strict: bool, edit: sc.LoadEdit) -> None:
        slot = data.draw(st.sampled_from(self._loadable()), label="slot")
        self._add(sc.LoadStateDict(slot=slot, strict=strict, edit=edit))

    # -- optimizer state dicts --------------------------------------------------------------------

    @precondition(lambda self: self._free() and self._may_save_optim())
    @rule(
        api=st.sampled_from(list(sc.OptimApi)),
        rank0_only=st.booleans().map(lambda b: not b),
        then=st.sampled_from(ROUND_TRIPS),
    )
    def save_optim_state(self, api: sc.OptimApi, rank0_only: bool, then: str | None) -> None:
        self._save_optim(api, rank0_only)
        slot = len(self.saved_optim) - 1
        if then is not None and slot in self._optim_loadable():
            self._add(sc.LoadOptimState(slot=slot, scatter=then == "scatter"))

    def _may_save_optim(self) -> bool:
        if self.history.orphans_possible:  # see GradHistory.params_replaced
            return False
        return self.TARGET.may_save_optim_state(self.setup) and not (
            self.history.optim_partial
            and self.setup.use_orig_params
            and not self.TARGET.may_save_optim_state_of_some()
        )

    def _save_optim(self, api: sc.OptimApi, full_rank0_only: bool = True) -> None:
        settings = self.settings
        if api is sc.OptimApi.OPTIM_STATE_DICT and settings.kind is sc.StateDictKind.LOCAL:
            api = sc.OptimApi.FULL
        rank0_only = (api is sc.OptimApi.FULL and full_rank0_only) or (
            api is sc.OptimApi.OPTIM_STATE_DICT
            and settings.kind is sc.StateDictKind.FULL
            and settings.configs
            and settings.optim_rank0_only
        )
        self._add(sc.SaveOptimState(api=api, rank0_only=full_rank0_only))
        self.saved_optim.append(SavedOptim(api, settings, rank0_only))

    def _optim_loadable(self) -> list[int]:
        if self.history.orphans_possible:  # see GradHistory.params_replaced
            return []
        slots = []
        for i, saved in enumerate(self.saved_optim):
            if saved.api is not sc.OptimApi.OPTIM_STATE_DICT:
                slots.append(i)
            elif saved.settings.kind is self.settings.kind and not saved.rank0_only:
                slots.append(i)
        return slots

    @precondition(lambda self: self._free() and bool(self._optim_loadable()))
    @rule(data=st.data(), scatter=st.booleans())
    def load_optim_state(self, data: st.DataObject, scatter: bool) -> None:
        slot = data.draw(st.sampled_from(self._optim_loadable()), label="slot")
        self._add(sc.LoadOptimState(slot=slot, scatter=scatter))

    def _rekeyable(self) -> list[int]:
        if self.history.orphans_possible:  # see GradHistory.params_replaced
            return []
        return [
            i
            for i, saved in enumerate(self.saved_optim)
            if not saved.rank0_only
            and (saved.api is not sc.OptimApi.SHARDED)
            and (saved.api is sc.OptimApi.FULL or saved.settings.kind is sc.StateDictKind.FULL)
        ]

    @precondition(lambda self: self._free() and bool(self._rekeyable()))
    @rule(data=st.data())
    def rekey_optim_state(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(self._rekeyable()), label="slot")
        self._add(sc.RekeyOptimState(slot=slot))
