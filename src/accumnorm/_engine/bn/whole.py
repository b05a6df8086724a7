"""One BatchNorm call of the whole batch, made from its K micro-batches' pieces: their inputs concatenated.

torch's own `batch_norm` normalizes the whole batch's input (its statistics, backward and running-statistics
update, as one forward of the whole batch would make them; across ranks, `ranks.normalize_across_ranks`).
Each micro-batch goes on with its rows of the output. A call whose pieces come from checkpointed regions is
`pieces`' instead, which keeps each piece's input in its region's place rather than the whole batch's.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ...functional import Moments
from .normalize import NormArgs
from .ranks import normalize_across_ranks
from .replay import CallReplay

__all__ = ["normalize_whole"]


def normalize_whole(args: NormArgs, inputs: Sequence[Tensor], momentum: float | None,
                    across_ranks: Callable[[Tensor], Moments] | None = None,
                    reduce_sums: Callable[[Tensor], Tensor] | None = None) -> tuple[list[Tensor], CallReplay]:
    """The K pieces' outputs of one BatchNorm call of the whole batch, and how to give a piece's output again.

    `args`: the call's parameters, buffers and eps; `momentum`: the factor the running statistics move by. Across
    ranks, `across_ranks(x)` gives the statistics of every rank's input (and updates the running statistics later)
    and `reduce_sums` sums the backward's sums.
    """
    x = inputs[0] if len(inputs) == 1 else torch.cat(list(inputs))
    if across_ranks is None:
        stats = None
        y = torch.batch_norm(x, args.weight, args.bias, args.running_mean, args.running_var, True, momentum,
                             args.eps, torch.backends.cudnn.enabled)
    else:
        stats = across_ranks(x)
        y = normalize_across_ranks(x, stats, args.weight, args.bias, args.eps, reduce_sums)
    # Not `split`'s views: a micro-batch may change its rows in place (`ReLU(inplace=True)` after BatchNorm), which
    # autograd refuses on one of several views of one tensor. `unsafe_split` gives each block a version counter of
    # its own, so an in-place change to one invalidates nothing saved of another; the blocks do not overlap, and
    # the whole output is nobody's saved tensor (BatchNorm's backward reads its input), so that is safe here.
    outputs = [y] if len(inputs) == 1 else list(y.unsafe_split_with_sizes([x.shape[0] for x in inputs]))
    return outputs, CallReplay(args, inputs[0], x, stats, y.requires_grad)
