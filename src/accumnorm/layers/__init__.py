"""Normalization layers: exact-under-accumulation BatchNorm, lazy per-sample norms, factory and converters."""
from .batchnorm import BatchNorm, BatchNorm1d, BatchNorm2d, BatchNorm3d
from .create import NORM_NAMES, convert, norm, revert
from .norms import GroupNorm, InstanceNorm1d, InstanceNorm2d, InstanceNorm3d, LayerNorm

__all__ = [
    "BatchNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d",
    "GroupNorm", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "LayerNorm",
    "norm", "NORM_NAMES", "convert", "revert",
]
