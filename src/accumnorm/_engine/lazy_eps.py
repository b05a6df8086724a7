"""A warning for torch's lazy-norm pitfall: `nn.LazyBatchNorm2d(32)` means eps=32, not 32 channels.

torch's lazy BatchNorm and InstanceNorm take `eps` as their first argument (the channel count comes from
the first input), so the habit of writing the channels first gives a norm that divides by about
sqrt(32): it trains, silently worse. After its first forward such a layer is a plain `nn.BatchNorm2d`
with eps=32. No sensible norm has an eps of 1 or more, so `accumnorm.backward` warns once per layer
that has one, whatever its class, before the step.
"""
from __future__ import annotations

import re
import weakref
from collections.abc import Iterable

import torch.nn as nn
from torch.nn.modules.batchnorm import _NormBase

from .._warn import warn_at_caller

__all__ = ["warn_large_eps"]

_warned: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # each layer is warned about once
_KIND = re.compile(r"(Batch|Instance)Norm([123]d)")


def warn_large_eps(model: nn.Module, modules: Iterable[nn.Module]) -> None:
    """Warn, once per layer, of each BatchNorm or InstanceNorm among `modules` (the model's) whose eps is 1 or
    more."""
    for m in modules:
        if isinstance(m, _NormBase) and m.eps >= 1 and m not in _warned:
            _warned.add(m)
            name = next((name for name, sub in model.named_modules() if sub is m), "")
            where = f"{type(m).__name__} {name!r}" if name else f"{type(m).__name__} (the model)"
            kind = _KIND.search(type(m).__name__)
            layer = kind.group(0) if kind else "BatchNorm2d"
            channels = int(m.eps) if float(m.eps).is_integer() else m.eps
            warn_at_caller(
                f"accumnorm.backward: {where} has eps={m.eps:g}, 1 or more: did you mean "
                f"Lazy{layer}() with {channels} channels? torch reads the first argument as eps. accumnorm.{layer}"
                f"({channels}) takes the channel count first (accumnorm.{layer}() is lazy)", UserWarning)
