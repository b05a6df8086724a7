"""One micro-batch at a time, each BatchNorm call with its micro-batch's statistics (`bn="micro"`).

With a loss per micro-batch: each micro-batch's forward and backward in turn, plain accumulation. With a
whole-batch loss (`forward_fn` and `batch_loss_fn`), GradCache's scheme (Gao et al. 2021), in the memory of
one micro-batch: every micro-batch's forward for its outputs, its graph let go at once; the loss over all of them and
its gradient at each output; then every micro-batch's forward again and its backward from those gradients.
The second forward draws the same random numbers as the first, and its buffer updates are the ones that
count (the first's are undone), so each micro-batch's forward counts once.
"""
from __future__ import annotations

from .outputs import OutputGrads, without_graph
from .step import Step
from .threadstate import autocast_cache_off

__all__ = ["plain"]


def plain(step: Step, exact: bool = False) -> None:
    """Each micro-batch on its own (module doc). `exact`: the step is exact, so each graph is checked for a batch
    norm with batch statistics that the step did not see before its backward."""
    if step.objective.whole:
        _whole_batch_loss(step, exact)
        return
    for k in range(len(step.micro_batches)):
        loss = _forward(step, k)
        if exact:
            step.graphs.check([(k, loss)])
        step.losses[k] = loss.detach()
        step.backward(step.objective.weighted(loss, k))
        step.interrupts.check()


def _forward(step: Step, k: int):
    step.rng.begin(k, restart=True)
    try:
        return step.forward(k)
    finally:
        step.rng.end(k)


def _whole_batch_loss(step: Step, exact: bool) -> None:
    if len(step.micro_batches) == 1:  # the whole batch at once
        outputs = _forward(step, 0)
        if exact:
            step.graphs.check([(0, outputs)])
        loss, scaled = step.objective.loss(outputs)
        step.whole_loss = loss.detach()
        step.backward(scaled)
        return
    outputs = []
    with autocast_cache_off():  # with grad, as the second forward: the functions run as they will there
        for k in range(len(step.micro_batches)):
            outputs.append(without_graph(_forward(step, k)))
            step.interrupts.check()
    step.restore_buffers()
    grads = OutputGrads(outputs, step.backward)
    del outputs
    step.whole_loss = grads.loss(step.objective.loss).detach()
    for k in range(len(step.micro_batches)):
        outputs = _forward(step, k)
        if exact:
            step.graphs.check([(k, outputs)])
        grads.backward(k, outputs)
        step.interrupts.check()
