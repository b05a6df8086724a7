"""One BatchNorm call of the whole batch, made from its K micro-batches' pieces: the layerwise schedule's meeting.

The pieces' inputs are concatenated into the whole batch's input, which torch's own `batch_norm` normalizes
(its statistics, backward and running-statistics update, as one forward of the whole batch would make
them; across ranks, `joint.normalize_across_ranks`). Each micro-batch goes on with its rows of the output.
A checkpointed region gives a piece's output again in its recomputation (`Recompute`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..functional import Moments, moments
from .calls import BNCall
from .joint import normalize_across_ranks
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
    in the backward and must neither update the running statistics nor save anything in the region's place (the
    forward's call saved nothing there: it ran in the driver)."""

    def __init__(self, call: BNCall, whole_input: Tensor, stats: Moments | None, requires_grad: bool) -> None:
        self.call, self.whole_input, self.stats, self.requires_grad = call, whole_input, stats, requires_grad

    def __call__(self, x: Tensor) -> Tensor:
        call = self.call
        with torch.no_grad():
            if self.stats is None:  # the whole batch's statistics, as torch's kernel computed them in the forward
                self.stats = moments(self.whole_input)
                self.whole_input = None
            y = normalize_with(x, self.stats.mean, self.stats.var, call.weight, call.bias, call.eps)
        # Not a leaf: the region may go on in place (ReLU(inplace=True)); a clone saves nothing either.
        return y.requires_grad_().clone() if self.requires_grad else y
