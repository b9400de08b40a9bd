"""ResNet-50 from torchvision, imported only when asked for.

torchvision fails to import against some torch builds (the CPU build here, with
a RuntimeError rather than an ImportError), so importing ``models`` must not
import it: callers mark their tests ``requires_module("torchvision")``.
"""

from __future__ import annotations

from torch import nn


def resnet50() -> nn.Module:
    """A freshly initialised ``torchvision.models.resnet50()``."""
    import torchvision  # lazily: see the module docstring

    return torchvision.models.resnet50()
