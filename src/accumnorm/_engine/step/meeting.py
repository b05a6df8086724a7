"""The round protocol of the exact schedules: K pieces of a BatchNorm call made one call of the whole batch.

The micro-batches of a step must make the same normalization calls in the same order: call j of micro-batch
k is the k-th piece of call j of the whole batch. `check_same` holds them to that (shape past the batch
dimension, dtype, device, parameters, buffers, eps, modes: `sameness`) and says what differs where. `meet`
checks the K pieces and makes them one call of the whole batch (`bn.whole`: their inputs concatenated,
normalized by torch's own `batch_norm`, whole-batch statistics, backward and running-statistics update, as one
forward of the whole batch would make them; `bn.pieces` inside checkpointed regions; across ranks, reduced as
SyncBatchNorm reduces them, `bn.ranks`), and each micro-batch goes on with its rows of the output. A schedule
that meets the calls otherwise (passes) merges the statistics with `joint_moments` and records the call in the
step's ledger.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch.nn as nn
from torch import Tensor

from ..._dist import Collectives
from ...functional import Moments, combine_moments, moments
from ..bn.pieces import normalize_pieces
from ..bn.replay import CallReplay
from ..bn.whole import normalize_whole
from ..checkpointing.frames import in_region, in_segment
from ..intercept.calls import BNCall, describe
from ..safety.threadstate import Modes
from .ledger import Ledger
from .sameness import difference, identical

__all__ = ["Meeting"]


class Meeting:
    """The round protocol of one step (module doc): `names` for its messages, `ledger` to count the calls met."""

    def __init__(self, collectives: Collectives, ledger: Ledger, names: Mapping[nn.Module, str]) -> None:
        self.collectives, self.ledger, self.names = collectives, ledger, names

    def meet(self, calls: Sequence[BNCall], index: int, modes: Modes) -> tuple[list[Tensor], CallReplay]:
        """The K micro-batches' pieces of BatchNorm call `index`, made one call of the whole batch in their modes
        (`modes`: the caller's now): each piece's rows of its output, and how to give a piece's output again from its
        input (for a checkpointed region's recomputation: the whole batch's statistics, no running-statistics
        update, nothing saved). A call whose pieces come from checkpointed regions keeps each piece in its region's
        place (`bn.pieces`), any other concatenates them (`bn.whole`)."""
        self.check_same(calls, index)
        self.check_count(sum(c.input.shape[0] for c in calls), calls[0].input.shape)
        first, ledger = calls[0], self.ledger
        statistics = (first.running_mean, first.running_var)
        ledger.check_statistics_untouched(statistics, self.names, refuse=len(calls) > 1)  # one forward: the batch's
        with first.modes.entered(modes):
            if self.collectives.group is None:
                momentum, across_ranks, reduce_sums = ledger.count_call(first), None, None
            else:
                momentum, reduce_sums = None, self.collectives.sum_

                def across_ranks(x: Tensor) -> Moments:
                    return ledger.move_now(first, self.joint_moments([moments(x)]))
            inputs = [c.input for c in calls]
            if any(c.saved_tensor_hooks and (in_region(c.saved_tensor_hooks) or in_segment(c.saved_tensor_hooks))
                   for c in calls):
                outputs, stats = normalize_pieces(first, inputs, [c.saved_tensor_hooks for c in calls], momentum,
                                                  across_ranks, reduce_sums)
                met = outputs, CallReplay(first, first.input, None, stats, outputs[0].requires_grad, keeps_input=True)
            else:
                met = normalize_whole(first, inputs, momentum, across_ranks, reduce_sums)
        ledger.statistics_written(statistics)
        return met

    def check_same(self, calls: Sequence[BNCall | None], index: int,
                   micro_batches: Sequence[int] | None = None) -> None:
        """Raise, naming what differs and where, unless every micro-batch is at the same BatchNorm call.

        `calls[i]` is micro-batch `micro_batches[i]`'s (default: i's) piece.
        """
        first = calls[0]
        if first is not None and all(call is not None and identical(first, call) for call in calls[1:]):
            return
        for i, call in enumerate(calls[1:], 1):
            problem = difference(first, call, self.names)
            if problem is not None:
                k = micro_batches[i] if micro_batches is not None else i
                theirs = describe(first, self.names) if first is not None else "none (it had ended its forward)"
                raise ValueError(
                    f"bn='exact' needs every micro-batch to make the same BatchNorm calls in the same order, but at "
                    f"BatchNorm call {index} micro-batch {k} {problem} where micro-batch 0 made {theirs}. No schedule "
                    "can join calls that differ into one call of the whole batch. Nothing was changed. Make every "
                    "micro-batch's forward make the same calls (layers, shapes, dtypes, grad mode, autocast), or use "
                    "bn='micro'")

    def check_count(self, rows: int, shape: Sequence[int]) -> None:
        """As torch's BatchNorm: batch statistics need more than one value per channel (in the whole batch of `rows`
        samples, each of `shape` past the batch dimension, as checked by `check_same`), or none at all (an empty
        batch, which leaves the running statistics as they were)."""
        if self.collectives.group is None and rows * math.prod(shape[2:]) == 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size "
                             f"{(rows, *shape[1:])}")

    def joint_moments(self, parts: list[Moments]) -> Moments:
        """The moments of the whole batch (every micro-batch, every rank) from each micro-batch's."""
        return self.collectives.merge_moments(combine_moments(parts))
