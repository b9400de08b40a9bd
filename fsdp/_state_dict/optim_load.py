"""Loading optimizer state: a full or sharded dict into the local form of a model's
optimizer, from every rank or from rank 0 alone.

[Note: Flattening for loading]
The way back, per model parameter in model order. ``use_orig_params=False``: a
flat parameter's positive-dimension state is its originals' states
concatenated in flat order (zeros for an original without state), on the CPU
as torch flattens them, then this rank's shard of it; 0-dim and non-tensor states must be present and equal for
every original (Adam's "step" cannot be made up for one that has none).
``use_orig_params=True``: each original parameter gets the part of its
flattened state that this rank's shard holds, or nothing when it holds no
elements. Sharded values are gathered first, over the group they are chunked
over (so a sharded dict also loads into another wrapping, for parameters that
are outside every unit there too). Parameters outside every unit keep their
state. Finally keys become the local
optimizer's IDs and each saved group's "params" the sorted IDs of its FQNs; a
saved group's hyperparameters are kept.

[Note: Rank-0-only loading]
Only rank 0 has the dict. It broadcasts the dict's skeleton, every
positive-dimension tensor replaced by its shape and dtype, then each of those
tensors in torch's order: the parameters' state in model order (each FQN's values
in its state's order), then any other tensor in skeleton order. Every rank, rank
0 too, keeps the broadcast tensors, on the device (as torch), then flattens its
own part.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import (
    tree_flatten,
    tree_flatten_with_path,
    tree_map_only,
    tree_unflatten,
)

from fsdp import _comm
from fsdp._state_dict.optim_keys import (
    OSD,
    KeySource,
    ModelParams,
    OptimStateKey,
    ParamKey,
    check_same_use_orig_params,
)
from fsdp._state_dict.optim_unit import gathered_state
from fsdp._unshard_params import ensure_initialized


@dataclass(frozen=True)
class _TensorMeta:
    """A positive-dimension tensor in rank 0's skeleton (a pytree leaf)."""

    shape: torch.Size
    dtype: torch.dtype


def _receive_from_rank0(osd: OSD, group: Any, params: ModelParams) -> OSD:
    """Rank 0's ``osd`` on every rank of ``group``, its broadcast tensors on the
    device on every rank (see [Note: Rank-0-only loading])."""
    device = params.device
    is_src = group.rank() == 0
    skeleton = tree_map_only(Tensor, _skeleton_leaf, osd) if is_src else None
    skeleton = _comm.broadcast_object(skeleton, 0, group, device)
    with_paths, spec = tree_flatten_with_path(skeleton)
    received = [leaf for _, leaf in with_paths]
    src_leaves = tree_flatten(osd)[0] if is_src else received
    src = _comm.group_ranks(group)[0]
    for index in _broadcast_order([path for path, _ in with_paths], received, params):
        meta = received[index]
        tensor = (
            src_leaves[index].to(device)
            if is_src
            else torch.empty(meta.shape, dtype=meta.dtype, device=device)
        )
        _comm.broadcast(tensor, src, group)
        received[index] = tensor
    return tree_unflatten(received, spec)


def _broadcast_order(
    paths: list[tuple[Any, ...]], leaves: list[Any], params: ModelParams
) -> list[int]:
    """Indices of the skeleton's tensors in torch's broadcast order: parameters'
    state in model order (each FQN's values in its state's order), then the rest
    in skeleton order."""
    by_fqn: dict[Any, list[int]] = {}
    rest: list[int] = []
    for i, (path, leaf) in enumerate(zip(paths, leaves, strict=True)):
        if not isinstance(leaf, _TensorMeta):
            continue
        keys = [getattr(entry, "key", None) for entry in path]
        if len(keys) == 3 and keys[0] == "state":
            by_fqn.setdefault(keys[1], []).append(i)
        else:
            rest.append(i)
    order = [i for fqns in params.fqns.values() for fqn in fqns for i in by_fqn.pop(fqn, [])]
    return order + sorted(rest + [i for indices in by_fqn.values() for i in indices])


def _skeleton_leaf(tensor: Tensor) -> Any:
    return _TensorMeta(tensor.shape, tensor.dtype) if tensor.dim() > 0 else tensor.cpu()


class _Loader:
    """One conversion of a full or sharded dict into a model's local form, still
    keyed by ``OptimStateKey`` (see [Note: Flattening for loading])."""

    params: ModelParams
    named_optim: torch.optim.Optimizer | None  # for a named optimizer's empty parts

    def __init__(self, params: ModelParams, named_optim: torch.optim.Optimizer | None) -> None:
        self.params = params
        self.named_optim = named_optim

    def state(self, state: dict[Any, Any]) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        used: set[Any] = set()
        for param, fqns in self.params.fqns.items():
            if fqns[0] not in state:
                continue
            used.update(fqns)
            key = self.params.key(param)
            value = self._param_state(param, key, state)
            if value is not None:
                out[key] = value
        out.update({k: copy.copy(v) for k, v in state.items() if k not in used})
        return out

    def _param_state(
        self, param: nn.Parameter, key: OptimStateKey, state: dict[Any, Any]
    ) -> dict[str, Any] | None:
        if not key.managed:  # gathered: it may come from a unit of another wrapping
            return gathered_state(state[key.fqns[0]], self.params.device)
        unit = self.params.unit_of[key.fqns[0]]
        if not self.params.use_orig_params:
            gathered = [unit.gathered(f, state[f]) if f in state else None for f in key.fqns]
            return unit.flatten_state(gathered) or None
        local = unit.part_state(key.fqns[0], state[key.fqns[0]])
        if local:
            return local
        if self.named_optim is not None and param in self.named_optim.state:
            return copy.deepcopy(self.named_optim.state[param])  # keyed optimizers want every entry
        return None


def _rekey_to_optimizer(
    flat: dict[Any, Any], osd: OSD, params: ModelParams, keys: dict[ParamKey, Any]
) -> OSD:
    """``OptimStateKey`` s -> the local optimizer's keys; a saved group's FQNs -> its
    sorted keys. A key of a parameter the optimizer does not hold stays as FQNs."""
    key_of = {param: key for key, param in keys.items()}
    _check_holds_no_more_than_the_model(key_of, params)
    by_fqns: dict[tuple[str, ...], ParamKey] = {}
    by_fqn: dict[str, ParamKey] = {}
    for param, fqns in params.fqns.items():
        if param in key_of:
            by_fqns[fqns] = key_of[param]
            by_fqn.update(dict.fromkeys(fqns, key_of[param]))
    state = {
        (by_fqns.get(k.fqns, k.fqns) if isinstance(k, OptimStateKey) else k): v
        for k, v in flat.items()
    }
    out: OSD = {"state": state}
    if "param_groups" in osd:
        out["param_groups"] = [
            {**copy.deepcopy(g), "params": sorted({by_fqn[n] for n in g["params"]})}
            for g in osd["param_groups"]
        ]
    return out


def _check_holds_no_more_than_the_model(key_of: dict[Any, ParamKey], params: ModelParams) -> None:
    """Torch's check (see [Note: Parameters the optimizer holds and the model does
    not list] in fsdp._state_dict.optim_keys): the optimizer's parameters, counted,
    are at most the model's."""
    if len(key_of) > len(params.fqns):
        raise AssertionError(
            "Expected len(param_to_param_key) <= len(param_to_fqns), "
            f"got {len(key_of)} > {len(params.fqns)}"
        )


@torch.no_grad()
def optim_state_dict_to_load(
    model: nn.Module,
    osd: OSD,
    source: KeySource,
    rank0_only: bool,
    named: bool,
    group: Any,
) -> OSD:
    """The local form of a full or sharded dict for ``model``'s optimizer. Under
    ``rank0_only`` only rank 0's ``osd`` is read."""
    check_same_use_orig_params(model)
    ensure_initialized(model)
    params = ModelParams(model)
    params.require_units()
    group = group or _comm.world()
    if rank0_only:
        osd = _receive_from_rank0(osd if group.rank() == 0 else {}, group, params)
    if "state" not in osd:
        raise ValueError(
            '`optim_state_dict` must have the keys "state" to be a valid optimizer state dict'
        )
    loader = _Loader(params, source.optim if named else None)
    flat = loader.state(osd["state"])
    return _rekey_to_optimizer(flat, osd, params, source.keys(params, model, named))
