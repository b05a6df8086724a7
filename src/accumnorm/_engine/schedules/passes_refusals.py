"""What the passes schedule refuses, and how it says so: each micro-batch's forward runs 2L + 1 times, and must be
the same forward each time; its backwards run on parts of each graph, more than once. And the norm calls it meets
outside the micro-batches' forwards, in batch_loss_fn, which are the whole batch's already: torch's, or refused."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from ..checkpointing.again import CannotCheck, fingerprint, same_outputs
from ..intercept.calls import BNCall

__all__ = ["SameRuns", "another_input", "another_result", "not_the_same", "stop_caught", "torchs_refusals_said",
           "whole_batch_call"]


@contextmanager
def torchs_refusals_said() -> Iterator[None]:
    """torch's errors for what the passes schedule's backwards cannot do, said as what they mean here: a second backward
    through a graph made before the step, and a backward of part of a graph (`inputs=`) through a reentrant
    checkpoint."""
    try:
        yield
    except RuntimeError as e:
        if "use_reentrant=True" in str(e):
            raise ValueError(
                "bn='exact': the passes schedule back-propagates parts of each micro-batch's graph (a backward with "
                "inputs=, down to a BatchNorm call's input), which torch refuses through "
                "torch.utils.checkpoint(..., use_reentrant=True). Nothing was changed. Use "
                "torch.utils.checkpoint(..., use_reentrant=False), or schedule='layerwise', 'recompute' or 'segments', "
                "which back-propagate each micro-batch once") from e
        if "backward through the graph a second time" not in str(e):
            raise
        raise ValueError(
            "bn='exact': the passes schedule back-propagates each micro-batch several times, and a loss_fn's tensor "
            "whose graph was made before the step (a regularizer computed once outside loss_fn, a weight under "
            "torch.nn.utils.parametrize.cached()) was back-propagated a second time. Nothing was changed. Make it "
            "inside loss_fn, or use schedule='layerwise', which runs each forward once") from e


class SameRuns:
    """What each run of a micro-batch's forward must give again: its input to each BatchNorm call and its loss (or
    outputs), against its first run's (`again.same_outputs`). Checked at each pass's target, at every call of the full
    pass, and at the end of every complete run, so that a forward that draws numbers outside torch's generators, reads
    state its earlier runs changed, or loses draws of its stream to another thread, is refused rather than
    back-propagated with the statistics, sums and losses of other runs.

    The first runs' fingerprints are kept in one block per place, a row per micro-batch: one small tensor per call and
    micro-batch was, on a net of small layers, much of what the step itself held."""

    def __init__(self, micro_batches: int) -> None:
        self.micro_batches = micro_batches
        # BatchNorm call, or None (the loss) -> [each micro-batch's first fingerprint there, the rows filled as bits]
        self.first: dict[int | None, list[Any]] = {}
        self.apart: dict[tuple[int | None, int], Tensor] = {}  # one of another shape than micro-batch 0's there

    def same(self, where: int | None, k: int, tensors: list[Tensor]) -> bool:
        """Whether micro-batch k's `tensors` at `where` (a BatchNorm call's index, or None for its loss) are its
        first run's there; the first run's are kept."""
        try:
            seen = self._seen(where, k)
            if seen is None:
                self._keep(where, k, fingerprint(tensors))
                return True
            return same_outputs(tensors, seen)
        except CannotCheck as e:
            what = "loss" if where is None else f"input to BatchNorm call {where}"
            raise ValueError(
                f"bn='exact': the passes schedule runs each micro-batch's forward 2L + 1 times and checks that each "
                f"run gives the same, but micro-batch {k}'s {what} cannot be checked: {e}. Nothing was changed. Use "
                "schedule='layerwise', which runs each forward once") from None

    def _seen(self, where: int | None, k: int) -> Tensor | None:
        block = self.first.get(where)
        if block is not None and block[1] >> k & 1:
            with torch._C.DisableTorchFunction():
                return block[0][k]
        return self.apart.get((where, k))

    def _keep(self, where: int | None, k: int, prints: Tensor) -> None:
        block = self.first.get(where)
        with torch._C.DisableTorchFunction():
            if block is None:
                block = self.first[where] = [prints.new_empty((self.micro_batches, *prints.shape)), 0]
            if block[0].shape[1:] != prints.shape:
                self.apart[(where, k)] = prints
                return
            block[0][k] = prints
        block[1] |= 1 << k


def not_the_same(k: int, made: str, calls: int | str) -> ValueError:
    """The refusal of micro-batch k's forward, which `made` other batch-statistics calls than the first run's
    `calls`."""
    first = "its forward made the first time" if k == 0 else "micro-batch 0 made"
    return ValueError(
        f"bn='exact' needs every micro-batch to make the same BatchNorm and InstanceNorm calls in the same order each "
        f"time its forward runs, but micro-batch {k} made {made} where {first} {calls}. The passes schedule runs "
        "each micro-batch's forward 2L + 1 times: a function that changes the model (model.eval(), a module's "
        "attribute) changes the runs after it. Nothing was changed. Use schedule='layerwise', which runs each "
        "forward once")


def another_input(k: int, i: int, call: str) -> ValueError:
    """The refusal of micro-batch k's forward, which gave BatchNorm call i (`call`, described) another input in a later
    pass than in its first."""
    return ValueError(
        f"bn='exact': micro-batch {k}'s forward gave BatchNorm call {i} ({call}) another input in a later pass than "
        "in its first. The passes schedule runs each micro-batch's forward 2L + 1 times and needs the same forward "
        "each time: random numbers drawn outside torch's generators (Python's random, numpy), state a forward "
        "changes for the next, or draws another thread takes from torch's default generators while the step runs "
        "make each run another. Nothing was changed. Draw from torch's generators (a torch.Generator of its own for "
        "another thread), or use schedule='layerwise', which runs each forward once")


def another_result(k: int, what: str) -> ValueError:
    """The refusal of micro-batch k's forward, which gave another `what` ("loss", "outputs") in a later pass than in
    its first."""
    return ValueError(
        f"bn='exact': micro-batch {k}'s forward gave another {what} in a later pass than in its first, with the same "
        "input at every BatchNorm call. The passes schedule runs each micro-batch's forward 2L + 1 times and "
        "back-propagates several of those runs: they must give one loss. Random numbers drawn outside torch's "
        "generators (Python's random, numpy) or state a forward changes for the next make each run another. Nothing "
        "was changed. Draw from torch's generators, or use schedule='layerwise', which runs each forward once")


def stop_caught(k: int) -> ValueError:
    """The refusal of micro-batch k's forward, which went on after the passes schedule stopped it at a norm call."""
    return ValueError(
        f"bn='exact': micro-batch {k}'s forward went on after the passes schedule stopped it at a norm call: the "
        "schedule stops a forward with an exception of its own, a BaseException as KeyboardInterrupt is, and your "
        "function caught it (an `except BaseException:` or a bare `except:` around the model's call). Nothing was "
        "changed. Catch Exception there, or use schedule='layerwise', which runs each forward once to its end")


def whole_batch_call(bn: BNCall, where: str) -> Tensor:
    """A batch norm in batch_loss_fn, over the whole batch's outputs: torch's call, as under layerwise. One with
    running statistics (`where`: its layer) is refused, as the ledger refuses it under layerwise: the step counts
    every training forward of the model's layers, but for those there."""
    if bn.running_mean is not None:
        raise ValueError(f"bn='exact' met {where} outside the micro-batches' forwards (in batch_loss_fn), where the "
                         "step does not count the training forwards of the model's layers. Nothing was changed. Run "
                         "that layer in the forward, or pass bn='micro'")
    return torch.batch_norm(bn.input, bn.weight, bn.bias, None, None, True, 0.0, bn.eps, torch.backends.cudnn.enabled)
