"""BatchNorm's formulas, each written once: the scale, the input gradient from the two sums, the normalization
with known statistics, and the passes schedule's BatchNorm, whose backward collects or uses those sums.

Whole-batch BatchNorm's input gradient, per channel, with N values, x_hat = (x - mean) * invstd and
scale = weight * invstd, is

    dx = scale * (dy - (sum(dy) + x_hat * sum(dy * x_hat)) / N)  =  dy * scale + x * slope + offset

with `slope` and `offset` per channel (`input_gradient_terms`): once the two sums are known, the part of dx
they make is a function of the input alone (`sums_term`), whatever piece of the batch the input is.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

__all__ = ["GradSums", "NormArgs", "channel_shape", "input_gradient_terms", "invstd", "normalize", "normalize_with",
           "scale", "sums_term"]


class NormArgs(Protocol):
    """A BatchNorm call's arguments past its input: what the maths needs of a call, whoever made it."""

    weight: Tensor | None
    bias: Tensor | None
    running_mean: Tensor | None
    running_var: Tensor | None
    eps: float


def channel_shape(x: Tensor) -> list[int]:
    """Shape that broadcasts a per-channel vector against x = (N, C, *)."""
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


def _reduce_dims(x: Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


def invstd(var: Tensor, eps: float) -> Tensor:
    """1 / sqrt(var + eps), per channel."""
    return torch.rsqrt(var + eps)


def scale(inv: Tensor, weight: Tensor | None) -> Tensor:
    """weight * invstd per channel (invstd alone without a weight), in invstd's dtype."""
    return inv if weight is None else inv * weight.detach().to(inv.dtype)


def input_gradient_terms(mean: Tensor, inv: Tensor, scale_: Tensor, sum_dy: Tensor, sum_dy_xhat: Tensor,
                         count: Tensor | int) -> tuple[Tensor, Tensor]:
    """The per-channel `slope` and `offset` of dx = dy * scale + x * slope + offset (module doc): five ops, each
    per channel, at every exact BatchNorm call's backward."""
    share = scale_ * (-1.0 / count) if isinstance(count, int) else scale_ / -count  # -scale / N
    slope = share * inv * sum_dy_xhat
    return slope, torch.addcmul(share * sum_dy, slope, mean, value=-1)  # folds (x - mean) * slope


def sums_term(x: Tensor, slope: Tensor, offset: Tensor) -> Tensor:
    """x * slope + offset per channel: the part of the input gradient that the whole batch's sums make."""
    shape = channel_shape(x)
    return torch.addcmul(offset.view(shape), x, slope.view(shape))


def normalize_with(x: Tensor, mean: Tensor, var: Tensor, weight: Tensor | None, bias: Tensor | None,
                   eps: float) -> Tensor:
    """BatchNorm of x with the given statistics (eval-mode batch_norm), weight and bias in the statistics' dtype.

    torch's kernels take a bfloat16/float16 input with float32 parameters, not half-precision parameters with
    float32 statistics: a half-precision model (no autocast) normalizes as torch's BatchNorm would, in float32.
    torch's op is called as F.batch_norm calls it, not through F: the step's own maths never runs a replacement of
    F.batch_norm (`torchs`).
    """
    if weight is not None and weight.dtype != mean.dtype:
        weight = weight.to(mean.dtype)
    if bias is not None and bias.dtype != mean.dtype:
        bias = bias.to(mean.dtype)
    return torch.batch_norm(x, weight, bias, mean, var, False, 0.0, eps, torch.backends.cudnn.enabled)


class GradSums:
    """The whole-batch backward terms of one BatchNorm call: sum(dy) and sum(dy * x_hat) per channel.

    `collect=True` while they are still being summed (the layer back-propagates the uncorrected
    gradient weight * invstd * dy and adds its micro-batch's share here); once complete, `correction`
    makes the backward exact. `reached`: whether the call's backward ran at all, for any micro-batch on any
    rank. A call no loss reaches has no backward in the whole batch's graph either: it sends no correction,
    which would give the leaves below it a gradient of zeros where torch leaves their `.grad` None.
    """

    def __init__(self, num_channels: int, count: Tensor) -> None:
        self.count = count
        self.sum_dy = torch.zeros(num_channels, dtype=count.dtype, device=count.device)
        self.sum_dy_xhat = torch.zeros_like(self.sum_dy)
        self.collect = True
        self.reached = False

    def add(self, sum_dy: Tensor, sum_dy_xhat: Tensor) -> None:
        self.sum_dy += sum_dy
        self.sum_dy_xhat += sum_dy_xhat
        self.reached = True

    def finish(self, sum_: Callable[[Tensor], Tensor]) -> None:
        """The sums are complete on this process: summed across ranks (`sum_`), with whether any rank's backward
        reached the call, and from now on used, not collected."""
        reached = self.sum_dy.new_ones(1) if self.reached else self.sum_dy.new_zeros(1)
        total = sum_(torch.cat([self.sum_dy, self.sum_dy_xhat, reached]))
        self.sum_dy, self.sum_dy_xhat, reached = total.split([len(self.sum_dy), len(self.sum_dy), 1])
        self.reached = bool(reached)
        self.collect = False

    def correction(self, x: Tensor, mean: Tensor, inv: Tensor, scale_: Tensor) -> Tensor:
        """What the exact backward adds to the uncorrected one, dy * scale, at input `x` (in the statistics' dtype):
        -scale * (sum_dy + x_hat * sum_dy_xhat) / N."""
        return sums_term(x, *input_gradient_terms(mean, inv, scale_, self.sum_dy, self.sum_dy_xhat, self.count))


class _Normalize(torch.autograd.Function):
    """y = (x - mean) * invstd * weight + bias with mean/invstd fixed; backward per `GradSums`."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, var, eps, sums):  # type: ignore[override]
        ctx.save_for_backward(x, weight, mean, var)
        ctx.eps, ctx.sums, ctx.bias_dtype = eps, sums, None if bias is None else bias.dtype
        return normalize_with(x, mean, var, weight, bias, eps)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):  # type: ignore[override]
        x, weight, mean, var = ctx.saved_tensors
        sums: GradSums = ctx.sums
        shape = channel_shape(x)
        inv = invstd(var, ctx.eps)
        x_acc = x.to(mean.dtype)
        x_hat = (x_acc - mean.view(shape)) * inv.view(shape)
        dy_acc = dy.to(mean.dtype)
        dims = _reduce_dims(x)
        sum_dy, sum_dy_xhat = dy_acc.sum(dims), (dy_acc * x_hat).sum(dims)
        scale_ = scale(inv, weight)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = dy_acc * scale_.view(shape)
            if not sums.collect:
                dx = dx + sums.correction(x_acc, mean, inv, scale_)
            dx = dx.to(x.dtype)
        if sums.collect:
            sums.add(sum_dy, sum_dy_xhat)
        grad_w = sum_dy_xhat.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_b = sum_dy.to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
        return dx, grad_w, grad_b, None, None, None, None


def normalize(
    x: Tensor, mean: Tensor, var: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, sums: GradSums
) -> Tensor:
    """BatchNorm of x with given (whole-batch) statistics; its backward collects into or uses `sums`."""
    return _Normalize.apply(x, weight, bias, mean, var, eps, sums)
