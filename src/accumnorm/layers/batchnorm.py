"""BatchNorm that is exact under gradient accumulation: BatchNorm, BatchNorm1d, BatchNorm2d, BatchNorm3d.

Each class subclasses torch's layer of the same name (and so `_BatchNorm`): code that finds BN layers
by type still finds them, and state_dicts interchange with torch's. They *are* torch's BatchNorm, call
for call: `accumnorm.backward(..., bn="exact")` makes every batch-norm call exact, these layers' and
torch's own alike (see `accumnorm.intercept`). What they add is the safe constructor: channels first.

`num_features` comes first and may be None: the layer then infers it from its first input.
"""
from __future__ import annotations

import torch.nn as nn
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from .lazy import LazyNormBase

__all__ = ["BatchNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d"]


class _AccumBatchNorm(LazyNormBase, _BatchNorm):
    """Shared body of accumnorm's BatchNorm layers: torch's `_BatchNorm` plus laziness and a channel check."""

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        self._check_channels(input)
        return super().forward(input)


class BatchNorm(_AccumBatchNorm):
    """BatchNorm over dim 1 of any input with at least 2 dims (N, C, *), like torch's SyncBatchNorm.

    `accumnorm.convert` turns SyncBatchNorm into this layer: under `accumnorm.backward` it reduces its
    statistics across micro-batches and, given a process group, across ranks.
    """

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")


class BatchNorm1d(_AccumBatchNorm, nn.BatchNorm1d):
    """BatchNorm over (N, C) or (N, C, L) inputs; exact under `accumnorm.backward`."""


class BatchNorm2d(_AccumBatchNorm, nn.BatchNorm2d):
    """BatchNorm over (N, C, H, W) inputs; exact under `accumnorm.backward`."""


class BatchNorm3d(_AccumBatchNorm, nn.BatchNorm3d):
    """BatchNorm over (N, C, D, H, W) inputs; exact under `accumnorm.backward`."""
