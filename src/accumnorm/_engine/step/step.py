"""One `accumnorm.backward` call as its schedule runs it: the micro-batches, what they minimize, and its parts.

A schedule runs each micro-batch's `forward(k)` (its loss, or its outputs for a whole-batch loss) under the
step's TorchFunctionMode (`norm_calls`), fills `losses`, and in exact mode meets the micro-batches at each
BatchNorm call through the step's `meeting` (the round protocol), whose calls the `ledger` counts for the
running-statistics update at the end. `graphs` checks the K graphs before their backward; `regions` makes the
calls inside checkpointed regions exact in their recomputation. What the step refuses of the user's functions
while its forwards run (a backward inside them) is here too.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.nn as nn
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from ..._dist import Collectives
from ..checkpointing.recorded import RecordedRegions
from ..intercept.calls import BNCall, INCall, NormCalls, Watch, describe, describe_layer
from ..memory.heap import ResidentBound
from ..safety.attributes import ModuleAttributes
from ..safety.graphs import Graphs
from ..safety.interrupts import SigintDeferred
from ..safety.rng import StepRng
from ..safety.threadstate import close_checkpoints_left_open
from ..safety.transaction import Transaction
from ..safety.tree import Names
from .ledger import Ledger
from .meeting import Meeting
from .objective import BatchLoss, Losses, MicroBatchLoss

__all__ = ["Step", "StepCall"]


@dataclass(frozen=True, eq=False)
class StepCall:
    """What one `accumnorm.backward` call asks for: the model, its micro-batches, what they minimize, over which
    ranks, whether BatchNorm is exact (`bn="exact"`) or each micro-batch's own, and the process's resident memory
    under the call's budget, from where it was when the call began (`memory.heap`)."""

    model: nn.Module
    micro_batches: list[Any]
    objective: MicroBatchLoss | BatchLoss
    collectives: Collectives
    exact: bool
    bound: ResidentBound


class Step:
    """One run of a `StepCall` by a schedule (module doc), inside the call's `transaction`, with its micro-batches'
    random streams (`rng`) and Ctrl-C taken at the schedule's safe points (`interrupts.check()`)."""

    def __init__(self, call: StepCall, transaction: Transaction, rng: StepRng, interrupts: SigintDeferred,
                 attributes: ModuleAttributes) -> None:
        self.model, self.micro_batches, self.objective = call.model, call.micro_batches, call.objective
        self.collectives, self.exact = call.collectives, call.exact
        # The process's resident memory under the call's budget, on the CPU (`memory.heap`): started by the
        # lockstep, checked at each of its turns and before each region's recomputation in the backward.
        self.bound = call.bound
        self.rng, self.interrupts = rng, interrupts
        self.restore_buffers = transaction.restore_buffers  # undoes what a forward did to the buffers (run twice)
        self.transaction = transaction
        self.attributes = attributes  # the modules' attributes as the schedule's forwards find them, for a run again
        self.join = transaction.join  # leaves a backward of the step's own will reach: those outside the model join
        self.modules = transaction.names  # every module of the model, once, with its name (`tree.module_names`)
        self.parameters = transaction.all_params  # every parameter of those modules, once (`tree.parameters`)
        self.names = Names(self.modules)
        # The transaction's copies, which nothing writes: each BatchNorm's num_batches_tracked before the step.
        self.ledger = Ledger({m: saved for m, name, _, saved in transaction.buffers
                              if name == "num_batches_tracked" and isinstance(m, _BatchNorm)}, self.collectives)
        self.meeting = Meeting(self.collectives, self.ledger, self.names)
        self.losses = Losses(self.objective, self.collectives, len(self.micro_batches))
        self.graphs = Graphs(self.model, self.micro_batches)  # who made which node of the K graphs, checked first
        # Each buffer's module: a call's running statistics name the layer it belongs to.
        owners = {id(b): m for m in self.modules for b in m._buffers.values() if b is not None}
        self.watch = Watch(owners, Step.forward.__code__, self.ledger.seen, self.ledger.tracked_versions,
                           self.graphs)
        self.regions = RecordedRegions(self.watch, self.bound)

    def norm_calls(self, on_batch_norm: Callable[[BNCall], Tensor], on_instance_norm: Callable[[INCall], Tensor],
                   once: bool = False) -> NormCalls:
        """The TorchFunctionMode that sends this step's norm calls to a schedule's handlers. `once`: the schedule
        runs each micro-batch's forward once, with its graph (a gradient of one micro-batch's loss is the whole
        batch's when it is the only one)."""
        mode = NormCalls(on_batch_norm, on_instance_norm, self.watch, gradients=once and len(self.micro_batches) == 1)
        self.regions.attach(mode)
        return mode

    def forward(self, k: int) -> Any:
        """Micro-batch k's forward: its loss (checked), or its outputs for a whole-batch loss."""
        try:
            return self.objective.forward(self.model, self.micro_batches[k], k)
        except BaseException as e:
            close_checkpoints_left_open(e)
            raise

    def backward(self, tensors: Tensor | Sequence[Tensor], grad_tensors: Sequence[Tensor] | None = None,
                 inputs: Sequence[Tensor] | None = None) -> None:
        """torch.autograd.backward, for every backward a schedule runs: the leaves it reaches outside the model join
        the step's transaction first, and what it draws comes from the open turn's stream or the step's own."""
        with self.rng.outside_turns():
            self.transaction.backward(tensors, grad_tensors, inputs)

    def whole_loss(self, loss: Callable[[], Any]) -> Any:
        """`loss()`, a loss over the whole batch's outputs, drawing from the step's own stream (`rng.outside_turns`)."""
        with self.rng.outside_turns():
            return loss()

    def inner_backward_refusal(self, call: BNCall, index: int, running: Callable[[], int | None],
                               alone: bool = False) -> Callable[[Any], None]:
        """A prehook for the backward node of BatchNorm call `index`'s output that refuses a backward through it while
        a micro-batch's forward runs (`running()`: that micro-batch, or None): that backward would need every
        micro-batch's gradient at the call's output, and has only the one micro-batch's; or (`alone`: the only
        micro-batch) the call keeps its input in checkpointed regions, for one backward: the step's. (It holds the
        call's layer and channels, not the call, whose input the graph need not keep.)"""
        layer, channels = call.module, call.input.shape[1]

        def refuse(grad_outputs: Any) -> None:
            k = running()
            if k is not None:
                what = describe_layer(layer, channels, self.names)
                why = ("That call keeps its input in checkpointed regions, where the step's one backward takes it "
                       "back: there is no second backward through it" if alone else
                       "That call's backward is the whole batch's, and needs every micro-batch's gradient at its "
                       "output, which no micro-batch has alone: there is no whole-batch meaning to give it")
                raise ValueError(
                    f"bn='exact': micro-batch {k} ran a backward (a .backward() or torch.autograd.grad in your "
                    f"function) through BatchNorm call {index} ({what}) while the micro-batches' "
                    f"forwards were still running. {why}. Nothing was changed. For a loss of the whole batch's "
                    "outputs use forward_fn and batch_loss_fn; else leave the inner backward out (or, for a gradient "
                    "penalty through BatchNorm, pass bn='micro')")
        return refuse

    def grad_versions(self) -> list[tuple[int, int] | None]:
        """Each parameter's .grad as it is now, for `refuse_grads_changed`."""
        return [None if p.grad is None else (id(p.grad), p.grad._version) for p in self.parameters]

    def refuse_grads_changed(self, before: list[tuple[int, int] | None], runs: str) -> None:
        """Raise if a parameter's .grad changed since `before`, while only the micro-batches' forwards ran: a backward
        inside the user's function, which the step `runs` ("each micro-batch's forward once") where the whole batch
        would run it once."""
        for p, was in zip(self.parameters, before):
            if (None if p.grad is None else (id(p.grad), p.grad._version)) != was:
                name = next(n for n, q in self.model.named_parameters() if q is p)
                raise ValueError(
                    f"bn='exact': a backward inside your function (a .backward() there) changed the .grad of the "
                    f"parameter {name} during the micro-batches' forwards. The step runs {runs}, where the whole "
                    "batch runs your function once, so that gradient would count several times over. Nothing was "
                    "changed. Add that term to the loss you return instead")

    @contextmanager
    def gradients_aside(self, runs: str) -> Iterator[None]:
        """For a forward that runs after some of the step's backwards (the passes schedule's): the gradients they made
        set aside for the block, so that your functions find `.grad` as before any backward of the step, as in the
        whole batch's one forward and under every other schedule (a `zero_grad()` or a clipping there changes nothing
        the step made). A gradient the block makes itself is refused (`refuse_grads_changed`)."""
        held = [(t, t.grad) for t in (*self.transaction.params, *(leaf for leaf, _ in self.transaction.leaves))]
        for t, _ in held:
            t.grad = None
        try:
            before = self.grad_versions()
            yield
            self.refuse_grads_changed(before, runs)
        finally:
            for t, grad in held:
                t.grad = grad

    def describe(self, call: BNCall | INCall) -> str:
        return describe(call, self.names)
