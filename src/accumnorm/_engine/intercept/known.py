"""Layers of other libraries that mix a batch's samples where no schedule can see it, refused by name.

A layer's coupling of the samples reaches the step through a batch-norm call. These layers couple them otherwise,
and an accumulated step would give each micro-batch's statistics without a word (`What no library can make exact`
in docs/exact-covers.md); they are common enough to be named, so that the step refuses them before it runs, in
training mode (in eval mode they normalize each sample with running statistics):

- timm's `SplitBatchNorm2d` (AugMix's `--split-bn`) normalizes each of its input's `num_splits` row blocks with a
  BatchNorm of its own: the blocks of a micro-batch are not the whole batch's;
- timm's `EvoNorm2dB0`, `B1` and `B2` compute the batch variance by hand (`x.var(dim=(0, 2, 3))`).

Matched by the qualified name of the class or of a base, so that nothing is imported.
"""
from __future__ import annotations

import functools

import torch.nn as nn

__all__ = ["library_refusal"]

_SPLIT = ("it normalizes each of its input's num_splits blocks of rows with a BatchNorm of its own, and a "
          "micro-batch's blocks are not the whole batch's. Nothing was changed. Train it with num_splits=1, or pass "
          "bn='micro'")
_EVONORM = ("it computes the batch variance by hand (x.var over the batch), which no schedule sees: each micro-batch "
            "would be normalized with its own. Nothing was changed. Use an EvoNorm S variant (per sample), "
            "BatchNorm, or bn='micro'")
_KNOWN = {
    "timm.layers.split_batchnorm.SplitBatchNorm2d": _SPLIT,
    "timm.layers.evo_norm.EvoNorm2dB0": _EVONORM,
    "timm.layers.evo_norm.EvoNorm2dB1": _EVONORM,
    "timm.layers.evo_norm.EvoNorm2dB2": _EVONORM,
}


def library_refusal(m: nn.Module) -> str | None:
    """Why a layer in training mode mixes the samples where no schedule sees it (module doc); None if it does not."""
    return _refusal(type(m)) if m.training else None


@functools.cache
def _refusal(cls: type) -> str | None:
    return next((_KNOWN[name] for c in cls.__mro__ if (name := f"{c.__module__}.{c.__qualname__}") in _KNOWN), None)
