"""The passes schedule: exact BatchNorm in 2L + 1 passes over the micro-batches, recomputing everything.

A BN call's statistics depend on every BN call below it, and its backward sums, sum(dy) and
sum(dy * x_hat), on every BN call above it. With L BN calls and nothing kept between passes:

  1. L statistics passes, bottom up: pass j runs the forward up to call j (calls below use their
     now-known whole-batch statistics), adds each micro-batch's moments there, and stops.
  2. Backward sums, top down. Calls t..L-1 (the top ones) each get a "sums pass": forward with grad
     from call j up, backward down to call j's input, where its sums are added up.
  3. One full pass: forward and backward of every micro-batch, accumulating parameter gradients.
     Calls >= t back-propagate exactly (their sums are known); calls < t back-propagate only
     weight * invstd * dy and add their sums (not yet complete: the corrections below feed them).
  4. Correction passes for calls t-1..0, top down: once call j's sums are complete, its missing
     backward term, -weight * invstd * (sum(dy) + x_hat * sum(dy * x_hat)) / N, is a known function
     of the micro-batch's own input. Each pass runs the forward up to call j and back-propagates that
     term from there (gradients are linear, so adding it later is exact), adding to the sums below.

That is 2L + 1 passes (plus one forward of the first micro-batch, which finds where the BN calls
end), the fewest a micro-batch-at-a-time schedule allows. A sums pass costs the part of the network
above its call, a correction pass the part below, so the split `t` puts the bottom half under
corrections. The cost grows linearly with the number of BN calls; memory stays that of one
micro-batch. The layerwise schedule (`accumnorm.schedules.layerwise`) costs about one plain pass
instead, by keeping the whole batch's saved tensors; this one is for when that cannot run.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..functional import GradSums, Moments, moments, normalize, stack_moments
from ..intercept import BatchNormCalls, BNCall
from .step import Step

__all__ = ["passes"]


class _Stop(BaseException):
    """Ends a truncated pass at its target BN call. A BaseException so user `except Exception` won't eat it."""


class _Call:
    """One BatchNorm call of the forward: its whole-batch statistics and backward sums."""

    def __init__(self, first: BNCall) -> None:
        self.first = first  # micro-batch 0's view of the call: its tensors identify the call in later passes
        self.parts: list[Moments] = []  # per-micro-batch moments during its statistics pass
        self.sums: GradSums | None = None
        self.input: Tensor | None = None  # the BN input of the current micro-batch, for sums/correction passes

    @property
    def stats(self) -> Moments:
        return self.first.stats


class _Plan:
    """What each BN call does in the current pass: the handler of `BatchNormCalls`."""

    STATS, SUMS, FULL, CORRECT = "stats", "sums", "full", "correct"

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self.mode = self.STATS
        self.target = 0
        self.index = 0  # BN calls seen so far in the current micro-batch's forward

    def begin(self, mode: str, target: int) -> None:
        self.mode, self.target = mode, target

    def __call__(self, bn: BNCall) -> Tensor:
        i, self.index = self.index, self.index + 1
        if i == len(self.calls) and self.mode == self.STATS and i == self.target:
            self.calls.append(_Call(bn))  # first time the forward gets this deep: a new call
        if i >= len(self.calls) or not self.calls[i].first.same_layer(bn):
            raise ValueError(
                "bn='exact' needs the same sequence of BatchNorm calls in every forward of the step; "
                f"call {i} ({bn.describe()}) differs from the first micro-batch's"
            )
        call, target, x = self.calls[i], self.target, bn.input
        w, b, eps = bn.weight, bn.bias, bn.eps
        if self.mode == self.STATS or (self.mode == self.SUMS and i < target):
            if i == target:
                call.parts.append(moments(x))
                raise _Stop
            return F.batch_norm(x, call.stats.mean, call.stats.var, w, b, False, 0.0, eps)
        if self.mode == self.SUMS and i == target:
            # Back-propagation stops at this detached input: the pass only wants this call's sums.
            call.input = x.detach().requires_grad_()
            torch.set_grad_enabled(True)  # the forward below ran without grad; from here up it is needed
            return normalize(call.input, call.stats.mean, call.stats.var, w, b, eps, call.sums)
        if self.mode == self.CORRECT and i == target:
            call.input = x
            raise _Stop
        return normalize(x, call.stats.mean, call.stats.var, w, b, eps, call.sums)


class _Passes:
    def __init__(self, step: Step) -> None:
        self.step, self.plan = step, _Plan()

    def run(self) -> None:
        step, plan = self.step, self.plan
        step.draw_seeds()
        with BatchNormCalls(plan, step.owners):
            self._statistics()
            calls, t = plan.calls, len(plan.calls) // 2  # the bottom half gets correction passes
            for j in reversed(range(t, len(calls))):
                self._sums_pass(j)
            self._full_pass(t)
            for j in reversed(range(t)):
                self._finish_sums(calls[j])
                self._correction_pass(j)
        step.calls = [c.first for c in plan.calls]

    def _each(self):
        """Each micro-batch index, with its random numbers replayed and the plan's call counter reset."""
        for k in range(len(self.step.micro_batches)):
            self.plan.index = 0
            with self.step.rng(k):
                yield k

    def _forward(self, k: int) -> Tensor | None:
        """loss_fn on micro-batch k; None if a truncated pass stopped it at its target call."""
        try:
            loss = self.step.loss(k)
        except _Stop:
            return None
        if self.plan.index != len(self.plan.calls):
            raise ValueError(
                f"micro-batch {k} made {self.plan.index} BatchNorm calls where micro-batch 0 made "
                f"{len(self.plan.calls)}: bn='exact' needs the same sequence of BatchNorm calls in every forward"
            )
        return loss

    def _statistics(self) -> None:
        """Passes 1..L: whole-batch statistics, one BN call deeper per pass, until a forward completes."""
        plan = self.plan
        while True:
            j = len(plan.calls)
            plan.begin(plan.STATS, j)
            with torch.no_grad():
                for k in self._each():
                    if self._forward(k) is not None:  # micro-batch 0 never reached call j: there are j
                        return
            call = plan.calls[j]
            # Two or more micro-batches (or ranks) hold at least 2 values per channel: no count check needed.
            call.first.stats = self.step.collectives.merge_moments(stack_moments(call.parts))
            call.parts = []
            call.sums = GradSums(call.stats.mean.shape[0], call.stats.count)

    def _finish_sums(self, call: _Call) -> None:
        """Call's sums are complete on this rank: reduce them across ranks and switch it to exact backward."""
        sums = call.sums
        both = self.step.collectives.sum_(torch.cat([sums.sum_dy, sums.sum_dy_xhat]))
        sums.sum_dy, sums.sum_dy_xhat = both.chunk(2)
        sums.collect = False

    def _sums_pass(self, j: int) -> None:
        self.plan.begin(self.plan.SUMS, j)
        call = self.plan.calls[j]
        for k in self._each():
            with torch.no_grad():  # the BN call switches grad on: nothing below it needs a graph
                loss = self._forward(k)
            # Only the sums (collected by the call's backward) matter, not the gradient itself.
            torch.autograd.grad(self.step.weighted(loss, k), call.input, allow_unused=True)
        call.input = None
        self._finish_sums(call)

    def _full_pass(self, t: int) -> None:
        self.plan.begin(self.plan.FULL, t)
        for k in self._each():
            loss = self._forward(k)
            self.step.losses[k] = loss.detach()
            self.step.weighted(loss, k).backward()

    def _correction_pass(self, j: int) -> None:
        self.plan.begin(self.plan.CORRECT, j)
        call = self.plan.calls[j]
        first = call.first
        for k in self._each():
            self._forward(k)
            x, call.input = call.input, None
            if not x.requires_grad:  # nothing below this call learns: no correction to send down
                return
            shape = [1, -1] + [1] * (x.dim() - 2)
            invstd = torch.rsqrt(call.stats.var + first.eps)
            scale = invstd if first.weight is None else invstd * first.weight.detach().to(invstd.dtype)
            x_hat = (x.detach().to(call.stats.mean.dtype) - call.stats.mean.view(shape)) * invstd.view(shape)
            torch.autograd.backward(x, call.sums.correction(x_hat, scale).to(x.dtype))


def passes(step: Step) -> None:
    """Exact BatchNorm by the 2L + 1 passes of the module doc; fills `step.losses` and `step.calls`."""
    _Passes(step).run()
