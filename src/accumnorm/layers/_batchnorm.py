"""BatchNorm that is exact under gradient accumulation: BatchNorm, BatchNorm1d, BatchNorm2d, BatchNorm3d.

Each class subclasses torch's layer of the same name (and so `_BatchNorm`): code that finds BN layers
by type still finds them, and state_dicts interchange with torch's. They *are* torch's BatchNorm, call
for call: `accumnorm.backward(..., bn="exact")` makes every batch-norm call exact, these layers' and
torch's own alike (see `accumnorm._engine.intercept.calls`). What they add is the safe constructor: channels first.

`num_features` comes first and may be None: the layer then infers it from its first input.
"""
from __future__ import annotations

import torch.nn as nn
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from ._lazy import LazyNormBase, norm_forward

__all__ = ["BatchNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d"]

_ARGS = """
    Args:
        num_features: C, the channel count (dim 1 of the input); None (the default) makes the layer
            lazy: C comes from its first input. NOTE: first, unlike `nn.LazyBatchNorm2d`'s `eps`.
        eps, momentum, affine, track_running_stats, device, dtype, bias: as in torch's BatchNorm.
"""


class _AccumBatchNorm(LazyNormBase, _BatchNorm):
    """Shared body of accumnorm's BatchNorm layers: torch's `_BatchNorm` plus laziness and a channel check."""

    _norm_forward = norm_forward(_BatchNorm.forward)


class BatchNorm(_AccumBatchNorm):
    __doc__ = f"""BatchNorm over dim 1 of any input with at least 2 dims (N, C, *), like torch's SyncBatchNorm.

    `accumnorm.convert` turns SyncBatchNorm into this layer (and `revert` back): under
    `accumnorm.backward` it reduces its statistics across micro-batches and, given a process group,
    across ranks. NOTE: it takes no `process_group`: `accumnorm.backward(process_group=...)` does.
{_ARGS}
    Shape:
        Input: (N, C, *). Output: the same shape.

    Examples:
        >>> bn = accumnorm.BatchNorm(16)
        >>> bn(torch.randn(8, 16, 10)).shape
        torch.Size([8, 16, 10])
    """

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")


class BatchNorm1d(_AccumBatchNorm, nn.BatchNorm1d):
    __doc__ = f"""torch's BatchNorm1d over (N, C) or (N, C, L) inputs, channels first and lazy when C is None;
    exact under `accumnorm.backward`.
{_ARGS}
    Shape:
        Input: (N, C) or (N, C, L). Output: the same shape.

    Examples:
        >>> accumnorm.BatchNorm1d(32)(torch.randn(8, 32)).shape
        torch.Size([8, 32])
    """


class BatchNorm2d(_AccumBatchNorm, nn.BatchNorm2d):
    __doc__ = f"""torch's BatchNorm2d over (N, C, H, W) inputs, channels first and lazy when C is None;
    exact under `accumnorm.backward`. A drop-in `norm_layer=` for torchvision's and timm's ResNets.
{_ARGS}
    Shape:
        Input: (N, C, H, W). Output: the same shape.

    Examples:
        >>> model = torchvision.models.resnet18(norm_layer=accumnorm.BatchNorm2d)
        >>> accumnorm.BatchNorm2d()(torch.randn(8, 32, 5, 5)).shape  # lazy: C = 32 from the input
        torch.Size([8, 32, 5, 5])
    """


class BatchNorm3d(_AccumBatchNorm, nn.BatchNorm3d):
    __doc__ = f"""torch's BatchNorm3d over (N, C, D, H, W) inputs, channels first and lazy when C is None;
    exact under `accumnorm.backward`.
{_ARGS}
    Shape:
        Input: (N, C, D, H, W). Output: the same shape.

    Examples:
        >>> accumnorm.BatchNorm3d(4)(torch.randn(2, 4, 3, 3, 3)).shape
        torch.Size([2, 4, 3, 3, 3])
    """
