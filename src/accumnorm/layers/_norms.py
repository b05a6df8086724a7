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
from torch.nn.modules.instancenorm import _InstanceNorm

from ._lazy import LazyNormBase, LazyNormMixin, check_num_features, norm_forward

__all__ = ["GroupNorm", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "LayerNorm"]


def _check_at_least_2d(input: Tensor) -> None:
    if input.dim() < 2:
        raise ValueError(f"expected input of shape (N, C, *) with at least 2 dims, got {input.dim()}D input")


class GroupNorm(LazyNormMixin, nn.GroupNorm):
    """torch's GroupNorm with channels first, as timm's: `GroupNorm(num_channels=None, num_groups=32)`.

    Args:
        num_channels: C; None (the default) makes the layer lazy: C comes from its first input.
        num_groups: G, which must divide C. NOTE: second, where torch's GroupNorm takes it first.
        eps, affine, device, dtype, bias: as in torch's GroupNorm.

    Shape:
        Input: (N, C, *). Output: the same shape.

    Examples:
        >>> accumnorm.GroupNorm(64, num_groups=16)(torch.randn(2, 64, 8, 8)).shape
        torch.Size([2, 64, 8, 8])
    """

    _features_attr = "num_channels"
    _norm_forward = norm_forward(nn.GroupNorm.forward)

    def __init__(
        self,
        num_channels: int | None = None,
        num_groups: int = 32,
        eps: float = 1e-5,
        affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
    ) -> None:
        num_channels = check_num_features(num_channels, "num_channels")
        check_num_features(num_groups, "num_groups")
        lazy = num_channels is None
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__(num_groups, num_groups if lazy else num_channels, eps, affine and not lazy, **factory_kwargs)
        self.affine = affine
        self._init_lazy(lazy, affine, bias, (), factory_kwargs)

    _check_input_dim = staticmethod(_check_at_least_2d)

    def initialize_parameters(self, input: Tensor) -> None:  # type: ignore[override]
        if input.dim() >= 2 and input.shape[1] % self.num_groups:
            raise ValueError(
                f"GroupNorm with {self.num_groups} groups needs channels divisible by it, got {input.shape[1]}"
            )
        super().initialize_parameters(input)

    def extra_repr(self) -> str:
        return f"{self.num_channels}, num_groups={self.num_groups}, eps={self.eps}, affine={self.affine}"


class _LazyInstanceNorm(LazyNormBase):
    """torch's InstanceNorm, lazy when num_features is None (torch checks channels itself)."""

    _norm_forward = norm_forward(_InstanceNorm.forward)

    def __init__(
        self,
        num_features: int | None = None,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = False,
        track_running_stats: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, bias=bias)

    def _feature_dim(self, input: Tensor) -> int:
        return input.dim() - self._get_no_batch_dim()  # unbatched inputs have no dim 0

    def _check_channels(self, input: Tensor) -> None:
        """torch's forward checks the channel count itself (only warning where nothing is per channel)."""


_IN_DOC = """torch's InstanceNorm{d}, channels first and lazy when num_features is None.

    Args:
        num_features: C; None (the default) makes the layer lazy: C comes from its first input.
        eps, momentum, affine, track_running_stats, device, dtype, bias: as in torch's InstanceNorm{d}.

    Shape:
        Input: {shape} or the same without N. Output: the same shape.

    Examples:
        >>> accumnorm.InstanceNorm{d}(4, affine=True)(torch.randn({example})).shape
        torch.Size([{example}])
    """


class InstanceNorm1d(_LazyInstanceNorm, nn.InstanceNorm1d):
    __doc__ = _IN_DOC.format(d="1d", shape="(N, C, L)", example="2, 4, 9")


class InstanceNorm2d(_LazyInstanceNorm, nn.InstanceNorm2d):
    __doc__ = _IN_DOC.format(d="2d", shape="(N, C, H, W)", example="2, 4, 5, 5")


class InstanceNorm3d(_LazyInstanceNorm, nn.InstanceNorm3d):
    __doc__ = _IN_DOC.format(d="3d", shape="(N, C, D, H, W)", example="2, 4, 3, 3, 3")


class LayerNorm(LazyNormMixin, nn.LayerNorm):
    """LayerNorm over the channel dim 1 of (N, C, *) inputs, at each position (timm's LayerNorm2d).

    On (N, C) inputs it is torch's `LayerNorm(C)`; on images it normalizes each pixel's channel vector.
    NOTE: not a drop-in for torch's LayerNorm, which normalizes the last dims: it takes the channel
    count `num_features` instead of `normalized_shape`, and `affine` for `elementwise_affine`.

    Args:
        num_features: C; None (the default) makes the layer lazy: C comes from its first input.
        eps: added to the variance. affine: learn a per-channel weight (and bias, unless `bias=False`).
        bias, device, dtype: as in torch's LayerNorm.

    Shape:
        Input: (N, C, *). Output: the same shape.

    Examples:
        >>> accumnorm.LayerNorm(6)(torch.randn(2, 6, 4, 4)).shape
        torch.Size([2, 6, 4, 4])
    """

    def __init__(
        self,
        num_features: int | None = None,
        eps: float = 1e-5,
        affine: bool = True,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        num_features = check_num_features(num_features)
        lazy = num_features is None
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__(0 if lazy else num_features, eps, affine and not lazy, **factory_kwargs)
        self.num_features, self.elementwise_affine = num_features, affine
        self._init_lazy(lazy, affine, bias, (), factory_kwargs)

    _check_input_dim = staticmethod(_check_at_least_2d)

    def initialize_parameters(self, input: Tensor) -> None:  # type: ignore[override]
        super().initialize_parameters(input)
        self.normalized_shape = (self.num_features,)

    def _norm_forward(self, input: Tensor) -> Tensor:
        if input.dim() == 2:
            return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)
        x = F.layer_norm(input.movedim(1, -1), self.normalized_shape, self.weight, self.bias, self.eps)
        return x.movedim(-1, 1)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, affine={self.elementwise_affine}"
