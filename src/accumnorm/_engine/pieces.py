"""A met BatchNorm call inside checkpointed regions: each micro-batch's input kept in that micro-batch's place.

`whole` runs a met call in the driver, outside every region: torch's `batch_norm` on the concatenated input
saves the whole batch's input for its backward, so a checkpointed model would still keep every BatchNorm
input of every micro-batch. When a piece comes from inside a `checkpoint(use_reentrant=False)` region, the
call is instead one autograd.Function over the K pieces (`normalize_pieces`). Its forward is torch's own
`native_batch_norm` on the whole batch (statistics, running-statistics update, output); it saves each piece
with the saved-tensor hooks its micro-batch had at the call, which inside a region keep a placeholder of the
region's checkpoint. The region's recomputation saves the piece again at the same place (`whole.Recompute`
with `keeps_input`), so the backward's unpack gets it back; the backward is torch's `native_batch_norm_backward`
on the recomputed pieces, concatenated, with the forward's mean and inverse standard deviation. Across the
ranks of a process group, the same, with `joint.normalize_across_ranks` run again, differentiably, in the
backward on the recomputed input and the forward's statistics.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..functional import Moments
from .calls import BNCall
from .joint import normalize_across_ranks

__all__ = ["normalize_pieces"]

_native_backward = torch.ops.aten.native_batch_norm_backward


class _Local:
    """The whole batch's normalization on this process: torch's kernels, forward and backward."""

    def __init__(self, call: BNCall, momentum: float | None) -> None:
        self.call, self.momentum = call, momentum
        self.mean = self.invstd = None

    def forward(self, x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
        c = self.call
        y, self.mean, self.invstd = torch.native_batch_norm(x, weight, bias, c.running_mean, c.running_var, True,
                                                            0.0 if self.momentum is None else self.momentum, c.eps)
        return y

    def stats(self, count: int) -> Moments:
        """The forward's statistics as moments (for a recomputation's output)."""
        var = self.invstd.double().pow(-2).sub(self.call.eps).to(self.mean.dtype)
        n = self.mean.new_full((), count)
        return Moments(n, self.mean, var * n)

    def backward(self, x: Tensor, weight: Tensor | None, bias: Tensor | None, dy: Tensor,
                 needs: tuple[bool, bool, bool]) -> tuple[Tensor | None, ...]:
        return _native_backward(dy, x, weight, None, None, self.mean, self.invstd, True, self.call.eps, list(needs))


class _AcrossRanks:
    """The whole batch's normalization over the ranks of a process group (`joint`), with the forward's statistics."""

    def __init__(self, call: BNCall, across_ranks: Callable[[Tensor], Moments],
                 reduce_sums: Callable[[Tensor], Tensor]) -> None:
        self.call, self.across_ranks, self.reduce_sums = call, across_ranks, reduce_sums
        self.moments: Moments | None = None

    def _normalize(self, x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
        return normalize_across_ranks(x, self.moments, weight, bias, self.call.eps, self.reduce_sums)

    def forward(self, x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
        self.moments = self.across_ranks(x)
        return self._normalize(x, weight, bias)

    def stats(self, count: int) -> Moments:
        return self.moments

    def backward(self, x: Tensor, weight: Tensor | None, bias: Tensor | None, dy: Tensor,
                 needs: tuple[bool, bool, bool]) -> tuple[Tensor | None, ...]:
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(need) if t is not None else None
                      for t, need in zip((x, weight, bias), needs)]
            y = self._normalize(*leaves)
            wanted = [t for t in leaves if t is not None and t.requires_grad]
            grads = iter(torch.autograd.grad(y, wanted, dy) if wanted else ())
        return tuple(next(grads) if t is not None and t.requires_grad else None for t in leaves)


def _pack(hooks: tuple[tuple[Any, Any], ...], x: Tensor) -> tuple[Any, Any, int]:
    """Save piece `x` as autograd would where its micro-batch made the call: with the top of its hooks, if any."""
    if hooks:
        pack, unpack = hooks[-1]
        return unpack, pack(x), 0
    return None, x, x._version


def _unpack(saved: tuple[Any, Any, int], k: int) -> Tensor:
    unpack, packed, version = saved
    if unpack is not None:
        return unpack(packed)
    if packed._version != version:
        raise RuntimeError(f"one of the variables needed for gradient computation has been modified by an inplace "
                           f"operation: micro-batch {k}'s input of a BatchNorm call is at version {packed._version}; "
                           f"expected version {version} instead")
    return packed


class _MetCall(torch.autograd.Function):
    """The K pieces of a BatchNorm call normalized as one batch, each kept in its micro-batch's place (module doc)."""

    @staticmethod
    def forward(ctx, norm, hooks, weight, bias, *pieces):  # type: ignore[override]
        x = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        y = norm.forward(x, weight, bias)
        del x
        ctx.norm, ctx.sizes = norm, [p.shape[0] for p in pieces]
        ctx.pieces = [_pack(h, p) for h, p in zip(hooks, pieces)]
        ctx.save_for_backward(weight, bias)
        # Not views: a micro-batch may change its rows in place, as after `whole`'s unsafe split.
        return tuple([y] if len(pieces) == 1 else y.unsafe_split_with_sizes(ctx.sizes))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):  # type: ignore[override]
        saved, ctx.pieces = ctx.pieces, None
        pieces = [_unpack(s, k) for k, s in enumerate(saved)]
        del saved
        weight, bias = ctx.saved_tensors
        x = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        dy = torch.cat([torch.zeros_like(p) if g is None else g for g, p in zip(grads, pieces)])
        del pieces
        needs = (any(ctx.needs_input_grad[4:]), weight is not None and ctx.needs_input_grad[2],
                 bias is not None and ctx.needs_input_grad[3])
        dx, dw, db = ctx.norm.backward(x, weight, bias, dy, needs)
        dxs = [None] * len(ctx.sizes) if dx is None else list(dx.split(ctx.sizes))
        return (None, None, dw if needs[1] else None, db if needs[2] else None, *dxs)


def normalize_pieces(calls: Sequence[BNCall], momentum: float | None,
                     across_ranks: Callable[[Tensor], Moments] | None = None,
                     reduce_sums: Callable[[Tensor], Tensor] | None = None) -> tuple[list[Tensor], Moments]:
    """The K pieces' outputs of one BatchNorm call of the whole batch, each piece's input saved in its micro-batch's
    place (module doc); and the call's statistics, for a region's recomputation."""
    first = calls[0]
    norm = _Local(first, momentum) if across_ranks is None else _AcrossRanks(first, across_ranks, reduce_sums)
    outputs = _MetCall.apply(norm, [c.saved_tensor_hooks for c in calls], first.weight, first.bias,
                             *[c.input for c in calls])
    return list(outputs), norm.stats(sum(c.input.shape[0] for c in calls) * first.input[0, 0].numel())
