"""Functional core of accumnorm's BatchNorm: statistics that merge across micro-batches and ranks,
and a normalization whose backward uses whole-batch sums.

Whole-batch BatchNorm in training mode computes, per channel,

    y  = x_hat * weight + bias,        x_hat = (x - mean) * invstd,   invstd = 1 / sqrt(var + eps)
    dx = weight * invstd * (dy - sum(dy) / N - x_hat * sum(dy * x_hat) / N)

with mean, var (biased) and both sums taken over all N values of the channel in the batch. Those
four quantities are the only coupling between samples: SyncBatchNorm all-reduces them across GPUs,
accumnorm reduces them across micro-batches (and ranks). Everything here works on one micro-batch
and leaves the reducing to the caller (`accumnorm._engine.step`).

Statistics and sums are kept in float32 (float64 for float64 inputs) whatever the input dtype, so
that bf16/fp16 autocast never degrades them.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["Moments", "moments", "combine_moments", "stack_moments", "update_running_stats_", "GradSums", "normalize",
           "normalize_with", "Joint", "join", "normalize_piece", "normalize_joint"]


def _channel_shape(x: Tensor) -> list[int]:
    """Shape that broadcasts a per-channel vector against x = (N, C, *)."""
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


def _reduce_dims(x: Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


@dataclass
class Moments:
    """Per-channel count, mean and sum of squared deviations (m2) of a set of values.

    Kept as (count, mean, m2) rather than (sum, sum of squares) because merging those is exact up
    to rounding (Chan et al.) where sum-of-squares cancels catastrophically in float32.
    """

    count: Tensor  # scalar, acc dtype
    mean: Tensor  # (C,)
    m2: Tensor  # (C,)

    @property
    def var(self) -> Tensor:
        """Biased variance: what BatchNorm normalizes with."""
        return self.m2 / self.count

    def pack(self) -> Tensor:
        """One flat tensor [count, mean..., m2...], for a single all_gather across ranks."""
        return torch.cat([self.count.reshape(1), self.mean, self.m2])

    @staticmethod
    def unpack(flat: Tensor) -> Moments:
        c = (flat.shape[-1] - 1) // 2
        return Moments(flat[..., 0], flat[..., 1 : 1 + c], flat[..., 1 + c :])


def moments(x: Tensor) -> Moments:
    """Per-channel moments of x = (N, C, *) over every dimension but the channel one."""
    xa = x if x.dtype in (torch.float32, torch.float64) else x.float()
    # torch's own BatchNorm statistics kernel: two passes (mean, then squared deviations: no cancellation), no
    # full-size temporary, no output written; the variance is the biased one.
    mean, var = torch.batch_norm_update_stats(xa, None, None, 0.0)
    n = x.numel() // x.shape[1]
    # new_full launches a fill on the device; torch.tensor(n, device=...) would be a blocking copy
    return Moments(mean.new_full((), n), mean, var * n)


def combine_moments(parts: Moments) -> Moments:
    """Merge moments stacked along dim 0 (count (K,), mean (K, C), m2 (K, C)) into one set.

    mean = sum(n_k mean_k) / n,   m2 = sum(m2_k + n_k (mean_k - mean)^2)
    """
    n = parts.count.sum()
    w = (parts.count / n).unsqueeze(-1)
    mean = (w * parts.mean).sum(0)
    m2 = (parts.m2 + parts.count.unsqueeze(-1) * (parts.mean - mean) ** 2).sum(0)
    return Moments(n, mean, m2)


def stack_moments(parts: list[Moments]) -> Moments:
    """Moments of several sets (micro-batches) merged into one set."""
    return combine_moments(Moments(torch.stack([p.count for p in parts]), torch.stack([p.mean for p in parts]),
                                   torch.stack([p.m2 for p in parts])))


def update_running_stats_(running_mean: Tensor, running_var: Tensor | None, mean: Tensor, unbiased_var: Tensor,
                          factor: float) -> None:
    """torch's running-statistics update, in place: `running = (1 - factor) * running + factor * batch`.

    `factor` is BatchNorm's momentum, or 1 / (batches so far) for a cumulative average (momentum=None).
    """
    with torch.no_grad():
        running_mean.lerp_(mean.to(running_mean.dtype), factor)
        if running_var is not None:
            running_var.lerp_(unbiased_var.to(running_var.dtype), factor)


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
        shape = _channel_shape(x_hat)
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
        ctx.eps, ctx.sums = eps, sums
        return normalize_with(x, mean, var, weight, bias, eps)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):  # type: ignore[override]
        x, weight, mean, var = ctx.saved_tensors
        sums: GradSums = ctx.sums
        shape = _channel_shape(x)
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
        grad_b = sum_dy.to(weight.dtype) if weight is not None and ctx.needs_input_grad[2] else None
        return dx, grad_w, grad_b, None, None, None, None


def normalize(
    x: Tensor, mean: Tensor, var: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, sums: GradSums
) -> Tensor:
    """BatchNorm of x with given (whole-batch) statistics; its backward collects into or uses `sums`."""
    return _Normalize.apply(x, weight, bias, mean, var, eps, sums)


class Joint:
    """One BatchNorm call of the whole batch, made of K micro-batch pieces: its statistics, weight, bias and eps.

    `join` ties the K pieces' inputs to one autograd node; each piece is then normalized by torch's own
    eval-mode BatchNorm with the whole batch's statistics (`normalize_piece`), one at a time, as its
    micro-batch goes on, so that what follows reads it while it is fresh in cache.
    """

    def __init__(self, stats: Moments, weight: Tensor | None, bias: Tensor | None, eps: float,
                 reduce_sums: Callable[[Tensor], Tensor]) -> None:
        self.stats, self.weight, self.bias, self.eps, self.reduce_sums = stats, weight, bias, eps, reduce_sums
        self.affine: tuple[Tensor, Tensor] | None = None  # the pieces' weight and bias, outputs of `join`


class _Join(torch.autograd.Function):
    """The K inputs of one BatchNorm call, passed on as they are, and the weight and bias the pieces normalize with.

    Every piece's backward (torch's eval-mode BatchNorm backward) sends this node dy * weight * invstd for its
    input, and adds sum(dy * x_hat) and sum(dy) over its samples to the gradients of the weight and bias it was
    given, which are outputs of this node: so autograd calls this backward once every micro-batch's gradient
    is in, with the whole batch's sums (this rank's) already added up, and it makes the exact input gradients.
    """

    @staticmethod
    def forward(ctx, joint, weight, bias, *xs):  # type: ignore[override]
        ctx.save_for_backward(*xs)
        ctx.joint = joint
        mean = joint.stats.mean
        w = mean.new_ones(mean.shape) if weight is None else weight.to(mean.dtype).view_as(weight)
        b = mean.new_zeros(mean.shape) if bias is None else bias.to(mean.dtype).view_as(bias)
        return (*(x.view_as(x) for x in xs), w, b)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):  # type: ignore[override]
        joint: Joint = ctx.joint
        stats, weight, eps = joint.stats, joint.weight, joint.eps
        *gs, sum_dy_xhat, sum_dy = grads  # gs[k] = dy * weight * invstd, the k-th piece's input gradient so far
        sum_dy_xhat = torch.zeros_like(stats.mean) if sum_dy_xhat is None else sum_dy_xhat
        sum_dy = torch.zeros_like(stats.mean) if sum_dy is None else sum_dy
        # The parameter gradients are this rank's share (the step all-reduces gradients once); the input
        # gradients need the sums of every rank.
        grad_w = sum_dy_xhat.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_b = sum_dy.to(weight.dtype) if ctx.needs_input_grad[2] and joint.bias is not None else None
        sum_dy_xhat, sum_dy = joint.reduce_sums(torch.cat([sum_dy_xhat, sum_dy])).chunk(2)
        # dx = scale * (dy - (sum_dy + x_hat * sum_dy_xhat) / N), x_hat = (x - mean) * invstd, as
        # g + x * slope + offset per channel, with g = dy * scale already made by the piece's backward.
        invstd = torch.rsqrt(stats.var + eps)
        scale = invstd if weight is None else invstd * weight.detach().to(invstd.dtype)
        slope = -scale * invstd * sum_dy_xhat / stats.count
        offset = -scale * sum_dy / stats.count - slope * stats.mean  # folds (x - mean) * slope
        dxs = []
        for i, (x, g) in enumerate(zip(ctx.saved_tensors, gs)):
            if not ctx.needs_input_grad[3 + i]:
                dxs.append(None)
                continue
            shape = _channel_shape(x)
            dx = torch.addcmul(offset.view(shape), x, slope.view(shape))
            dxs.append((dx if g is None else dx.add_(g)).to(x.dtype))
        return (None, grad_w, grad_b, *dxs)


def join(xs: list[Tensor], joint: Joint) -> tuple[Tensor, ...]:
    """The K pieces' inputs, tied to one node that makes their exact input gradients (see `Joint`)."""
    *joined, w, b = _Join.apply(joint, joint.weight, joint.bias, *xs)
    joint.affine = (w, b)
    return tuple(joined)


def normalize_piece(joined: Tensor, joint: Joint) -> Tensor:
    """One micro-batch's output of a joint BatchNorm call, from its output of `join`: torch's eval-mode BatchNorm
    with the whole batch's statistics (whose backward feeds `join`'s)."""
    w, b = joint.affine
    stats = joint.stats
    return torch.batch_norm(joined, w, b, stats.mean, stats.var, False, 0.0, joint.eps, torch.backends.cudnn.enabled)


def normalize_joint(
    xs: list[Tensor], stats: Moments, weight: Tensor | None, bias: Tensor | None, eps: float,
    reduce_sums: Callable[[Tensor], Tensor] = lambda t: t,
) -> list[Tensor]:
    """BatchNorm of each micro-batch in `xs` with the whole batch's `stats`, back-propagating as one batch.

    `reduce_sums` sums the backward's per-channel sums over other ranks (identity on one process).
    """
    joint = Joint(stats, weight, bias, eps, reduce_sums)
    return [normalize_piece(x, joint) for x in join(xs, joint)]
