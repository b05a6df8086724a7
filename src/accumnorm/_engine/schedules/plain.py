"""One micro-batch at a time, each BatchNorm call with its micro-batch's statistics (`bn="micro"`).

With a loss per micro-batch: each micro-batch's forward and backward in turn, plain accumulation. With a
whole-batch loss (`forward_fn` and `batch_loss_fn`), GradCache's scheme (Gao et al. 2021), in the memory of
one micro-batch: every micro-batch's forward for its outputs, its graph let go at once; the loss over all of them and
its gradient at each output; then every micro-batch's forward again and its backward from those gradients.
The second forward draws the same random numbers as the first, and its buffer updates are the ones that
count (the first's are undone), so each micro-batch's forward counts once.
"""
from __future__ import annotations

from ..memory.budget import Meter
from ..memory.store import Store
from ..safety.threadstate import autocast_cache_off
from ..step.outputs import OutputGrads, without_graph
from ..step.step import Step
from .base import Schedule

__all__ = ["Plain"]


class Plain(Schedule):
    """Each micro-batch on its own (module doc); saved tensors stay where they are made (`store` is not used). In
    exact mode each graph is checked for a batch norm with batch statistics that the step did not see before its
    backward: the schedule is exact for a model without one."""

    name = "plain"
    exact = False

    def run(self, step: Step, store: Store | Meter | None) -> None:
        if step.objective.whole:
            _whole_batch_loss(step, step.exact)
            return
        for k in range(len(step.micro_batches)):
            loss = _forward(step, k)
            if step.exact:
                step.graphs.check([(k, loss)])
            step.losses.micro[k] = loss.detach()
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
        loss, scaled = step.whole_loss(lambda: step.objective.loss(outputs))
        step.losses.whole = loss.detach()
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
    step.losses.whole = step.whole_loss(lambda: grads.loss(step.objective.loss)).detach()
    for k in range(len(step.micro_batches)):
        outputs = _forward(step, k)
        if exact:
            step.graphs.check([(k, outputs)])
        grads.backward(k, outputs)
        step.interrupts.check()
