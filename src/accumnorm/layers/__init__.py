"""Normalization layers: exact-under-accumulation BatchNorm, lazy per-sample norms, registry and converters."""
from .batchnorm import BatchNorm, BatchNorm1d, BatchNorm2d, BatchNorm3d
from .create import NORM_NAMES, convert, norm, norm_layer, revert
from .norms import GroupNorm, InstanceNorm1d, InstanceNorm2d, InstanceNorm3d, LayerNorm

__all__ = [
    "BatchNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d",
    "GroupNorm", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "LayerNorm",
    "norm", "norm_layer", "NORM_NAMES", "convert", "revert",
]
