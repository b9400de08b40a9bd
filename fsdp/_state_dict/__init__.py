"""State dicts and optimizer state dicts of FSDP units.

Module state dicts go through four hooks per unit (``hooks``): ``kinds`` holds what
each state-dict type does on save and load, ``keys`` the clean names of a unit's
entries, ``values`` its sharded and local values, ``settings`` which type and config
apply. Optimizer state dicts: ``optim_keys`` names the model's parameters the same
way on every rank, ``optim_unit`` moves one unit's states, ``optim_save`` turns a
rank's local dict into the full or sharded form, ``optim_load`` turns such a dict
back into the local form, ``optim_rekey`` rekeys a plain model's dict, and
``deprecation`` holds the deprecated APIs' warnings.
"""

from __future__ import annotations

from fsdp._state_dict.deprecation import warn_legacy, warn_optim_input
from fsdp._state_dict.hooks import StateDictHooks
from fsdp._state_dict.optim_keys import KeySource
from fsdp._state_dict.optim_load import optim_state_dict_to_load
from fsdp._state_dict.optim_rekey import rekey_optim_state_dict
from fsdp._state_dict.optim_save import optim_state_dict
from fsdp._state_dict.optim_unit import SaveForm
from fsdp._state_dict.settings import optim_settings_with_mesh

__all__ = [
    "KeySource",
    "SaveForm",
    "StateDictHooks",
    "optim_settings_with_mesh",
    "optim_state_dict",
    "optim_state_dict_to_load",
    "rekey_optim_state_dict",
    "warn_legacy",
    "warn_optim_input",
]
