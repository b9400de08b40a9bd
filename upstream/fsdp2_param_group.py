"""``torch.distributed.fsdp._fully_shard._fsdp_param_group`` for this harness: the
names upstream's FSDP2 tests read off it, on the implementation under test.

Upstream's tests keep the original of a part they patch (``orig_backward =
RegisterPostBackwardFunction.backward``, ``orig_unshard = FSDPParamGroup.unshard``)
and call it from their replacement. Here ``FSDPParamGroup`` and
``RegisterPostBackwardFunction`` answer those attributes with what the
implementation's FSDP2 seam of that name holds when read ([Note: FSDP2 seams] in
``fsdptest.fsdp2``): torch's class attributes under ``--fsdp-impl torch``, the
declared parts of another implementation otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fsdptest.api import FSDP2_SEAMS


class SeamHolder:
    """Attributes named as upstream reads them, each the implementation's seam."""

    name: str
    seams: dict[str, str]

    def __init__(self, name: str, seams: dict[str, str]) -> None:
        self.name = name
        self.seams = seams

    def __getattr__(self, attr: str) -> Callable[..., Any]:
        if attr.startswith("__") or attr not in self.seams:
            raise AttributeError(f"{self.name} has no {attr!r} here; it has {sorted(self.seams)}")
        return FSDP2_SEAMS.original(self.seams[attr])

    def __repr__(self) -> str:
        return f"<{self.name} of the FSDP under test>"


FSDPParamGroup = SeamHolder(
    "FSDPParamGroup", {"unshard": "unshard", "reshard": "reshard", "post_backward": "post_backward"}
)
RegisterPostBackwardFunction = SeamHolder(
    "RegisterPostBackwardFunction", {"backward": "register_post_backward_hook_backward"}
)

__all__ = ["FSDPParamGroup", "RegisterPostBackwardFunction", "SeamHolder"]
