"""One BatchNorm call of a batch spread over the ranks of a process group: SyncBatchNorm on any device.

The layerwise schedule concatenates a rank's micro-batches into its share of the call's input. With one
rank, torch's own `batch_norm` normalizes that (`whole`). Across ranks, torch's SyncBatchNorm
kernels are CUDA-only, so `normalize_across_ranks` does it: the share goes through `_Join`, then torch's
eval-mode BatchNorm normalizes it with the statistics of every rank. In the backward, the BatchNorm node
hands `_Join` dy * weight * invstd for the input and this rank's sum(dy * x_hat) and sum(dy) as the
gradients of the weight and bias it was given (outputs of `_Join`); `_Join` sums those over the ranks
and makes the exact input gradient (`normalize.input_gradient_terms`).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ...functional import Moments
from .normalize import input_gradient_terms, invstd, normalize_with, scale, sums_term

__all__ = ["normalize_across_ranks"]


class _Join(torch.autograd.Function):
    """The input, passed on as it is, and the weight and bias the BatchNorm normalizes it with (module doc)."""

    @staticmethod
    def forward(ctx, stats, eps, reduce_sums, weight, bias, x):  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.stats, ctx.eps, ctx.reduce_sums, ctx.weight = stats, eps, reduce_sums, weight
        ctx.bias_dtype = None if bias is None else bias.dtype
        mean = stats.mean
        w = mean.new_ones(mean.shape) if weight is None else weight.to(mean.dtype).view_as(weight)
        b = mean.new_zeros(mean.shape) if bias is None else bias.to(mean.dtype).view_as(bias)
        return x.view_as(x), w, b

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g, sum_dy_xhat, sum_dy):  # type: ignore[override]
        stats, weight, (x,) = ctx.stats, ctx.weight, ctx.saved_tensors
        sum_dy_xhat = torch.zeros_like(stats.mean) if sum_dy_xhat is None else sum_dy_xhat
        sum_dy = torch.zeros_like(stats.mean) if sum_dy is None else sum_dy
        # The parameter gradients are this rank's share (the step all-reduces gradients once); the input
        # gradient needs the sums of every rank.
        grad_w = sum_dy_xhat.to(weight.dtype) if weight is not None and ctx.needs_input_grad[3] else None
        grad_b = sum_dy.to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[4] else None
        sum_dy_xhat, sum_dy = ctx.reduce_sums(torch.cat([sum_dy_xhat, sum_dy])).chunk(2)
        dx = None
        if ctx.needs_input_grad[5]:
            # dx = g + x * slope + offset per channel, with g = dy * scale already made by the BatchNorm's backward.
            inv = invstd(stats.var, ctx.eps)
            dx = sums_term(x, *input_gradient_terms(stats.mean, inv, scale(inv, weight), sum_dy, sum_dy_xhat,
                                                    stats.count))
            dx = (dx if g is None else dx.add_(g)).to(x.dtype)
        return None, None, None, grad_w, grad_b, dx


def normalize_across_ranks(x: Tensor, stats: Moments, weight: Tensor | None, bias: Tensor | None, eps: float,
                           reduce_sums: Callable[[Tensor], Tensor]) -> Tensor:
    """BatchNorm of this rank's share `x` with the statistics `stats` of every rank's, whose backward sums its
    per-channel sums over the ranks with `reduce_sums` (module doc)."""
    joined, w, b = _Join.apply(stats, eps, reduce_sums, weight, bias, x)
    return normalize_with(joined, stats.mean, stats.var, w, b, eps)
