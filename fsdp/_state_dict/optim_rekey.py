"""Rekeying the optimizer state dict of a model without flat parameters: between
parameter IDs and parameter names."""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from fsdp._state_dict.optim_keys import OSD, KeySource, ModelParams
from fsdp.api import OptimStateKeyType


def rekey_optim_state_dict(
    osd: OSD, key_type: OptimStateKeyType, model: nn.Module, source: KeySource
) -> OSD:
    """``osd`` keyed by parameter IDs or names of a model without flat parameters."""
    if key_type not in (OptimStateKeyType.PARAM_NAME, OptimStateKeyType.PARAM_ID):
        raise AssertionError(f"Expected PARAM_NAME or PARAM_ID, got {key_type}")
    kinds = {type(key) for key in osd["state"]}
    if len(kinds) > 1 or not kinds <= {int, str}:
        raise ValueError(f"Invalid parameter keys: {osd['state'].keys()}")
    wanted = str if key_type is OptimStateKeyType.PARAM_NAME else int
    if kinds <= {wanted}:
        return osd
    params = ModelParams(model)
    names = {param: _single_name(fqns) for param, fqns in params.fqns.items()}
    ids = source.keys(params, model, named=False)
    id_to_name = {key: names[param] for key, param in ids.items()}
    mapping: dict[Any, Any] = id_to_name
    if key_type is OptimStateKeyType.PARAM_ID:
        mapping = {name: key for key, name in id_to_name.items()}
    groups = copy.deepcopy(osd["param_groups"])
    for group in groups:
        group["params"] = sorted(mapping[key] for key in group["params"])
    return {"state": {mapping[k]: v for k, v in osd["state"].items()}, "param_groups": groups}


def _single_name(fqns: tuple[str, ...]) -> str:
    if len(fqns) != 1:
        raise RuntimeError(
            f"Each parameter should only map to one parameter name but got {len(fqns)}: "
            f"{list(fqns)}"
        )
    return fqns[0]
