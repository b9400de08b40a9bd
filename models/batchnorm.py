"""A module holding one of each batch-norm kind, for policies that wrap them apart."""

from __future__ import annotations

from torch import nn


class BatchNormNet(nn.Module):
    """A bias-free ``Linear(10, 10)`` beside ``BatchNorm1d``, ``BatchNorm2d``,
    ``BatchNorm3d`` and ``SyncBatchNorm``, all over 10 features.

    It has no forward: the wrapping tests only inspect which modules became FSDP
    units, and the three dimensionalities could not share one input anyway.
    """

    lin: nn.Linear
    bn1: nn.BatchNorm1d
    bn2: nn.BatchNorm2d
    bn3: nn.BatchNorm3d
    sync_bn: nn.SyncBatchNorm

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(10, 10, bias=False)
        self.bn1 = nn.BatchNorm1d(10)
        self.bn2 = nn.BatchNorm2d(10)
        self.bn3 = nn.BatchNorm3d(10)
        self.sync_bn = nn.SyncBatchNorm(10)
