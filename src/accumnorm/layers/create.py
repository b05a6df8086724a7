"""One factory for every norm, and converters between torch's BatchNorm and accumnorm's.

`norm("gn16", 64)` builds a layer by name, so a model can take its norm as a string (as timm's
create_norm does, but an unknown name lists the valid ones instead of a bare KeyError).
`convert(model)` swaps torch's BatchNorm layers for accumnorm's in place, as
`torch.nn.SyncBatchNorm.convert_sync_batchnorm` does: same Parameter and buffer objects (an optimizer
built before still works), same train/eval flag. `revert(model)` goes back, for export.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch.nn as nn
from torch.nn.modules.lazy import LazyModuleMixin

from .alternatives import BatchRenorm2d, EvoNorm2dS0, FilterResponseNorm2d, StaleBatchNorm2d
from .batchnorm import BatchNorm, BatchNorm1d, BatchNorm2d, BatchNorm3d
from .norms import GroupNorm, InstanceNorm1d, InstanceNorm2d, InstanceNorm3d, LayerNorm

__all__ = ["norm", "NORM_NAMES", "convert", "revert"]

_FACTORIES: dict[str, Callable[..., nn.Module]] = {
    "bn": BatchNorm2d,
    "bn1d": BatchNorm1d,
    "bn2d": BatchNorm2d,
    "bn3d": BatchNorm3d,
    "in": lambda c, **kw: InstanceNorm2d(c, **{"affine": True, **kw}),
    "in1d": lambda c, **kw: InstanceNorm1d(c, **{"affine": True, **kw}),
    "in2d": lambda c, **kw: InstanceNorm2d(c, **{"affine": True, **kw}),
    "in3d": lambda c, **kw: InstanceNorm3d(c, **{"affine": True, **kw}),
    "ln": LayerNorm,
    "none": lambda c, **kw: nn.Identity(),
    "brn": BatchRenorm2d,
    "bn-stale": StaleBatchNorm2d,
    "frn": FilterResponseNorm2d,
    "evonorm-s0": EvoNorm2dS0,
}
NORM_NAMES = ("bn", "bn1d", "bn2d", "bn3d", "gn<G>", "in", "in1d", "in2d", "in3d", "ln", "none",
              "brn", "bn-stale", "frn", "evonorm-s0")
_GN = re.compile(r"gn(\d+)")


def norm(name: str, num_features: int | None = None, **kwargs: Any) -> nn.Module:
    """Build a norm layer by name; lazy (channels from the first input) when num_features is None.

    Names: "bn" (accumnorm.BatchNorm2d; "bn1d"/"bn3d" for other ranks), "gn<G>" (GroupNorm with G
    groups, e.g. "gn4", "gn16"), "in" (InstanceNorm2d with affine=True; "in1d"/"in3d"), "ln"
    (LayerNorm over the channel dim), "none" (Identity); the alternatives to BatchNorm "brn"
    (BatchRenorm2d), "bn-stale" (StaleBatchNorm2d), "frn" (FilterResponseNorm2d, with TLU),
    "evonorm-s0" (EvoNorm2dS0). kwargs go to the layer's constructor.
    """
    if not isinstance(name, str):
        raise TypeError(f"norm name must be a str, got {type(name).__name__} {name!r}")
    key = name.strip().lower()
    gn = _GN.fullmatch(key)
    if gn:
        return GroupNorm(num_features, int(gn.group(1)), **kwargs)
    if key not in _FACTORIES:
        raise ValueError(f"unknown norm {name!r}; valid names: {', '.join(NORM_NAMES)} (e.g. gn4, gn16)")
    return _FACTORIES[key](num_features, **kwargs)


_TO_ACCUM: dict[type, type] = {
    nn.BatchNorm1d: BatchNorm1d,
    nn.BatchNorm2d: BatchNorm2d,
    nn.BatchNorm3d: BatchNorm3d,
    nn.SyncBatchNorm: BatchNorm,
}
_TO_TORCH: dict[type, type] = {accum: torch_cls for torch_cls, accum in _TO_ACCUM.items()}


def _swap(module: nn.Module, mapping: dict[type, type]) -> nn.Module:
    """Rebuild every module whose exact type is in `mapping` around the same tensors, recursively."""
    out = module
    cls = mapping.get(type(module))
    if cls is not None:
        if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
            raise ValueError(f"cannot convert {module._get_name()} before its lazy shape is known; "
                             "run one forward first")
        out = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
        # The very same Parameter and buffer objects: optimizers and hooks that hold them stay valid.
        out.weight, out.bias = module.weight, module.bias
        out.running_mean, out.running_var = module.running_mean, module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    for name, child in module.named_children():
        out.add_module(name, _swap(child, mapping))
    return out


def convert(module: nn.Module) -> nn.Module:
    """Swap torch BatchNorm1d/2d/3d and SyncBatchNorm (exact types, not subclasses) for accumnorm's.

    Returns the converted module (a new object if `module` itself is a BatchNorm), like
    `torch.nn.SyncBatchNorm.convert_sync_batchnorm`.
    """
    return _swap(module, _TO_ACCUM)


def revert(module: nn.Module) -> nn.Module:
    """Turn accumnorm's BatchNorm layers back into torch's (accumnorm.BatchNorm becomes SyncBatchNorm)."""
    return _swap(module, _TO_TORCH)
