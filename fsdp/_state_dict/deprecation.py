"""The warnings of the deprecated optimizer-state-dict APIs (torch's texts)."""

from __future__ import annotations

import warnings

from fsdp._state_dict.optim_keys import OptimInput


def warn_optim_input(optim_input: OptimInput) -> None:
    if optim_input is not None:
        warnings.warn(
            "The `optim_input` argument is deprecated and will be removed after PyTorch 1.13. "
            "You may remove it from your code without changing its functionality.",
            FutureWarning,
            stacklevel=3,
        )


def warn_legacy(current: str, replacement: str) -> None:
    warnings.warn(
        f"``FullyShardedDataParallel.{current}``is being deprecated and is replaced by "
        f"``FullyShardedDataParallel.{replacement}``. ``FullyShardedDataParallel.{current}`` "
        "may be removed after PyTorch 2.2.",
        FutureWarning,
        stacklevel=3,
    )
