"""Per-sample norms with a built-in nonlinearity, as lazy channels-first layers (see _alternatives.py's doc).

- `FilterResponseNorm2d` (Singh & Krishnan 2020, FRN with TLU), as timm's FilterResponseNormTlu2d;
- `EvoNorm2dS0` (Liu et al. 2020), as timm's EvoNorm2dS0.

Neither uses batch statistics, so each is the same under any accumulation.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._alternatives import ChannelNorm, affine
from ._lazy import check_num_features

__all__ = ["FilterResponseNorm2d", "EvoNorm2dS0"]


class FilterResponseNorm2d(ChannelNorm):
    """Filter Response Normalization with a Thresholded Linear Unit (Singh & Krishnan 2020), as timm's FRN+TLU.

    y = max(weight * x / sqrt(mean(x^2 over H, W) + eps) + bias, tau): each sample and channel on
    its own, so it is the same under any accumulation. It includes its nonlinearity (TLU).

    Args:
        num_features: channels C, or None to infer them from the first input.
        eps: added to the mean square.

    Shape:
        Input (N, C, H, W), output the same.

    Examples:
        >>> m = FilterResponseNorm2d(32)
        >>> y = m(torch.randn(4, 32, 8, 8))
    """

    def __init__(self, num_features: int | None = None, eps: float = 1e-5, device: Any = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(num_features, {"weight": 1.0, "bias": 0.0, "tau": 0.0}, {}, device, dtype)
        self.eps = eps

    def _norm(self, x: Tensor) -> Tensor:
        x = x * x.square().mean((2, 3), keepdim=True).add(self.eps).rsqrt()
        return torch.maximum(affine(x, self.weight, self.bias), self.tau.view(1, -1, 1, 1))


class EvoNorm2dS0(ChannelNorm):
    """EvoNorm-S0 (Liu et al. 2020), as timm's EvoNorm2dS0: y = x * sigmoid(v * x) / group_std(x) * weight + bias.

    The standard deviation is per sample over groups of channels (as GroupNorm's), so it is the
    same under any accumulation. It includes its nonlinearity (the sigmoid gate).

    Args:
        num_features: channels C, or None to infer them from the first input (divisible by num_groups).
        num_groups: channel groups of the standard deviation.
        eps: added to the variance.

    Shape:
        Input (N, C, H, W), output the same.

    Examples:
        >>> m = EvoNorm2dS0(64, num_groups=32)
        >>> y = m(torch.randn(4, 64, 8, 8))
    """

    def __init__(self, num_features: int | None = None, num_groups: int = 32, eps: float = 1e-5, device: Any = None,
                 dtype: torch.dtype | None = None) -> None:
        check_num_features(num_groups, "num_groups")
        if num_features is not None and isinstance(num_features, int) and num_features % num_groups:
            raise ValueError(f"EvoNorm2dS0 with {num_groups} groups needs channels divisible by it, got {num_features}")
        super().__init__(num_features, {"weight": 1.0, "bias": 0.0, "v": 1.0}, {}, device, dtype)
        self.num_groups, self.eps = num_groups, eps

    def initialize_parameters(self, input: Tensor) -> None:  # type: ignore[override]
        if input.dim() == 4 and input.shape[1] % self.num_groups:
            raise ValueError(f"EvoNorm2dS0 with {self.num_groups} groups needs channels divisible by it, "
                             f"got {input.shape[1]}")
        super().initialize_parameters(input)

    def _norm(self, x: Tensor) -> Tensor:
        n, c, h, w = x.shape
        shape = (n, self.num_groups, c // self.num_groups * h * w)  # reshape: a channels_last input is no view
        std = x.reshape(shape).var(dim=2, correction=0, keepdim=True).add(self.eps).sqrt()
        gated = x * torch.sigmoid(x * self.v.view(1, -1, 1, 1))
        return affine((gated.reshape(shape) / std).reshape(n, c, h, w), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.num_features}, num_groups={self.num_groups}, eps={self.eps}"
