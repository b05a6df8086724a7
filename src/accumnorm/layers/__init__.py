"""Normalization layers: exact-under-accumulation BatchNorm, lazy per-sample norms, registry and converters."""
from ._alternatives import BatchRenorm2d, StaleBatchNorm2d
from ._batchnorm import BatchNorm, BatchNorm1d, BatchNorm2d, BatchNorm3d
from ._create import NORM_NAMES, convert, norm, norm_layer, revert
from ._norms import GroupNorm, InstanceNorm1d, InstanceNorm2d, InstanceNorm3d, LayerNorm
from ._per_sample import EvoNorm2dS0, FilterResponseNorm2d

__all__ = [
    "BatchNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d",
    "GroupNorm", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "LayerNorm",
    "BatchRenorm2d", "StaleBatchNorm2d", "FilterResponseNorm2d", "EvoNorm2dS0",
    "norm", "norm_layer", "NORM_NAMES", "convert", "revert",
]
