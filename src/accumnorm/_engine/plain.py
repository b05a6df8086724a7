"""Plain accumulation (`bn="micro"`): each micro-batch's forward and backward in turn, BatchNorm per micro-batch."""
from __future__ import annotations

from .step import Step

__all__ = ["plain"]


def plain(step: Step) -> None:
    """Forward and backward of each micro-batch in turn, each drawing from its own random stream."""
    for k in range(len(step.micro_batches)):
        step.rng.begin(k)
        try:
            loss = step.loss(k)
        finally:
            step.rng.end(k)
        step.losses[k] = loss.detach()
        step.weighted(loss, k).backward()
        step.interrupts.check()
