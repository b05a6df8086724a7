"""BatchNorm that is exact under gradient accumulation: BatchNorm, BatchNorm1d, BatchNorm2d, BatchNorm3d.

Each class subclasses torch's layer of the same name (and so `_BatchNorm`): code that finds BN layers
by type still finds them, and state_dicts interchange with torch's. Outside `accumnorm.backward` they
*are* torch's BatchNorm, call for call. Inside `accumnorm.backward(..., bn="exact")` the accumulation
engine attaches a plan to every layer for the duration of the call, and each training-mode call
normalizes with, and back-propagates through, the statistics of the whole batch
(see `accumnorm.accumulation`).

`num_features` comes first and may be None: the layer then infers it from its first input.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from .lazy import LazyNormMixin, check_num_features

__all__ = ["BatchNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d"]


class _AccumBatchNorm(LazyNormMixin, _BatchNorm):
    """Shared body of accumnorm's BatchNorm layers (torch's `_BatchNorm` plus laziness and the plan hook)."""

    def __init__(
        self,
        num_features: int | None = None,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        num_features = check_num_features(num_features)
        lazy = num_features is None
        factory_kwargs = {"device": device, "dtype": dtype}
        # A lazy layer is built without tensors, which are then declared uninitialized (as torch's _LazyNormBase).
        super().__init__(
            0 if lazy else num_features, eps, momentum, affine and not lazy, track_running_stats and not lazy,
            **factory_kwargs,
        )
        self.affine, self.track_running_stats = affine, track_running_stats
        self._init_lazy(
            lazy,
            params=("weight", "bias") if lazy and affine else (),
            buffers=("running_mean", "running_var") if lazy and track_running_stats else (),
            factory_kwargs=factory_kwargs,
        )
        if lazy and track_running_stats:
            self.num_batches_tracked = torch.tensor(0, dtype=torch.long, device=device)
        # Set by accumnorm.backward(bn="exact") for the duration of one call, None otherwise.
        self._accum_plan = None

    def uses_batch_stats(self) -> bool:
        """True where torch's BatchNorm normalizes with batch statistics (training, or no running stats)."""
        return self.training or (self.running_mean is None and self.running_var is None)

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        self._check_channels(input)
        plan = self._accum_plan
        if plan is not None and self.uses_batch_stats():
            return plan.batch_norm(self, input)
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
