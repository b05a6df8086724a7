"""One BatchNorm call of the whole batch, made from its K micro-batches' pieces: the layerwise schedule's meeting.

The pieces' inputs are concatenated into the whole batch's input, which torch's own `batch_norm` normalizes
(its statistics, backward and running-statistics update, as one forward of the whole batch would make
them; across ranks, `joint.normalize_across_ranks`). Each micro-batch goes on with its rows of the output.
A checkpointed region gives a piece's output again in its recomputation (`Recompute`). A call made inside such
regions goes to `pieces`, which keeps each piece's input in its region's place instead of the whole batch's.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..functional import Moments, moments
from .calls import BNCall
from .checkpoint import in_region
from .joint import normalize_across_ranks
from .pieces import normalize_pieces
from .sums import normalize_with

__all__ = ["normalize_whole", "Recompute"]


def normalize_whole(calls: Sequence[BNCall], momentum: float | None,
                    across_ranks: Callable[[Tensor], Moments] | None = None,
                    reduce_sums: Callable[[Tensor], Tensor] | None = None) -> tuple[list[Tensor], Recompute]:
    """The K pieces' outputs of one BatchNorm call of the whole batch, and how to give a piece's output again.

    `momentum`: the factor the running statistics move by. Across ranks, `across_ranks(x)` gives the statistics
    of every rank's input (and updates the running statistics later) and `reduce_sums` sums the backward's sums.
    """
    first = calls[0]
    if any(c.saved_tensor_hooks and in_region(c.saved_tensor_hooks) for c in calls):
        outputs, stats = normalize_pieces(calls, momentum, across_ranks, reduce_sums)
        return outputs, Recompute(first, None, stats, outputs[0].requires_grad, keeps_input=True)
    x = first.input if len(calls) == 1 else torch.cat([c.input for c in calls])
    if across_ranks is None:
        stats = None
        y = torch.batch_norm(x, first.weight, first.bias, first.running_mean, first.running_var, True, momentum,
                             first.eps, torch.backends.cudnn.enabled)
    else:
        stats = across_ranks(x)
        y = normalize_across_ranks(x, stats, first.weight, first.bias, first.eps, reduce_sums)
    # Not `split`'s views: a micro-batch may change its rows in place (`ReLU(inplace=True)` after BatchNorm), which
    # autograd refuses on one of several views of one tensor. `unsafe_split` gives each block a version counter of
    # its own, so an in-place change to one invalidates nothing saved of another; the blocks do not overlap, and
    # the whole output is nobody's saved tensor (BatchNorm's backward reads its input), so that is safe here.
    outputs = [y] if len(calls) == 1 else list(y.unsafe_split_with_sizes([c.input.shape[0] for c in calls]))
    return outputs, Recompute(first, x, stats, y.requires_grad)


class Recompute:
    """A piece's output of a met call, again, from its input: for a checkpointed region's recomputation, which runs
    in the backward and must not update the running statistics. It saves in the region's place what the forward's
    call saved there: nothing when the call ran in the driver (`whole`), the piece's input when it was kept in the
    region's place (`pieces`, `keeps_input`). It holds the call's parameters and statistics, not its input."""

    def __init__(self, call: BNCall, whole_input: Tensor | None, stats: Moments | None, requires_grad: bool,
                 keeps_input: bool = False) -> None:
        self.weight, self.bias, self.eps = call.weight, call.bias, call.eps
        self.shape, self.dtype = call.input.shape[1:], call.input.dtype
        self.whole_input, self.stats, self.requires_grad = whole_input, stats, requires_grad
        self.keeps_input = keeps_input

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
        return normalize_with(x, self.stats.mean, self.stats.var, self.weight, self.bias, self.eps)


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
