"""The literature's answers to small-batch BatchNorm, as lazy channels-first layers.

- `BatchRenorm2d` (Ioffe 2017): batch statistics corrected towards the running ones by r and d,
  clipped to r_max / d_max, which warm up from plain BatchNorm (1, 0) to the paper's (3, 5).
- `StaleBatchNorm2d`: normalizes with the whole-batch statistics of the previous optimizer step,
  collected over its micro-batches; a cheap one-step-stale approximation of exact accumulation in
  the spirit of MABN (Yan et al. 2020). Its statistics roll at `accumnorm_step_end()`, which
  `accumnorm.backward` calls after every successful step.

The per-sample ones, FRN and EvoNorm, are in _per_sample.py.

All take (N, C, H, W) inputs, their channel count first (None: lazy, from the first input), and
keep their per-channel tensors as (C,) parameters and buffers, so state_dicts are plain.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parameter import UninitializedParameter, is_lazy

from ._lazy import LazyNormMixin, _UninitializedBuffer, check_num_features

__all__ = ["BatchRenorm2d", "StaleBatchNorm2d", "ChannelNorm", "affine"]


_COUNTERS = ("num_batches_tracked", "step_count")  # a layer's scalar counters, which reset_parameters zeroes


class ChannelNorm(LazyNormMixin, nn.Module):
    """Shared body: (C,) parameters and buffers with constant initial values, 4D input, lazy channels."""

    def __init__(self, num_features: int | None, params: dict[str, float], buffers: dict[str, float],
                 device: Any = None, dtype: torch.dtype | None = None, work: tuple[str, ...] = ()) -> None:
        """`work`: names among `buffers` that are scratch space, left out of the state_dict."""
        num_features = check_num_features(num_features)
        super().__init__()
        self.num_features = num_features
        self._inits = {**params, **buffers}
        factory_kwargs = {"device": device, "dtype": dtype}
        lazy = num_features is None
        for name in params:
            setattr(self, name, UninitializedParameter(**factory_kwargs) if lazy
                    else nn.Parameter(torch.empty(num_features, **factory_kwargs)))
        for name in buffers:
            self.register_buffer(name, _UninitializedBuffer(**factory_kwargs) if lazy
                                 else torch.empty(num_features, **factory_kwargs), persistent=name not in work)
        if not lazy:  # an ordinary module: no lazy hooks
            self._initialize_hook.remove()
            self._load_hook.remove()
        self.reset_parameters()

    def initialize_parameters(self, input: Tensor) -> None:  # type: ignore[override]
        """Called by the lazy pre-forward hook: learn C from the first input; materialize at initial values.

        Tensors that a state_dict loaded before the first forward materialized keep their values and fix C.
        """
        self._check_input_dim(input)
        loaded = [t for t in self.parameters(recurse=False) if not is_lazy(t)]
        c = loaded[0].shape[0] if loaded else input.shape[1]
        with torch.no_grad():
            for name, tensor in [*self._parameters.items(), *self._buffers.items()]:
                if is_lazy(tensor):
                    tensor.materialize((c,))
                    tensor.fill_(self._inits[name])
        self.num_features = c

    def reset_parameters(self) -> None:
        """Every per-channel tensor back to its initial value (nothing to do while lazy), and the counters of the
        training forwards (`num_batches_tracked`, `step_count`) back to 0, as torch's BatchNorm resets its own: a
        renorm's warm-up starts again, a momentum=None average too."""
        with torch.no_grad():
            for name in _COUNTERS:
                counter = self._buffers.get(name)
                if counter is not None:
                    counter.zero_()
            if self.has_uninitialized_params() or self.num_features is None:
                return
            for name, value in self._inits.items():
                getattr(self, name).fill_(value)

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() != 4:
            raise ValueError(f"expected 4D input (got {input.dim()}D input)")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        self._check_channels(input)
        return self._norm(input)

    def _norm(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}"


def affine(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    return x * weight.view(1, -1, 1, 1) + bias.view(1, -1, 1, 1)


class BatchRenorm2d(ChannelNorm):
    """Batch Renormalization (Ioffe 2017) over (N, C, H, W): BatchNorm made to agree with its running statistics.

    In training, y = weight * ((x - mean_B) / std_B * r + d) + bias with r = std_B / std and
    d = (mean_B - mean) / std from the running statistics, clipped to [1/r_max, r_max] and
    [-d_max, d_max] and held constant in the backward. r_max and d_max follow the paper's
    warm-up: (1, 0), which is BatchNorm, for `warmup` updates, then linearly to `r_max` at
    `r_max_at` and `d_max` at `d_max_at` updates (ImageNet in the paper: 5k, 40k, 25k steps).
    The running statistics are torch's BatchNorm's (momentum, unbiased variance); eval uses them.

    NOTE: the warm-up counts training forwards (`num_batches_tracked`, as torch's BatchNorm
    counts them), so under accumulation it advances K times per optimizer step, once per update
    of the running statistics, which is what r and d are measured against.

    Args:
        num_features: channels C, or None to infer them from the first input.
        eps, momentum: as torch's BatchNorm2d (momentum=None: the cumulative average).
        r_max, d_max: the clipping bounds after the warm-up.
        warmup, r_max_at, d_max_at: training forwards at which the bounds start to grow, and reach their final values.

    Shape:
        Input (N, C, H, W), output the same.

    Examples:
        >>> m = BatchRenorm2d(32, warmup=100, r_max_at=800, d_max_at=500)
        >>> y = m(torch.randn(4, 32, 8, 8))
    """

    def __init__(self, num_features: int | None = None, eps: float = 1e-5, momentum: float = 0.1,
                 r_max: float = 3.0, d_max: float = 5.0, warmup: int = 5000, r_max_at: int = 40000,
                 d_max_at: int = 25000, device: Any = None, dtype: torch.dtype | None = None) -> None:
        if not (r_max >= 1 and d_max >= 0 and 0 <= warmup <= min(r_max_at, d_max_at)):
            raise ValueError(f"expected r_max >= 1, d_max >= 0 and 0 <= warmup <= r_max_at, d_max_at, got "
                             f"r_max={r_max}, d_max={d_max}, warmup={warmup}, r_max_at={r_max_at}, d_max_at={d_max_at}")
        super().__init__(num_features, {"weight": 1.0, "bias": 0.0}, {"running_mean": 0.0, "running_var": 1.0},
                         device, dtype)
        self.eps, self.momentum = eps, momentum
        self.r_max, self.d_max, self.warmup, self.r_max_at, self.d_max_at = r_max, d_max, warmup, r_max_at, d_max_at
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device))

    def accumnorm_exact_refusal(self, schedule: str) -> str | None:
        """Why `accumnorm.backward(bn="exact")` cannot make this layer exact: r and d need each batch's statistics."""
        if not self.training:
            return None
        return ("Batch Renormalization corrects the statistics of the batch it sees (its r and d, from its own "
                "var_mean) towards the running ones; bn='exact' cannot give those computations the whole batch. "
                "Train it with bn='micro' (Batch Renormalization is itself an answer to small micro-batches), "
                "or use BatchNorm2d with bn='exact' for the whole batch's statistics")

    def bounds(self) -> tuple[float, float]:
        """(r_max, d_max) now, from the number of training forwards so far."""
        t = int(self.num_batches_tracked)

        def ramp(final: float, start: float, end: int) -> float:
            if t <= self.warmup:
                return start
            return final if t >= end else start + (final - start) * (t - self.warmup) / (end - self.warmup)

        return ramp(self.r_max, 1.0, self.r_max_at), ramp(self.d_max, 0.0, self.d_max_at)

    def _norm(self, x: Tensor) -> Tensor:
        if not self.training:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        if x.numel() == 0:  # as torch's BatchNorm: counted, its running statistics as they were
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
            return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)
        r_max, d_max = self.bounds()
        with torch.no_grad():
            var_b, mean_b = torch.var_mean(x, dim=(0, 2, 3), correction=0)
            std = (self.running_var + self.eps).sqrt()
            r = ((var_b + self.eps).sqrt() / std).clamp(1 / r_max, r_max)
            d = ((mean_b - self.running_mean) / std).clamp(-d_max, d_max)
        # weight * (x_hat * r + d) + bias is batch norm with weight * r and bias + weight * d: torch's kernel,
        # with r and d constants of the backward.
        out = F.batch_norm(x, None, None, self.weight * r, self.bias + self.weight * d, True, 0.0, self.eps)
        with torch.no_grad():
            n = x.numel() // x.shape[1]
            self.num_batches_tracked.add_(1)
            factor = _factor(self.momentum, self.num_batches_tracked)
            self.running_mean.lerp_(mean_b.to(self.running_mean.dtype), factor)
            self.running_var.lerp_((var_b * n / (n - 1)).to(self.running_var.dtype), factor)
        return out

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, r_max={self.r_max}, "
                f"d_max={self.d_max}, warmup={self.warmup}, r_max_at={self.r_max_at}, d_max_at={self.d_max_at}")


class StaleBatchNorm2d(ChannelNorm):
    """BatchNorm with the previous optimizer step's whole-batch statistics: one step stale, exact otherwise.

    Exact accumulation (`accumnorm.backward(bn="exact")`) gives every micro-batch the statistics of
    the whole batch at the price of extra passes. This layer gives it those of the previous step,
    which are known before the step starts: one pass, like plain accumulation. In training it
    normalizes with `stale_mean` / `stale_var` (constants of the backward, as in MABN), adds the
    moments of each micro-batch it sees, and `accumnorm_step_end()` (called by
    `accumnorm.backward` after a successful step; call it yourself in a plain loop, after the
    step's last forward) makes the whole batch's moments the ones used next, and updates the
    running statistics once, as torch's BatchNorm over the whole batch would. Before the first step
    ends the stale statistics are (0, 1): the first step is not normalized. Eval uses the running
    statistics.

    NOTE: unlike BatchNorm, no gradient flows through the statistics (they come from an earlier
    step); each micro-batch must go through the layer once per step for the moments to be the
    whole batch's.

    Args:
        num_features: channels C, or None to infer them from the first input.
        eps, momentum: as torch's BatchNorm2d (momentum of the running statistics, per step; None: their
            cumulative average over the steps).

    Shape:
        Input (N, C, H, W), output the same.

    Examples:
        >>> m = StaleBatchNorm2d(32)
        >>> for micro_batch in torch.randn(16, 32, 8, 8).split(4):
        ...     y = m(micro_batch)
        >>> m.accumnorm_step_end()  # stale_mean / stale_var are now the 16 samples' statistics
    """

    def __init__(self, num_features: int | None = None, eps: float = 1e-5, momentum: float = 0.1,
                 device: Any = None, dtype: torch.dtype | None = None) -> None:
        stats = {"running_mean": 0.0, "running_var": 1.0, "stale_mean": 0.0, "stale_var": 1.0}
        # step_*: the moments of the step so far (count, mean, sum of squared deviations), scratch, not state.
        super().__init__(num_features, {"weight": 1.0, "bias": 0.0}, {**stats, "step_mean": 0.0, "step_m2": 0.0},
                         device, dtype, work=("step_mean", "step_m2"))
        self.eps, self.momentum = eps, momentum
        self.register_buffer("step_count", torch.tensor(0, dtype=torch.long, device=device), persistent=False)
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device))

    def _norm(self, x: Tensor) -> Tensor:
        if not self.training:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        n = x.numel() // x.shape[1]
        if n:  # an empty batch adds no moments
            with torch.no_grad():  # Chan et al.'s pairwise update: the step's moments without a sum of squares
                var, mean = torch.var_mean(x, dim=(0, 2, 3), correction=0)
                total = int(self.step_count) + n
                delta = mean - self.step_mean
                self.step_m2.add_(var * n + delta.square() * (int(self.step_count) * n / total))
                self.step_mean.add_(delta * (n / total))
                self.step_count.fill_(total)
        # Eval-mode batch_norm: normalize with given statistics, no gradient through them.
        return F.batch_norm(x, self.stale_mean, self.stale_var, self.weight, self.bias, False, 0.0, self.eps)

    def accumnorm_exact_refusal(self, schedule: str) -> str | None:
        """Under passes each micro-batch's forward runs 2L + 1 times: this layer would add its moments as often."""
        if self.training and schedule == "passes":
            return ("it adds the moments of every forward it sees, and the passes schedule runs each micro-batch's "
                    "forward 2L + 1 times; use schedule='layerwise' or bn='micro'")
        return None

    @torch.no_grad()
    def accumnorm_step_end(self) -> None:
        """The step's whole-batch statistics become the ones the next step normalizes with; a no-op without forwards."""
        n = int(self.step_count)
        if n == 0:
            return  # idempotent: a second call in the same step changes nothing
        self.stale_mean.copy_(self.step_mean)
        self.stale_var.copy_(self.step_m2 / n)
        self.num_batches_tracked.add_(1)
        factor = _factor(self.momentum, self.num_batches_tracked)
        self.running_mean.lerp_(self.step_mean, factor)
        self.running_var.lerp_(self.step_m2 / max(n - 1, 1), factor)
        self.step_count.zero_()
        self.step_mean.zero_()
        self.step_m2.zero_()

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}"


def _factor(momentum: float | None, tracked: Tensor) -> float:
    """How far the running statistics move to a batch's, as torch's BatchNorm moves them: by `momentum`, or with
    momentum=None by 1 / the updates counted so far (this one included), their cumulative average."""
    return momentum if momentum is not None else 1.0 / float(tracked)
