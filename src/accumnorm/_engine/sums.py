"""BatchNorm with known whole-batch statistics, one micro-batch at a time: the passes schedule's BatchNorm.

`normalize` normalizes a micro-batch with the whole batch's statistics; its backward either adds the
micro-batch's share of sum(dy) and sum(dy * x_hat) to a `GradSums` (while they are still being collected) or
uses the complete sums for the exact input gradient (see `accumnorm._engine.passes`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["GradSums", "normalize", "normalize_with", "channel_shape"]


def channel_shape(x: Tensor) -> list[int]:
    """Shape that broadcasts a per-channel vector against x = (N, C, *)."""
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


def _reduce_dims(x: Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


class GradSums:
    """The whole-batch backward terms of one BatchNorm call: sum(dy) and sum(dy * x_hat) per channel.

    `collect=True` while they are still being summed (the layer back-propagates the uncorrected
    gradient weight * invstd * dy and adds its micro-batch's share here); once complete, `total`
    makes the backward exact.
    """

    def __init__(self, num_channels: int, count: Tensor) -> None:
        self.count = count
        self.sum_dy = torch.zeros(num_channels, dtype=count.dtype, device=count.device)
        self.sum_dy_xhat = torch.zeros_like(self.sum_dy)
        self.collect = True

    def add(self, sum_dy: Tensor, sum_dy_xhat: Tensor) -> None:
        self.sum_dy += sum_dy
        self.sum_dy_xhat += sum_dy_xhat

    def correction(self, x_hat: Tensor, scale: Tensor) -> Tensor:
        """What the exact backward adds to the uncorrected one: -scale * (sum_dy + x_hat * sum_dy_xhat) / N."""
        shape = channel_shape(x_hat)
        return -(self.sum_dy.view(shape) + x_hat * self.sum_dy_xhat.view(shape)) * (scale / self.count).view(shape)


def normalize_with(x: Tensor, mean: Tensor, var: Tensor, weight: Tensor | None, bias: Tensor | None,
                   eps: float) -> Tensor:
    """BatchNorm of x with the given statistics (eval-mode batch_norm), weight and bias in the statistics' dtype.

    torch's kernels take a bfloat16/float16 input with float32 parameters, not half-precision parameters with
    float32 statistics: a half-precision model (no autocast) normalizes as torch's BatchNorm would, in float32.
    """
    if weight is not None and weight.dtype != mean.dtype:
        weight = weight.to(mean.dtype)
    if bias is not None and bias.dtype != mean.dtype:
        bias = bias.to(mean.dtype)
    return F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)


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
        invstd = torch.rsqrt(var + ctx.eps)
        x_hat = (x.to(mean.dtype) - mean.view(shape)) * invstd.view(shape)
        dy_acc = dy.to(mean.dtype)
        dims = _reduce_dims(x)
        sum_dy, sum_dy_xhat = dy_acc.sum(dims), (dy_acc * x_hat).sum(dims)
        scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = dy_acc * scale.view(shape)
            if not sums.collect:
                dx = dx + sums.correction(x_hat, scale)
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
