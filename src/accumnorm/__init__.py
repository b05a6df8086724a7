"""accumnorm: BatchNorm that is exact under gradient accumulation, and norms that swap behind one factory.

    import accumnorm
    model = accumnorm.convert(model)            # torch BatchNorm -> accumnorm BatchNorm, same tensors
    loss = accumnorm.backward(model, (x, y), loss_fn, micro_batch_size=4)   # exact whole-batch gradient
    optimizer.step()
"""
from . import distributed, functional
from ._engine.backward import backward
from ._engine.memory.budget import last_schedule
from ._trainer import Trainer
from .layers import (
    NORM_NAMES,
    BatchNorm,
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    BatchRenorm2d,
    EvoNorm2dS0,
    FilterResponseNorm2d,
    GroupNorm,
    InstanceNorm1d,
    InstanceNorm2d,
    InstanceNorm3d,
    LayerNorm,
    StaleBatchNorm2d,
    convert,
    norm,
    norm_layer,
    revert,
)

__version__ = "0.1.0"

__all__ = [
    "backward", "last_schedule", "Trainer", "distributed", "functional",
    "BatchNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d",
    "GroupNorm", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "LayerNorm",
    "BatchRenorm2d", "StaleBatchNorm2d", "FilterResponseNorm2d", "EvoNorm2dS0",
    "norm", "norm_layer", "NORM_NAMES", "convert", "revert",
]
