"""The maths of BatchNorm over a batch that comes in pieces: per-channel moments that merge exactly across
micro-batches and ranks, and torch's running-statistics update.

Whole-batch BatchNorm in training mode computes, per channel,

    y  = x_hat * weight + bias,        x_hat = (x - mean) * invstd,   invstd = 1 / sqrt(var + eps)
    dx = weight * invstd * (dy - sum(dy) / N - x_hat * sum(dy * x_hat) / N)

with mean, var (biased) and both sums taken over all N values of the channel in the batch. Those four
quantities are the only coupling between samples: SyncBatchNorm all-reduces them across GPUs, accumnorm
reduces them across ranks (`accumnorm._engine.bn.ranks`) and micro-batches (the passes schedule). Statistics are
kept in float32 (float64 for float64 inputs) whatever the input dtype, so that bf16/fp16 never degrade them.

Example::

    >>> x = torch.randn(16, 8, 4, 4)
    >>> whole = combine_moments([moments(part) for part in x.split(4)])  # 4 micro-batches of 4
    >>> torch.testing.assert_close(whole.var, x.var(dim=(0, 2, 3), unbiased=False))
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Moments", "moments", "combine_moments", "update_running_stats_"]


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

    @property
    def unbiased_var(self) -> Tensor:
        """Unbiased variance: what BatchNorm's running variance moves towards."""
        return self.m2 / (self.count - 1)

    def pack(self) -> Tensor:
        """One flat tensor [count, mean..., m2...], for a single all_gather across ranks."""
        return torch.cat([self.count.reshape(1), self.mean, self.m2])

    @staticmethod
    def unpack(flat: Tensor) -> Moments:
        c = (flat.shape[-1] - 1) // 2
        return Moments(flat[..., 0], flat[..., 1 : 1 + c], flat[..., 1 + c :])


def moments(x: Tensor) -> Moments:
    """Per-channel moments of x = (N, C, *) over every dimension but the channel one."""
    if x.dim() < 2:
        raise ValueError(f"moments expects an input of shape (N, C, *), got one of shape {tuple(x.shape)}")
    xa = x.to(_statistics_dtype(x.dtype))  # itself, or a float32 copy of a half-precision x
    if xa.numel() == 0:  # an empty piece of a batch (a mask that selects nothing): no values, no moments
        zeros = xa.new_zeros(x.shape[1])
        return Moments(zeros.new_zeros(()), zeros, zeros.clone())
    # torch's own BatchNorm statistics kernel: two passes (mean, then squared deviations: no cancellation), no
    # full-size temporary, no output written; the variance is the biased one.
    mean, var = torch.batch_norm_update_stats(xa, None, None, 0.0)
    n = x.numel() // x.shape[1]
    # new_full launches a fill on the device; torch.tensor(n, device=...) would be a blocking copy
    return Moments(mean.new_full((), n), mean, var * n)


def _statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the statistics of a tensor of `dtype` are kept in: float32 or float64 as they are, else float32."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def combine_moments(parts: Moments | Sequence[Moments]) -> Moments:
    """Merge sets of moments (a list, or one Moments stacked along dim 0: count (K,), mean (K, C), m2 (K, C)) into
    the moments of their union (Chan et al.):

        mean = sum(n_k mean_k) / n,   m2 = sum(m2_k + n_k (mean_k - mean)^2)

    One set's moments, not stacked (a 0-dim count, as `moments` gives them), are their own union: returned as they are.
    """
    if isinstance(parts, Moments) and parts.count.dim() == 0:
        return parts
    if not isinstance(parts, Moments):
        parts = Moments(torch.stack([p.count for p in parts]), torch.stack([p.mean for p in parts]),
                        torch.stack([p.m2 for p in parts]))
    n = parts.count.sum()
    w = (parts.count / n.clamp_min(1)).unsqueeze(-1)  # no values at all: no moments (zeros), as `moments` gives them
    mean = (w * parts.mean).sum(0)
    m2 = (parts.m2 + parts.count.unsqueeze(-1) * (parts.mean - mean) ** 2).sum(0)
    return Moments(n, mean, m2)


def update_running_stats_(running_mean: Tensor, running_var: Tensor | None, mean: Tensor, unbiased_var: Tensor,
                          factor: float, count: Tensor | None = None) -> None:
    """torch's running-statistics update, in place: `running = (1 - factor) * running + factor * batch`.

    `factor` is BatchNorm's momentum, or 1 / (batches so far) for a cumulative average (momentum=None). `count`,
    where given, is the number of values the statistics are of: none (an empty batch, whose statistics are 0/0)
    leaves the running statistics as they are, as torch's kernels do (compared on the device, with no wait).
    """
    with torch.no_grad():
        if count is not None:
            some = count > 0
            mean = torch.where(some, mean.to(running_mean.dtype), running_mean)
            if running_var is not None:
                unbiased_var = torch.where(some, unbiased_var.to(running_var.dtype), running_var)
        running_mean.lerp_(mean.to(running_mean.dtype), factor)
        if running_var is not None:
            running_var.lerp_(unbiased_var.to(running_var.dtype), factor)
