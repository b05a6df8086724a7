"""The joint node of the layerwise schedule: K micro-batches' pieces of one BatchNorm call, as one call.

Each micro-batch's input to the call goes through `join`, one autograd node for all K; each piece is then
normalized by torch's own eval-mode BatchNorm with the whole batch's statistics (`normalize_piece`), when its
micro-batch goes on. In the backward the pieces hand the joining node what they computed, and autograd runs
it once all K are in: exactly when the whole batch's sum(dy) and sum(dy * x_hat) exist, which the exact input
gradient needs (see `accumnorm.functional` for the formulas).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..functional import Moments
from .sums import channel_shape

__all__ = ["Joint", "join", "normalize_piece"]


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
            shape = channel_shape(x)
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
