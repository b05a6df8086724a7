"""timm's BatchNorm + activation layers, exact under accumulation: `BatchNormAct2d`.

timm builds many models (EfficientNet, MobileNet, RegNet, ByobNet...) from `BatchNormAct2d`, a
subclass of torch's BatchNorm2d that also holds the activation (`act`) and an optional drop path
(`drop`) applied after the norm. `accumnorm.convert` turns timm's BatchNormAct2d and SyncBatchNormAct
into this layer, keeping the very same act and drop modules, parameters and buffers, and `revert`
turns it back into timm's BatchNormAct2d. It is both an accumnorm BatchNorm2d and a timm
BatchNormAct2d, so timm's own helpers (`freeze_batch_norm_2d`, `convert_sync_batchnorm`) still find it.

Importing this module imports timm (`pip install 'accumnorm[timm]'`); `accumnorm.convert` uses it
only where timm is already imported.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

try:
    from timm.layers import norm_act as _timm
except ImportError as err:  # pragma: no cover - the message is the point
    raise ImportError("accumnorm.integrations.timm needs timm: pip install 'accumnorm[timm]'") from err

from ..layers._batchnorm import BatchNorm2d
from ..layers._lazy import check_num_features, norm_forward

__all__ = ["BatchNormAct2d"]


class BatchNormAct2d(BatchNorm2d, _timm.BatchNormAct2d):
    """timm's BatchNormAct2d (BatchNorm2d, then `drop`, then `act`) that is exact under `accumnorm.backward`.

    Args: those of timm's BatchNormAct2d: num_features, eps, momentum, affine, track_running_stats,
        apply_act, act_layer, act_kwargs, inplace, drop_layer, device, dtype. NOTE: not lazy (timm
        always gives the channel count) and without `bias=` (timm's layer has none).

    Shape:
        Input: (N, C, H, W). Output: the same shape.

    Examples:
        >>> model = accumnorm.convert(timm.create_model("efficientnet_b0"))   # its BatchNormAct2d become these
        >>> BatchNormAct2d(16, act_layer=nn.SiLU)(torch.randn(4, 16, 8, 8)).shape
        torch.Size([4, 16, 8, 8])
    """

    _norm_forward = norm_forward(_timm.BatchNormAct2d.forward)

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        apply_act: bool = True,
        act_layer: Any = nn.ReLU,
        act_kwargs: dict[str, Any] | None = None,
        inplace: bool = True,
        drop_layer: type[nn.Module] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if num_features is None:
            raise TypeError("BatchNormAct2d is not lazy: num_features must be a positive int, got None")
        check_num_features(num_features)
        # timm's own constructor, called directly: its arguments are not those of accumnorm's lazy constructor,
        # which is skipped (this layer is never lazy). It builds act and drop, then torch's BatchNorm2d.
        _timm.BatchNormAct2d.__init__(
            self, num_features, eps, momentum, affine, track_running_stats, apply_act, act_layer, act_kwargs,
            inplace, drop_layer, device, dtype,
        )


# What accumnorm.convert / revert swap (the same tensors and child modules, act and drop, carried over).
_TO_ACCUM: dict[type, type] = {_timm.BatchNormAct2d: BatchNormAct2d, _timm.SyncBatchNormAct: BatchNormAct2d}
_TO_TIMM: dict[type, type] = {BatchNormAct2d: _timm.BatchNormAct2d}
