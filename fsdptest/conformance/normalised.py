"""Observations that may differ between the FSDP under test and the reference:
each a named, reasoned rewrite applied to both traces before they are compared
(see [Note: Nothing is silently skipped] in ``fsdptest.conformance.allowed``,
which lists what the reference is not asked)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from fsdptest.conformance.observe import EXACT, TensorView, first_difference
from fsdptest.implementations import BUILTIN_MODULES

TORCH = BUILTIN_MODULES["torch"]
OURS = BUILTIN_MODULES["local"]


# -- observations that may differ ----------------------------------------------------------------

Rewrite = Callable[[str, str, Any], tuple[str, Any]]
"""(op, key, value) -> (key, value): ``op`` is the op's text ("construct" for the
construction), ``key`` and ``value`` one observation of it."""


@dataclasses.dataclass(frozen=True)
class Normalised:
    """A rewrite of observations (key, value) -> (key, value), applied to the
    traces of the implementations it is for (see [Note: Nothing is silently
    skipped])."""

    name: str
    reason: str
    rewrite: Rewrite
    references: tuple[str, ...] = (TORCH,)
    impls: tuple[str, ...] = ()  # empty: any implementation under test
    pending: bool = False  # a divergence of ours, reported for fixing

    def applies(self, impl: str, reference: str) -> bool:
        return reference in self.references and (not self.impls or impl in self.impls)


def _unreadable_attribute(op: str, key: str, value: Any) -> tuple[str, Any]:
    if key.startswith("attribute ") and isinstance(value, TensorView) and value.kind == "Tensor":
        if value.values is not None or value.dtype is not None or value.device:
            return key, value._replace(values=None, dtype=None, device="")
    return key, value


_TORCH_INTERNAL_WARNINGS = (
    "`_get_pg_default_device` will be deprecated",
    "Multiple backends are registered with this ProcessGroup.",
    "Please use DTensor instead and we are deprecating ShardedTensor.",
    "The AccumulateGrad node's stream does not match the stream of the node that produced",
)


def _torch_internal_warnings(op: str, key: str, value: Any) -> tuple[str, Any]:
    if key != "warnings":
        return key, value
    kept = tuple(w for w in value if not w[1].startswith(_TORCH_INTERNAL_WARNINGS))
    return key, (value if len(kept) == len(value) else kept)


_TORCH_TYPOS = {
    "full_state_dict willbe returned.": "full_state_dict will be returned.",
    "may result in theunsharded parameters": "may result in the unsharded parameters",
}


def _warning_typo(op: str, key: str, value: Any) -> tuple[str, Any]:
    if key != "warnings" or not any(t in w[1] for w in value for t in _TORCH_TYPOS):
        return key, value
    fixed = []
    for category, text, *where in value:
        for typo, right in _TORCH_TYPOS.items():
            text = text.replace(typo, right)
        fixed.append((category, text, *where))
    return key, tuple(fixed)


_OPTIMIZER_KEYS = ("to load", "optimizer state dict", "optimizer state", "rekeyed")


def _optimizer_state_order(op: str, key: str, value: Any) -> tuple[str, Any]:
    """Each parameter's state entries (exp_avg, exp_avg_sq, step) sorted by name."""
    if key not in _OPTIMIZER_KEYS:
        return key, value
    fixed = [_sorted_param_states(v) for v in value]
    return key, fixed if _differs_in_order(fixed, value) else value


def _sorted_param_states(observed: Any) -> Any:
    if not (isinstance(observed, tuple) and len(observed) == 2 and observed[0] == "dict"):
        return observed
    items = []
    for name, entry in observed[1]:
        if name == "state" and isinstance(entry, tuple) and entry and entry[0] == "dict":
            entry = ("dict", tuple((p, _sorted_dict(s)) for p, s in entry[1]))
        items.append((name, entry))
    return ("dict", tuple(items))


def _sorted_dict(observed: Any) -> Any:
    if isinstance(observed, tuple) and len(observed) == 2 and observed[0] == "dict":
        return ("dict", tuple(sorted(observed[1], key=lambda item: repr(item[0]))))
    return observed


def _differs_in_order(a: Any, b: Any) -> bool:
    return [repr(type(x)) for x in a] != [repr(type(x)) for x in b] or _differs(a, b)


_TORCH_PADDING_VALUE = 42.0  # torch's _FLAT_PARAM_PADDING_VALUE


def _padding_values(op: str, key: str, value: Any) -> tuple[str, Any]:
    """In a saved ``_flat_param``'s local shards, torch's padding value made zero."""
    if key not in ("state dict", "full state dict"):
        return key, value

    def zeroed(view: TensorView) -> TensorView:
        values = view.values
        if not isinstance(values, torch.Tensor) or not values.is_floating_point():
            return view
        padding = values == _TORCH_PADDING_VALUE
        return view._replace(values=values.masked_fill(padding, 0.0)) if padding.any() else view

    def fix(item: Any) -> Any:
        name, tensor = item
        if (
            isinstance(name, str)
            and name.endswith("_flat_param")
            and isinstance(tensor, TensorView)
        ):
            local = tuple((*shard[:3], zeroed(shard[3])) for shard in tensor.local)
            return (name, tensor._replace(local=local))
        return item

    fixed = [(kind, tuple(fix(i) for i in items)) for kind, items in value]
    return key, fixed if _differs(fixed, value) else value


def _differs(a: Any, b: Any) -> bool:
    return first_difference(a, b, EXACT) is not None


_DEPRECATIONS = ("FSDP.state_dict_type() and FSDP.set_state_dict_type() are being deprecated.",)


def _deprecation_warnings(op: str, key: str, value: Any) -> tuple[str, Any]:
    if key != "warnings":
        return key, value
    kept = tuple(
        w for w in value if not (w[0] == "FutureWarning" and w[1].startswith(_DEPRECATIONS))
    )
    return key, (value if len(kept) == len(value) else kept)


def _optim_collectives(op: str, key: str, value: Any) -> tuple[str, Any]:
    """In optimizer-state saves and loads: ours' object exchanges (broadcast or all-gather of an
    int64 size, then uint8 bytes) and torch's one-element int32 all-reduce are dropped."""
    if key != "collectives" or not op.startswith(("save optimizer state", "load optimizer state")):
        return key, value
    calls, kept, i = list(value), [], 0
    while i < len(calls):
        call = calls[i]
        following = calls[i + 1] if i + 1 < len(calls) else None
        if (
            following is not None
            and call.kind == following.kind
            and call.dtype == "torch.int64"
            and following.dtype == "torch.uint8"
        ):
            i += 2
            continue
        if not (
            call.kind == "ALL_REDUCE" and call.dtype == "torch.int32" and call.input_numel == 1
        ):
            kept.append(call)
        i += 1
    return key, (value if len(kept) == len(calls) else tuple(kept))


def _one_agreement(op: str, key: str, value: Any) -> tuple[str, Any]:
    """A scaler's found-inf agreement of several one-element float32 all-reduces
    over one group as the first of them."""
    if key != "found-inf agreement" or len(value) < 2:
        return key, value
    if len(set(value)) == 1 and value[0].kind == "ALL_REDUCE" and value[0].input_numel == 1:
        return key, value[:1]
    return key, value


def _overflowed_gradient(op: str, key: str, value: Any) -> tuple[str, Any]:
    """A gradient holding inf or nan: its finite values as zeros (where it is not
    finite and with what sign are kept)."""
    if not key.endswith(" .grad") or not isinstance(value, TensorView):
        return key, value
    values = value.values
    if not isinstance(values, torch.Tensor) or not values.is_floating_point():
        return key, value
    finite = torch.isfinite(values)
    if bool(finite.all()):
        return key, value
    return key, value._replace(values=torch.where(finite, torch.zeros_like(values), values))


def _flat_param_requires_grad(op: str, key: str, value: Any) -> tuple[str, Any]:
    """A saved ``_flat_param`` (LOCAL_STATE_DICT) without its requires_grad."""
    if key not in ("state dict", "full state dict"):
        return key, value

    def fix(item: Any) -> Any:
        name, tensor = item
        if (
            isinstance(name, str)
            and name.endswith("_flat_param")
            and isinstance(tensor, TensorView)
        ):
            local = tuple(
                (*shard[:3], shard[3]._replace(requires_grad=None)) for shard in tensor.local
            )
            return (name, tensor._replace(requires_grad=None, local=local))
        return item

    fixed = [(kind, tuple(fix(i) for i in items)) for kind, items in value]
    return key, fixed if _differs(fixed, value) else value


def _local_shard_placements(op: str, key: str, value: Any) -> tuple[str, Any]:
    """A ShardedTensor's local shards placed as its global metadata places the
    shard of the same offsets."""
    if key not in ("state dict", "full state dict", "optimizer state dict", "to load"):
        return key, value
    return key, _map_views(value, _placed_as_layout)


def _placed_as_layout(view: TensorView) -> TensorView:
    if view.kind != "ShardedTensor":
        return view
    placements = {repr(entry[0]): entry[2] for entry in view.layout if len(entry) == 3}
    local = tuple(
        (*shard[:2], placements.get(repr(shard[0]), shard[2]), *shard[3:]) for shard in view.local
    )
    return view._replace(local=local) if local != view.local else view


def _map_views(value: Any, fix: Callable[[TensorView], TensorView]) -> Any:
    """``value`` with ``fix`` applied to every TensorView inside (``value`` itself
    where nothing changed)."""
    if isinstance(value, TensorView):
        return fix(value)
    if isinstance(value, list) or (isinstance(value, tuple) and not hasattr(value, "_fields")):
        items = [_map_views(item, fix) for item in value]
        if all(new is old for new, old in zip(items, value)):
            return value
        return items if isinstance(value, list) else tuple(items)
    return value


NORMALISED: dict[str, Normalised] = {
    entry.name: entry
    for entry in (
        Normalised(
            "FLAT_VIEW_ATTRIBUTES_HAVE_NO_CONTRACT",
            "with use_orig_params=False an original parameter's attribute on its module "
            "(model.layer.weight, a plain tensor, not a Parameter) is defined only inside "
            "forward, backward and summons; outside, torch leaves a view of whichever unsharded "
            "copy it used last (freed storage, low precision after a mixed-precision forward; "
            "reading it reads freed memory), this project's FSDP a full-precision placeholder "
            "that raises when read, or a view that still holds data. With parameters offloaded "
            "(accelerator ranks) torch's stays a view of the flat parameter on the device it "
            "was built on, ours is on the CPU, where the parameter is. Their values, dtype and "
            "device are not compared; kind, shape and requires_grad are",
            _unreadable_attribute,
            references=(TORCH, OURS),
        ),
        Normalised(
            "TORCH_INTERNAL_WARNINGS",
            "warnings torch's own modules raise inside an FSDP call, about torch's internals: "
            "its object collectives calling the deprecated `_get_pg_default_device` ('... will "
            "be deprecated', 'Multiple backends are registered with this ProcessGroup ...'), "
            "and ShardedTensor's constructor warning 'Please use DTensor instead ...' for every "
            "ShardedTensor built, intermediate ones included; on accelerators autograd's "
            "'The AccumulateGrad node's stream does not match ...' (a performance hint "
            "about an AccumulateGrad node kept alive across iterations, which torch's FSDP "
            "holds); how many an implementation "
            "triggers says how it is built, not what it does (the kinds of the returned values "
            "are compared). Removed from both traces",
            _torch_internal_warnings,
            references=(TORCH, OURS),
        ),
        Normalised(
            "TORCH_WARNING_TYPOS",
            "two of torch's warnings miss a space where strings are joined: its NO_SHARD load "
            "hooks' 'full_state_dict willbe returned.' (its save hooks have the space) and "
            "summon_full_params(offload_to_cpu=True, rank0_only=False)'s 'may result in "
            "theunsharded parameters'; this project's FSDP warns the same texts with the space",
            _warning_typo,
            references=(TORCH, OURS),
        ),
        Normalised(
            "OPTIMIZER_STATE_ENTRY_ORDER",
            "the order of one parameter's optimizer state entries (exp_avg, exp_avg_sq, step) "
            "in optimizer state dicts: torch's conversions build them in another order than "
            "the optimizer; Optimizer.load_state_dict reads them by name. Sorted by name in "
            "both traces (the order of parameters and of state dict keys is compared)",
            _optimizer_state_order,
            references=(TORCH, OURS),
        ),
        Normalised(
            "FLAT_PARAM_PADDING_VALUE",
            "with use_orig_params=True a flat parameter pads between original parameters for "
            "alignment; torch fills that padding with 42.0 (its _FLAT_PARAM_PADDING_VALUE, to "
            "make it visible), this project's FSDP with zeros (a zeroed padding is one of the "
            "properties the suites check, BUGS.md class 5); a LOCAL_STATE_DICT's _flat_param "
            "shows it. Elements equal to 42.0 in a saved _flat_param are compared as 0",
            _padding_values,
            references=(TORCH, OURS),
        ),
        Normalised(
            "STATE_DICT_TYPE_DEPRECATION",
            "torch warns a FutureWarning 'FSDP.state_dict_type() and FSDP.set_state_dict_type() "
            "are being deprecated. Please use APIs, get_state_dict() and set_state_dict(), ...' "
            "on every set_state_dict_type (twice per state_dict_type context); this project's "
            "FSDP does not: the replacement it names, torch.distributed.checkpoint.state_dict, "
            "does not know this project's units ([Note: Deprecation notices] in fsdp/_init.py). "
            "That FutureWarning is removed from both traces",
            _deprecation_warnings,
            impls=(OURS,),
        ),
        Normalised(
            "OPTIM_STATE_DICT_OBJECT_EXCHANGES",
            "saving and loading optimizer state: both implementations exchange pickled key "
            "lists, torch through torch.distributed's object collectives (not seen by the "
            "recorder) plus a one-element int32 all-reduce, this project's FSDP through "
            "fsdp._comm (an int64 size, then uint8 bytes, broadcast or all-gathered); those are "
            "removed from both traces, the tensor collectives are compared",
            _optim_collectives,
            impls=(OURS,),
        ),
        Normalised(
            "SHARDED_TENSOR_LOCAL_SHARD_RANK",
            "the placement of a ShardedTensor's local shard (state dicts and optimizer state "
            "dicts of hybrid units with process groups): torch's FSDP names the shard group's "
            "rank there ('rank:0/cpu' on global rank 2), while the ShardedTensor's global "
            "metadata, in torch's and in this project's, names the global rank, which is "
            "ShardedTensor's convention (it matches local shards against dist.get_rank(), the "
            "global rank); this project's FSDP names the global rank in both. A local shard's "
            "placement is compared as the global metadata's placement of its offsets (the "
            "global metadata, offsets and values are compared)",
            _local_shard_placements,
            impls=(OURS,),
        ),
        Normalised(
            "OVERFLOWED_GRADIENT_VALUES",
            "a gradient holding inf or nan (a scaled low-precision backward that overflowed: "
            "the scaler skips the step and backs off): its finite elements are sums whose "
            "addends were near the dtype's largest value, so the order in which an "
            "implementation reduces them decides them far beyond the low-precision tolerance "
            "(the seventeenth deep run: a row of an fp16 NO_SHARD gradient at world size 3 "
            "beside inf and nan rows). Where it is not finite, and with which sign, is "
            "compared; its finite values are not (the parameters, which the skipped step "
            "leaves alone, are)",
            _overflowed_gradient,
            references=(TORCH, OURS),
        ),
        Normalised(
            "SCALER_FOUND_INF_AGREEMENT",
            "ShardedGradScaler.unscale_ (also inside step()): torch's all-reduces one found-inf "
            "flag per device the gradients are on (two where parameters are offloaded to the "
            "CPU and an ignored module's stay on the accelerator), so ranks whose gradients "
            "are on different devices (a rank with no shard of the offloaded parameters) issue "
            "different numbers of collectives; this project's sums the flags and all-reduces "
            "once on every rank ([Note: Agreeing on inf/nan] in fsdp/sharded_grad_scaler.py). "
            "Several identical one-element all-reduces of the agreement are compared as one "
            "(their kind, dtype, size and group are compared)",
            _one_agreement,
            impls=(OURS,),
        ),
        Normalised(
            "LOCAL_FLAT_PARAM_REQUIRES_GRAD",
            "the _flat_param ShardedTensor of a LOCAL_STATE_DICT (and its local shard) requires "
            "grad in torch's (a view of the flat parameter) and not in this project's FSDP, "
            "deliberately ([Note: The three state-dict types] in fsdp/_state_dict/kinds.py: torch's "
            "view, made under no_grad, is refused by a gloo gather in grad mode); its "
            "requires_grad is not compared",
            _flat_param_requires_grad,
            impls=(OURS,),
        ),
    )
}
