"""Per-sample norms with lazy shape inference: GroupNorm, InstanceNorm1d/2d/3d, LayerNorm (channels first).

These need nothing special under gradient accumulation (each sample is normalized on its own), but
they share BatchNorm's constructor shape, channels first and None for lazy, so that every norm swaps
behind `accumnorm.norm(name, num_features)`. Apart from that they are torch's layers.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .lazy import LazyNormBase, LazyNormMixin, check_num_features

__all__ = ["GroupNorm", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "LayerNorm"]


def _check_at_least_2d(input: Tensor) -> None:
    if input.dim() < 2:
        raise ValueError(f"expected input of shape (N, C, *) with at least 2 dims, got {input.dim()}D input")


class GroupNorm(LazyNormMixin, nn.GroupNorm):
    """torch's GroupNorm with channels first, as timm's: `GroupNorm(num_channels=None, num_groups=32)`."""

    _features_attr = "num_channels"

    def __init__(
        self,
        num_channels: int | None = None,
        num_groups: int = 32,
        eps: float = 1e-5,
        affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        num_channels = check_num_features(num_channels, "num_channels")
        check_num_features(num_groups, "num_groups")
        lazy = num_channels is None
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__(num_groups, num_groups if lazy else num_channels, eps, affine and not lazy, **factory_kwargs)
        self.affine = affine
        self._init_lazy(lazy, ("weight", "bias") if lazy and affine else (), (), factory_kwargs)

    _check_input_dim = staticmethod(_check_at_least_2d)

    def initialize_parameters(self, input: Tensor) -> None:  # type: ignore[override]
        if input.dim() >= 2 and input.shape[1] % self.num_groups:
            raise ValueError(f"GroupNorm with {self.num_groups} groups needs channels divisible by it, got {input.shape[1]}")
        super().initialize_parameters(input)

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        self._check_channels(input)
        return super().forward(input)

    def extra_repr(self) -> str:
        return f"{self.num_channels}, num_groups={self.num_groups}, eps={self.eps}, affine={self.affine}"


class _LazyInstanceNorm(LazyNormBase):
    """torch's InstanceNorm, lazy when num_features is None (torch checks channels itself)."""

    def __init__(
        self,
        num_features: int | None = None,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = False,
        track_running_stats: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)

    def _feature_dim(self, input: Tensor) -> int:
        return input.dim() - self._get_no_batch_dim()  # unbatched inputs have no dim 0


class InstanceNorm1d(_LazyInstanceNorm, nn.InstanceNorm1d):
    """torch's InstanceNorm1d, lazy when num_features is None."""


class InstanceNorm2d(_LazyInstanceNorm, nn.InstanceNorm2d):
    """torch's InstanceNorm2d, lazy when num_features is None."""


class InstanceNorm3d(_LazyInstanceNorm, nn.InstanceNorm3d):
    """torch's InstanceNorm3d, lazy when num_features is None."""


class LayerNorm(LazyNormMixin, nn.LayerNorm):
    """LayerNorm over the channel dim 1 of (N, C, *) inputs, at each position (timm's LayerNorm2d).

    On (N, C) inputs it is torch's `LayerNorm(C)`; on images it normalizes each pixel's channel vector.
    """

    def __init__(
        self,
        num_features: int | None = None,
        eps: float = 1e-5,
        affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        num_features = check_num_features(num_features)
        lazy = num_features is None
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__(0 if lazy else num_features, eps, affine and not lazy, **factory_kwargs)
        self.num_features, self.elementwise_affine = num_features, affine
        self._init_lazy(lazy, ("weight", "bias") if lazy and affine else (), (), factory_kwargs)

    _check_input_dim = staticmethod(_check_at_least_2d)

    def initialize_parameters(self, input: Tensor) -> None:  # type: ignore[override]
        super().initialize_parameters(input)
        self.normalized_shape = (self.num_features,)

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        self._check_channels(input)
        if input.dim() == 2:
            return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)
        x = F.layer_norm(input.movedim(1, -1), self.normalized_shape, self.weight, self.bias, self.eps)
        return x.movedim(-1, 1)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, affine={self.elementwise_affine}"
