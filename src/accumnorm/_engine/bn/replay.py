"""A met BatchNorm call's output given again from its input, for a checkpointed region's recomputation.

A checkpointed region runs its forward again in the backward, outside the step: there a BatchNorm call must
give the output the forward's call gave (the whole batch's statistics, not its micro-batch's), move no
running statistic, and save in the region's place what the forward's call saved there.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...functional import Moments, moments
from .normalize import NormArgs, normalize_with

__all__ = ["CallReplay"]


class CallReplay:
    """A piece's output of a met call, again, from its input (module doc). It saves what the forward's call saved in
    the region's place: nothing when the call ran outside every region (`whole`), the piece's input when it was kept
    in the region's place (`pieces`, `keeps_input`). It holds the call's parameters and statistics, not its input
    (the whole batch's input, `whole_input`, only until its statistics are first needed)."""

    def __init__(self, args: NormArgs, piece: Tensor, whole_input: Tensor | None, stats: Moments | None,
                 requires_grad: bool, keeps_input: bool = False) -> None:
        self.weight, self.bias, self.eps = args.weight, args.bias, args.eps
        self.shape, self.dtype = piece.shape[1:], piece.dtype
        self.whole_input, self.stats, self.requires_grad = whole_input, stats, requires_grad
        self.keeps_input = keeps_input
        self.var: Tensor | None = None  # the statistics' variance, once read

    def __call__(self, x: Tensor) -> Tensor:
        if x.shape[1:] != self.shape or x.dtype != self.dtype:
            raise ValueError(f"bn='exact': a checkpointed region's recomputation made another BatchNorm call than its "
                             f"forward (an input of {tuple(x.shape[1:])} {x.dtype} where the forward's was "
                             f"{tuple(self.shape)} {self.dtype}); the region's function must make the same calls "
                             "each time")
        if self.keeps_input:
            hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
            if hooks is not None:
                hooks[0](x)  # the recomputation's pack hook: the piece, where the forward's call saved it
        if self.stats is None:  # the whole batch's statistics, as torch's kernel computed them in the forward
            with torch.no_grad():
                self.stats = moments(self.whole_input)
            self.whole_input = None
        if not self.requires_grad:
            with torch.no_grad():
                return self._normalize(x)
        return _Again.apply(self._normalize, x, self.weight, self.bias)

    def _normalize(self, x: Tensor) -> Tensor:
        if self.var is None:  # read once: each micro-batch's recomputation replays the call
            self.var = self.stats.var
        return normalize_with(x, self.stats.mean, self.var, self.weight, self.bias, self.eps)


class _Again(torch.autograd.Function):
    """A met call's output given again in a region's recomputation, as a non-leaf that requires grad (the region may
    go on in place, ReLU(inplace=True), and its next ops save what they saved in the forward), with no copy. The
    recomputation's graph is never back-propagated: the backward runs through the forward's."""

    @staticmethod
    def forward(ctx, normalize, x, weight, bias):  # type: ignore[override]
        return normalize(x)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        raise RuntimeError("bn='exact': a backward through a checkpointed region's recomputation of a BatchNorm call, "
                           "which has no gradient of its own (the forward's call has)")
