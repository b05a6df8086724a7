"""The passes schedule: exact BatchNorm in 2L + 1 passes over the micro-batches, recomputing everything.

A BN call's statistics depend on every BN call below it, and its backward sums, sum(dy) and
sum(dy * x_hat), on every BN call above it. With L BN calls and nothing kept between passes:

  1. L statistics passes, bottom up: pass j runs the forward up to call j (calls below use their
     now-known whole-batch statistics), adds each micro-batch's moments there, and stops. An InstanceNorm
     call that tracks running statistics gets a pass of its own, to fix how its call moves them: the
     passes after it find them moved at the call, as a read after it in whole-batch torch does.
  2. Backward sums, top down. Calls t..L-1 (the top ones) each get a "sums pass": forward with grad
     from call j up, backward down to call j's input, where its sums are added up.
  3. One full pass: forward and backward of every micro-batch, accumulating parameter gradients.
     Calls >= t back-propagate exactly (their sums are known); calls < t back-propagate only
     weight * invstd * dy and add their sums (not yet complete: the corrections below feed them).
  4. Correction passes for calls t-1..0, top down: once call j's sums are complete, its missing
     backward term, -weight * invstd * (sum(dy) + x_hat * sum(dy * x_hat)) / N, is a known function
     of the micro-batch's own input. Each pass runs the forward up to call j and back-propagates that
     term from there (gradients are linear, so adding it later is exact), adding to the sums below.

That is 2L + 1 passes, the fewest a micro-batch-at-a-time schedule allows (a whole-batch loss adds one: every
micro-batch's outputs, for the loss's gradient at each; so does each InstanceNorm call that tracks running
statistics). A sums pass costs the network above its call, a correction pass the part below, so the split `t`
puts the bottom half under corrections (t = 0 with a module's full backward hook, which sees no gradient that
enters the module's input without passing its output, as a correction does). Memory stays that of one
micro-batch. Every pass replays the micro-batch's random numbers and the modules' attributes as the step found
them (a flag loss_fn sets is not read by the next run), and runs with grad, as one forward would; a backward
inside a forward that reaches a BN call, or the parameters before the full pass, would count once per pass:
refused.
"""
from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ...functional import Moments, moments
from ..bn.normalize import GradSums, invstd, normalize, normalize_with, scale
from ..checkpointing.again import tensor_leaves
from ..checkpointing.frames import end_recomputations_here
from ..intercept.calls import BNCall, INCall, StopPass
from ..intercept.guards import backward_hooked
from ..memory.budget import Meter
from ..memory.store import Store
from ..safety.attributes import ModuleAttributes
from ..safety.graphs import holds_user_functions
from ..safety.threadstate import autocast_cache_off
from ..step.outputs import OutputGrads, without_graph
from ..step.running import RunningStatistics
from ..step.step import Step
from .base import Schedule
from .passes_refusals import (
    SameRuns,
    another_input,
    another_result,
    not_the_same,
    stop_caught,
    torchs_refusals_said,
    whole_batch_call,
)

__all__ = ["Passes"]


# What `_forward` returns for a forward that a truncated pass stopped (not None: a forward_fn may return None).
_STOPPED = object()


class _PassCall:
    """One BatchNorm call of the forward: its whole-batch statistics and backward sums."""

    def __init__(self, first: BNCall) -> None:
        self.first = first  # micro-batch 0's piece of the call, as the statistics pass met it
        self.parts: list[Moments] = []  # per-micro-batch moments during its statistics pass
        self.rows = 0  # and the samples they come from
        self.sums: GradSums | None = None
        self.input: Tensor | None = None  # the BN input of the current micro-batch, for sums/correction passes
        self.running: tuple[Tensor, Tensor | None] | None = None  # its running statistics once it moved them

    @property
    def stats(self) -> Moments:
        return self.first.stats


class _Passes:
    STATS, SUMS, FULL, CORRECT = "stats", "sums", "full", "correct"

    def __init__(self, step: Step, meter: Meter | None = None) -> None:
        self.step, self.meter = step, meter  # "auto"'s, which counts what one full pass keeps (`Meter.next_pass`)
        self.calls: list[_PassCall] = []
        self.mode, self.target = self.STATS, 0
        self.k = 0  # the micro-batch being run
        self.index = 0  # BN calls seen so far in its current forward
        self.instance_norms = 0  # InstanceNorm calls seen so far in its current forward
        # the running statistics after each InstanceNorm call whose pieces are all in (`_statistics`), and whether the
        # current micro-batch's statistics pass stopped at the next one
        self.moved_instance_norms: list[tuple[Tensor, Tensor | None] | None] = []
        self.at_instance_norm = False
        self.finding = False  # whether the statistics passes run, which find the calls: one deeper per pass
        self.grads: OutputGrads | None = None  # with a whole-batch loss, its gradient at every output
        self.forwarding = False  # whether a micro-batch's forward (loss_fn, forward_fn) is running
        self.stopped = False  # whether the pass stopped the current forward (`_stop`)
        self.runs = SameRuns(len(step.micro_batches))  # each micro-batch's BatchNorm inputs and loss, as its first run
        self.running = RunningStatistics(step.ledger, step.names)
        self.user_functions = False  # whether a complete forward's graph holds a custom autograd.Function of yours

    def run(self) -> None:
        with self.step.norm_calls(self._batch_norm, self._instance_norm), autocast_cache_off(), self.running, \
                torchs_refusals_said():
            self.finding = True
            self._statistics()
            self.finding = False
            finished = None  # the modules' attributes as whole-batch torch's one run leaves them, for after the step
            if self.step.objective.whole:
                self._output_gradients()
                finished = ModuleAttributes(self.step.modules)  # every forward, and the loss over all their outputs
            # The bottom half gets correction passes; with a backward hook in the model, none does: a module's full
            # backward hook sees no gradient that enters the module's input without leaving its output, as a
            # correction does, and a hook that clamps a gradient would clamp its parts (`backward_hooked`).
            hooked = backward_hooked(self.step.modules, self.step.watch.tensor_hooks or self.user_functions)
            t = 0 if hooked else len(self.calls) // 2
            for j in reversed(range(t, len(self.calls))):
                self._sums_pass(j)
            self._full_pass(t)
            if finished is None:
                finished = ModuleAttributes(self.step.modules)  # as the last complete run (forward and loss) left them
            for j in reversed(range(t)):
                self._finish_sums(self.calls[j])
                self._correction_pass(j)
            finished.restore()

    # ---------------------------------------------------------------- what each BatchNorm call does
    def _batch_norm(self, bn: BNCall) -> Tensor:
        if not self.forwarding:  # in batch_loss_fn, over the whole batch's outputs: torch's call, as under layerwise
            return whole_batch_call(bn, self.step.describe(bn))
        i, self.index = self.index, self.index + 1
        if i == len(self.calls) and self.finding and i == self.target:
            # The first time a forward gets this deep: a new call (its input without the graph below, which goes).
            self.calls.append(_PassCall(dataclasses.replace(bn, input=bn.input.detach())))
        if i >= len(self.calls):
            raise not_the_same(self.k, f"BatchNorm call {i} ({self.step.describe(bn)})", len(self.calls))
        call = self.calls[i]
        # Each micro-batch's forward is its own call of torch's, but they are pieces of one call of the whole batch:
        # autocast and the grad mode must agree (a piece under no_grad would leave its rows out of the call's backward
        # sums, which no whole batch can).
        self.step.meeting.check_same([call.first, bn], i, micro_batches=(0, self.k))
        y = self._normalized(call, i, bn)
        self.running.moved(call.first, call.running)
        if y.grad_fn is not None:  # a backward through it from inside a forward is refused (`_inner_backward`)
            y.grad_fn.register_prehook(self.step.inner_backward_refusal(bn, i, lambda: self.k if self.forwarding
                                                                           else None))
        return y

    def _normalized(self, call: _PassCall, i: int, bn: BNCall) -> Tensor:
        """Call i's output in the current pass (or StopPass at the pass's target)."""
        x, w, b, eps = bn.input, bn.weight, bn.bias, bn.eps
        if (i == self.target or self.mode == self.FULL) and not self.runs.same(i, self.k, [x]):
            raise another_input(self.k, i, self.step.describe(call.first))
        mean, var = (None, None) if call.stats is None else (call.stats.mean, call.stats.var)
        if i == self.target and self.mode in (self.STATS, self.CORRECT):
            if self.mode == self.STATS:
                call.parts.append(moments(x.detach()))
                call.rows += x.shape[0]
            else:
                call.input = x
                end_recomputations_here()  # the backward starts from x: no recomputation goes past this call
            self._stop()
        if self.mode == self.STATS or (self.mode == self.SUMS and i < self.target):
            def output(x: Tensor) -> Tensor:
                return normalize_with(x, mean, var, w, b, eps)
        elif self.mode == self.SUMS and i == self.target:
            grad = torch.is_grad_enabled()

            def output(x: Tensor) -> Tensor:
                return normalize(x.detach().requires_grad_(grad), mean, var, w, b, eps, call.sums)

            # Back-propagation stops at this detached input: the pass only wants this call's sums.
            call.input = x.detach().requires_grad_(grad)
            y = normalize(call.input, mean, var, w, b, eps, call.sums)
            self.step.regions.enter_forward_call(output)
            return y
        else:
            def output(x: Tensor) -> Tensor:
                return normalize(x, mean, var, w, b, eps, call.sums)

        if self.mode != self.STATS:  # a pass that back-propagates: a checkpointed region's recomputation replays it
            self.step.regions.enter_forward_call(output)
        return output(x)

    def _instance_norm(self, call: INCall) -> Tensor:
        if not self.forwarding and call.module is None:  # a layer outside the model in batch_loss_fn: torch's call
            return F.instance_norm(call.input, call.running_mean, call.running_var, call.weight, call.bias, True,
                                   call.momentum, call.eps)
        if not self.forwarding:  # the model's, in batch_loss_fn: moved after the forward's calls, at the step's end
            self.running.moved(call, self._moved_by(self.step.ledger.instance_norm_of_the_batch(call, self.step.names)))
            return call.output()
        n, self.instance_norms = self.instance_norms, self.instance_norms + 1
        if n == len(self.moved_instance_norms):  # a call not every micro-batch has made yet: a statistics pass's stop
            if not self.finding:
                raise not_the_same(self.k, f"InstanceNorm call {n} ({self.step.describe(call)})",
                                   f"{n} InstanceNorm calls")
            self.step.ledger.instance_norm(call, n, self.step.names)
            self.at_instance_norm = True
            self._stop()
        self.step.ledger.check_instance_norm(call, n, self.step.names)
        self.running.moved(call, self.moved_instance_norms[n])  # a later read finds them moved, as torch's call does
        if self.mode != self.STATS:  # a pass that back-propagates: a checkpointed region's recomputation replays it
            self.step.regions.enter_instance_norm()
        return call.output()

    # ---------------------------------------------------------------- the passes
    def _each(self):
        """Each micro-batch index, with its random numbers from the start, the call counters reset and the modules'
        attributes as the step found them."""
        for k in range(len(self.step.micro_batches)):
            self.k, self.index, self.instance_norms = k, 0, 0
            if self.meter is not None:
                self.meter.next_pass()
            self.running.restore()
            self.step.attributes.restore()
            self.step.rng.begin(k, restart=True)
            try:
                yield k
            finally:
                self.step.rng.end(k)
            self.step.interrupts.check()
            self.step.bound.check()  # what the micro-batch's pass freed, once the step nears its budget (`memory.heap`)

    def _stop(self) -> None:
        """End the current forward at this call (a truncated pass's target)."""
        self.stopped = True
        raise StopPass

    def _forward(self, k: int) -> Any:
        """Micro-batch k's forward (its loss, or its outputs); _STOPPED if a truncated pass stopped it at its target."""
        self.forwarding, self.stopped = True, False
        try:
            with self.step.gradients_aside("each micro-batch's forward once per pass"):
                loss = self.step.forward(k)
        except StopPass:
            return _STOPPED
        except BaseException as e:  # as layerwise says it: where it happened
            e.add_note(f"(raised in micro-batch {k} of accumnorm.backward)")
            raise
        finally:
            self.forwarding = False
        if self.stopped:  # a function of the user's caught the stop and went on
            raise stop_caught(k)
        if self.index != len(self.calls):
            raise not_the_same(k, f"{self.index} BatchNorm calls", len(self.calls))
        if not self.runs.same(None, k, tensor_leaves(loss)):
            raise another_result(k, "outputs" if self.step.objective.whole else "loss")
        return loss

    def _statistics(self) -> None:
        """Passes 1..L: whole-batch statistics, one call deeper per pass, until a forward completes (and a pass to each
        InstanceNorm call that tracks running statistics, whose move a later read must find at the call)."""
        while True:
            j = len(self.calls)
            self.mode, self.target = self.STATS, j
            stops = []  # whether each micro-batch stopped at an InstanceNorm call (else at call j)
            for k in self._each():
                self.at_instance_norm = False
                result = self._forward(k)
                if result is not _STOPPED:  # micro-batch 0 never reached call j: there are j
                    if k:
                        raise not_the_same(k, "no more calls", self._next_call(stops[0]))
                    self.user_functions = holds_user_functions(tensor_leaves(result))
                    return
                stops.append(self.at_instance_norm)
                if stops[k] != stops[0]:
                    raise not_the_same(k, self._next_call(stops[k]), self._next_call(stops[0]))
            if stops[0]:  # the pass stopped at an InstanceNorm call that tracks running statistics: its move is known
                self.moved_instance_norms.append(self._moved_by(len(self.moved_instance_norms)))
                continue
            call = self.calls[j]
            self.step.meeting.check_count(call.rows, call.first.input.shape)
            call.first.stats = self.step.meeting.joint_moments(call.parts)
            factor = self.step.ledger.record(call.first, call.first.stats)
            call.running = self.running.after(call.first, call.first.stats, factor)
            call.parts = []
            call.sums = GradSums(call.stats.mean.shape[0], call.stats.count)

    def _next_call(self, at_instance_norm: bool) -> str:
        """The call a statistics pass stopped a micro-batch at, for a refusal."""
        if at_instance_norm:
            return f"InstanceNorm call {len(self.moved_instance_norms)} next"
        return f"BatchNorm call {self.target} next"

    def _moved_by(self, n: int) -> tuple[Tensor, Tensor | None] | None:
        """The running statistics after the ledger's InstanceNorm call n, every micro-batch's piece of it in."""
        return self.running.after_instance_norm(self.step.ledger.instance_norms[n].call,
                                                *self.step.ledger.instance_norm_statistics(n))

    def _output_gradients(self) -> None:
        """With a whole-batch loss: every micro-batch's outputs (no graph, every call with its statistics), the loss
        over all of them, and its gradient at each micro-batch's outputs, from which its backwards start."""
        self.mode, self.target = self.STATS, len(self.calls)  # no call is the target: every forward completes
        self.grads = OutputGrads([without_graph(self._forward(k)) for k in self._each()], self.step.backward)
        self.step.losses.whole = self.step.whole_loss(lambda: self.grads.loss(self.step.objective.loss)).detach()
        if self.meter is not None:  # every pass after this one holds the outputs and their gradients
            self.meter.hold([t for leaf in self.grads.leaves for t in (leaf, leaf.grad) if t is not None])

    def _backward_from(self, k: int, result: Any, inputs: list[Tensor] | None = None) -> None:
        """Micro-batch k's backward from its loss (weighted) or its outputs (with their gradients)."""
        if self.step.objective.whole:
            self.grads.backward(k, result, inputs)
        else:
            self.step.backward(self.step.objective.weighted(result, k), inputs=inputs)

    def _finish_sums(self, call: _PassCall) -> None:
        """Call's sums are complete on this rank: reduce them across ranks and switch it to exact backward."""
        call.sums.finish(self.step.collectives.sum_)

    def _sums_pass(self, j: int) -> None:
        self.mode, self.target = self.SUMS, j
        call = self.calls[j]
        for k in self._each():
            result = self._forward(k)
            # Only the sums (collected by the call's backward) matter, not the gradient itself.
            if call.input.requires_grad:
                self._backward_from(k, result, inputs=[call.input])
        call.input = None
        self._finish_sums(call)

    def _full_pass(self, t: int) -> None:
        self.mode, self.target = self.FULL, t
        # Of every pass, the full one's forward keeps most (the others run part of it): the meter counts it alone.
        with self.meter.hooks() if self.meter is not None else nullcontext():
            for k in self._each():
                result = self._forward(k)
                if not self.step.objective.whole:
                    self.step.losses.micro[k] = result.detach()
                self.step.graphs.check([(k, result)])  # a batch norm the passes did not make
                self._backward_from(k, result)

    def _correction_pass(self, j: int) -> None:
        self.mode, self.target = self.CORRECT, j
        call = self.calls[j]
        if not call.sums.reached:  # no loss reaches the call: nothing to correct, as nothing went back through it
            return
        first = call.first
        for k in self._each():
            self._forward(k)
            self.running.finish()  # the backward finds them as after the whole forward, not the pass stopped at j
            x, call.input = call.input, None
            if not x.requires_grad:  # nothing below this call learns: no correction to send down
                return
            mean, inv = call.stats.mean, invstd(call.stats.var, first.eps)
            correction = call.sums.correction(x.detach().to(mean.dtype), mean, inv, scale(inv, first.weight))
            self.step.backward(x, [correction.to(x.dtype)])


class Passes(Schedule):
    """Exact BatchNorm by the 2L + 1 passes of the module doc, in the memory of one micro-batch. It keeps nothing
    beyond one micro-batch's forward, so "auto" runs it as its last resort; a `Meter` (`store`, else unused) counts
    what each micro-batch's full pass keeps, and stops the step where even that passes the budget."""

    name = "passes"
    metered = False
    backward_once = False

    def run(self, step: Step, store: Store | Meter | None) -> None:
        try:
            step.bound.start()
            _Passes(step, store if isinstance(store, Meter) else None).run()
        finally:
            step.bound.close()
            step.graphs.clear()
