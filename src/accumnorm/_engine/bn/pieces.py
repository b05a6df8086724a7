"""A met BatchNorm call inside checkpointed regions: each micro-batch's input kept in that micro-batch's place.

`whole` runs a met call in the driver, outside every region: torch's `batch_norm` on the concatenated input
saves the whole batch's input for its backward, so a checkpointed model would still keep every BatchNorm
input of every micro-batch. When a piece comes from inside a `checkpoint(use_reentrant=False)` region, the
call is instead one autograd.Function over the K pieces (`normalize_pieces`). Its forward takes the whole batch's
statistics with torch's own statistics kernel on the pieces concatenated (a copy let go of before any output is
made; the kernel also moves the running statistics, as torch's BatchNorm does), and normalizes each piece with them.
It saves each piece with the saved-tensor hooks its micro-batch had at the call, which inside a region keep a
placeholder of the region's checkpoint. The region's recomputation saves the piece again at the same place
(`replay.CallReplay` with `keeps_input`), so the backward's unpack gets it back; the backward is BatchNorm's, with
the forward's mean and inverse standard deviation, over the pieces one at a time (the sums over the whole batch,
then each piece's input gradient), so that it makes no concatenated copy of the whole batch's input or gradient.
Across the ranks of a process group, the same, with `ranks.normalize_across_ranks` run again, differentiably, in
the backward on the recomputed input and the forward's statistics.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ...functional import Moments, _statistics_dtype, moments, update_running_stats_
from .normalize import NormArgs, channel_shape, input_gradient_terms, invstd, normalize_with, scale, sums_term
from .ranks import normalize_across_ranks

__all__ = ["normalize_pieces"]


class _Local:
    """The whole batch's normalization on this process, piece by piece: the statistics from one copy of the whole
    batch's input, made and let go of before the outputs, and no other tensor of the whole batch."""

    def __init__(self, args: NormArgs, momentum: float | None) -> None:
        # Not the call: it holds micro-batch 0's input, which the backward must not find kept here.
        self.running_mean, self.running_var, self.eps = args.running_mean, args.running_var, args.eps
        self.momentum = momentum
        self.moments: Moments | None = None
        self.mean = self.invstd = None

    def forward(self, xs: list[Tensor], weight: Tensor | None, bias: Tensor | None) -> list[Tensor]:
        """Each piece normalized with the whole batch's statistics, the running statistics moved once, as torch's
        would be. The variance normalized with is the moments' own, which a region's recomputation reads again
        (`stats`)."""
        count = sum(x.numel() // x.shape[1] for x in xs)
        # none to move without a factor, or for an empty batch (torch's kernels leave them)
        moving = self.running_mean is not None and self.momentum is not None and count > 0
        moved = False
        if count == 0:
            m = moments(xs[0])
        else:
            mean, var, moved = self._statistics(xs, moving)
            m = Moments(mean.new_full((), count), mean, var * count)
        self.moments, mean, var = m, m.mean, m.var
        self.mean, self.invstd = mean, invstd(var, self.eps)
        if moving and not moved:
            # Through .data, as torch's kernel updates them: their version counters stay, so that an earlier call
            # of the same layer, whose backward saved them (torch's batch_norm does), is not invalidated.
            update_running_stats_(self.running_mean.data, self.running_var.data, mean, m.unbiased_var, self.momentum)
        self.running_mean = self.running_var = None  # moved once, in the forward
        return [normalize_with(x, mean, var, weight, bias, self.eps) for x in xs]

    def _statistics(self, xs: list[Tensor], moving: bool) -> tuple[Tensor, Tensor, bool]:
        """The whole batch's mean and biased variance, and whether the running statistics moved: torch's statistics
        kernel, once, on the pieces concatenated (one op, where merging each piece's statistics takes ten or more: on
        a net of small layers, the call's main cost). It moves the running statistics too, where they are kept in
        the dtype it takes the statistics in (it takes a half-precision input with float32 ones)."""
        dtype = _statistics_dtype(xs[0].dtype)
        rm, rv = self.running_mean, self.running_var
        if moving and rv is not None and rm.dtype == rv.dtype == dtype:
            return *torch.batch_norm_update_stats(_concatenated(xs, xs[0].dtype), rm.data, rv.data, self.momentum), True
        return *torch.batch_norm_update_stats(_concatenated(xs, dtype), None, None, 0.0), False

    def stats(self) -> Moments:
        """The forward's statistics (for a recomputation's output)."""
        return self.moments

    def backward(self, xs: list[Tensor | None], weight: Tensor | None, bias: Tensor | None, dys: list[Tensor],
                 needs: tuple[bool, bool, bool]) -> tuple[Any, ...]:
        """BatchNorm's backward with the forward's mean and invstd, over the pieces one at a time: no tensor of the
        whole batch, and each piece of `xs` let go of (set to None) once its input gradient is made."""
        mean, invstd_, shape = self.mean, self.invstd, channel_shape(xs[0])
        # torch's BatchNorm backward kernel on each piece, asked for its weight and bias gradients alone: the piece's
        # sum(dy * x_hat) and sum(dy) in one pass, with the whole batch's mean and invstd. An empty piece adds
        # nothing (and torch's kernel kills the process on one: SIGFPE).
        sums = [torch.ops.aten.native_batch_norm_backward(dy.to(mean.dtype), x.to(mean.dtype), None, None, None, mean,
                                                          invstd_, True, self.eps, [False, True, True])[1:]
                for x, dy in zip(xs, dys) if x.numel() > 0]
        count = sum(x.numel() // x.shape[1] for x in xs)
        if len(sums) == 1:
            sum_dy_xhat, sum_dy = sums[0]
        elif sums:  # summed over the pieces in two ops
            sum_dy_xhat, sum_dy = torch.stack([s for pair in sums for s in pair]).view(len(sums), 2, -1).sum(0)
        else:
            sum_dy_xhat, sum_dy = torch.zeros_like(mean), torch.zeros_like(mean)
        dw = sum_dy_xhat if needs[1] else None
        db = sum_dy if needs[2] else None
        dxs = None
        if needs[0]:
            scale_ = scale(invstd_, weight)
            slope, offset = input_gradient_terms(mean, invstd_, scale_, sum_dy, sum_dy_xhat, count)
            dxs = []
            for k, dy in enumerate(dys):
                x, xs[k] = xs[k], None
                dxs.append(sums_term(x.to(mean.dtype), slope, offset).addcmul_(dy.to(mean.dtype), scale_.view(shape))
                           .to(x.dtype))
                del x
        return dxs, None if dw is None else dw.to(weight.dtype), None if db is None else db.to(bias.dtype)


def _concatenated(xs: list[Tensor], dtype: torch.dtype) -> Tensor:
    """The pieces as one tensor of `dtype`, in one copy (none for one piece in it already): a half-precision piece's
    float32 statistics read a float32 copy, made by the concatenation itself."""
    if len(xs) == 1:
        return xs[0].to(dtype)
    if xs[0].dtype == dtype:
        return torch.cat(xs)  # in the pieces' memory format
    return torch.cat(xs, out=xs[0].new_empty((sum(x.shape[0] for x in xs), *xs[0].shape[1:]), dtype=dtype))


class _AcrossRanks:
    """The whole batch's normalization over the ranks of a process group (`ranks`), with the forward's statistics."""

    def __init__(self, args: NormArgs, across_ranks: Callable[[Tensor], Moments],
                 reduce_sums: Callable[[Tensor], Tensor]) -> None:
        self.eps, self.across_ranks, self.reduce_sums = args.eps, across_ranks, reduce_sums
        self.moments: Moments | None = None

    def _normalize(self, x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
        return normalize_across_ranks(x, self.moments, weight, bias, self.eps, self.reduce_sums)

    def forward(self, xs: list[Tensor], weight: Tensor | None, bias: Tensor | None) -> list[Tensor]:
        x = xs[0] if len(xs) == 1 else torch.cat(xs)
        self.moments = self.across_ranks(x)
        y = self._normalize(x, weight, bias)
        # Not views: a micro-batch may change its rows in place, as after `whole`'s unsafe split.
        return [y] if len(xs) == 1 else list(y.unsafe_split_with_sizes([p.shape[0] for p in xs]))

    def stats(self) -> Moments:
        return self.moments

    def backward(self, xs: list[Tensor], weight: Tensor | None, bias: Tensor | None, dys: list[Tensor],
                 needs: tuple[bool, bool, bool]) -> tuple[Any, ...]:
        x, dy = torch.cat(xs), torch.cat(dys)
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(need) if t is not None else None
                      for t, need in zip((x, weight, bias), needs)]
            y = self._normalize(*leaves)
            wanted = [t for t in leaves if t is not None and t.requires_grad]
            grads = iter(torch.autograd.grad(y, wanted, dy) if wanted else ())
        dx, dw, db = (next(grads) if t is not None and t.requires_grad else None for t in leaves)
        return None if dx is None else list(dx.split([p.shape[0] for p in xs])), dw, db


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
        outputs = norm.forward(list(pieces), weight, bias)
        ctx.norm = norm
        ctx.pieces = [_pack(h, p) for h, p in zip(hooks, pieces)]
        ctx.save_for_backward(weight, bias)
        return tuple(outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):  # type: ignore[override]
        saved, ctx.pieces = ctx.pieces, None
        if saved is None:
            raise ValueError(
                "bn='exact': a second backward through a BatchNorm call inside a checkpointed region (a backward "
                "with retain_graph=True before the step's own, in batch_loss_fn or a hook). The step keeps that "
                "call's input in the region's place for one backward, the step's. Nothing was changed. Add that "
                "backward's term to the loss you return instead")
        pieces = [_unpack(s, k) for k, s in enumerate(saved)]
        del saved
        weight, bias = ctx.saved_tensors
        dys = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, pieces)]
        needs = (any(ctx.needs_input_grad[4:]), weight is not None and ctx.needs_input_grad[2],
                 bias is not None and ctx.needs_input_grad[3])
        dxs, dw, db = ctx.norm.backward(pieces, weight, bias, dys, needs)
        return (None, None, dw, db, *([None] * len(pieces) if dxs is None else dxs))


def normalize_pieces(args: NormArgs, inputs: Sequence[Tensor], hooks: Sequence[tuple[tuple[Any, Any], ...]],
                     momentum: float | None, across_ranks: Callable[[Tensor], Moments] | None = None,
                     reduce_sums: Callable[[Tensor], Tensor] | None = None) -> tuple[list[Tensor], Moments]:
    """The K pieces' outputs of one BatchNorm call of the whole batch (`args`: its parameters, buffers and eps), each
    piece of `inputs` saved with its micro-batch's saved-tensor `hooks` at the call (module doc); and the call's
    statistics, for a region's recomputation."""
    norm = _Local(args, momentum) if across_ranks is None else _AcrossRanks(args, across_ranks, reduce_sums)
    outputs = _MetCall.apply(norm, list(hooks), args.weight, args.bias, *inputs)
    return list(outputs), norm.stats()
