"""The layerwise schedule: the micro-batches' forwards in lockstep, meeting at every BatchNorm call.

Each micro-batch's loss_fn runs once, as a coroutine (a greenlet) on the caller's thread. At a
BatchNorm call it pauses and the driver resumes the next one; once all K are at the call, `Meeting.meet`
normalizes the whole batch's input at once (their pieces, concatenated) with torch's own BatchNorm,
and each goes on with its rows of the output. The backward is one call over the K losses: autograd
runs each call's BatchNorm backward once every micro-batch's gradient at its output is in, on the
whole batch, as one backward of the whole batch would.

Cost: one forward and one backward of each micro-batch, as plain accumulation, at any depth, plus a
copy of each BatchNorm call's input (and of its output gradient in the backward). Price:
the K graphs live together until the backward, so autograd's saved tensors of the whole batch are
kept, in `store` (on CUDA, pinned host memory by default: the device then holds about one
micro-batch's activations plus the tensors that cross the current BatchNorm call for all K).

Any model runs as written: Python control flow, hooks and side effects run once per micro-batch, on
the caller's thread, with its intra-op threads, CUDA device and stream. Python state the forwards share
(a hook's stash, a module attribute, a global) is another matter: one micro-batch overwrites what another
wrote before a BatchNorm call, so before the backward `Graphs` checks that no micro-batch's graph holds a
tensor another made, and refuses the step if one does. At every turn the coroutines
swap torch's per-thread state (`ThreadState`: grad mode, autocast, saved-tensor hooks, modes, CUDA
stream) and their random streams (`StepRng`), so each runs as it would alone. A BatchNorm call inside
a `checkpoint(use_reentrant=False)` region is recorded with its region (`RecordedRegions`); its recomputation
in the backward gives the same output from the same whole-batch statistics and saves nothing in the
region's place, as the call in the forward, which ran in the driver.
"""
from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any, NamedTuple

import greenlet
from torch import Tensor

from ..checkpointing.frames import in_segment
from ..checkpointing.segmented import RegionExit, SegmentedRegions
from ..intercept.calls import BNCall, INCall
from ..memory.budget import Meter
from ..memory.store import Store
from ..safety.threadstate import ThreadState
from ..safety.writes import NumberWrites
from ..step.outputs import concatenate
from ..step.step import Step
from .base import Schedule

__all__ = ["Layerwise", "lockstep"]


class _AtInstanceNorm(NamedTuple):
    """A micro-batch paused at its InstanceNorm call `index` that moves running statistics."""

    index: int


# Where a micro-batch pauses for the others (its forward goes on once all K are there): a met point.
_MET_POINTS = (BNCall, RegionExit, _AtInstanceNorm)


class _Lockstep:
    """The driver and the K coroutines of one step (module doc)."""

    def __init__(self, step: Step, store: Store | Meter | None, before_backward: Callable[[], None] | None,
                 segments: SegmentedRegions | None) -> None:
        self.step, self.store, self.before_backward, self.segments = step, store, before_backward, segments
        self.driver = greenlet.getcurrent()
        self.coroutines: list[greenlet.greenlet] = []
        self.current: int | None = None  # the micro-batch whose forward runs now
        self.instance_norms = [0] * len(step.micro_batches)  # InstanceNorm calls each micro-batch made so far
        self.base: ThreadState | None = None  # the driver's state, which every coroutine returns to when it pauses
        if segments is not None:
            segments.attach(self)

    def run(self) -> None:
        try:
            with self.step.bound.saved_tensor_hooks(self.store):
                roots = self._forwards()
        finally:
            self.step.graphs.clear()  # checked: the graphs' nodes are the backward's to free
        # A BatchNorm forward the step did not see (one fused into a compiled graph) is refused now, saying so, before
        # the backward meets what it left (its running statistics, changed since a compiled graph saved them).
        self.step.ledger.check_every_call_seen(self.step.names)
        if self.before_backward is not None:
            self.before_backward()
        self.step.ledger.statistics_written(None)  # as the forwards left them: the backward's recomputations must too
        if roots:
            # One backward over every micro-batch: each met call's backward needs all K gradients at once.
            self.step.backward(roots)
            self.step.ledger.check_statistics_untouched(None, self.step.names)  # a region's recomputation ran a hook
            self.step.interrupts.check()

    def _forwards(self) -> list[Tensor]:
        """Run the K forwards in lockstep to their ends; the (weighted) losses still to back-propagate."""
        step, k_all = self.step, range(len(self.step.micro_batches))
        self.base = ThreadState.capture()
        grads_before = step.grad_versions() if len(k_all) > 1 else None
        writes = NumberWrites(self._running)
        context = contextvars.copy_context()
        self.coroutines = [greenlet.greenlet(self._forward) for _ in k_all]
        for g in self.coroutines:
            g.gr_context = context.copy()  # contextvars as the caller's, but each coroutine's own
        writes.begin()
        try:
            ends = [self._resume(k, k) for k in k_all]
            index = exits = 0
            while any(isinstance(end, _MET_POINTS) for end in ends):
                if any(isinstance(end, _AtInstanceNorm) for end in ends):
                    ends = self._meet_at_instance_norm(ends)
                    continue
                if self.segments is not None and any(isinstance(end, RegionExit) for end in ends):  # its regions
                    if any(isinstance(end, BNCall) for end in ends):  # raises: not all at a BatchNorm call
                        step.meeting.check_same([end if isinstance(end, BNCall) else None for end in ends], index)
                    outputs = self.segments.meet(ends, exits)
                    exits += 1
                    ends = [self._resume(k, outputs[k]) for k in k_all]
                    continue
                calls = [end if isinstance(end, BNCall) else None for end in ends]
                if None in calls:
                    step.meeting.check_same(calls, index)  # raises: not all at a BatchNorm call
                outputs, replay = step.meeting.meet(calls, index, self.base.modes)  # each pause left the driver in base
                if isinstance(self.store, Meter):  # "auto": the call's input and output of the whole batch, at once
                    self.store.beside([c.input for c in calls] + outputs)
                # The K rows' node, shared; or one micro-batch's whose input its regions keep, back-propagated once
                if (len(outputs) > 1 or replay.keeps_input) and outputs[0].grad_fn is not None:
                    outputs[0].grad_fn.register_prehook(step.inner_backward_refusal(
                        calls[0], index, self._running, alone=len(outputs) == 1))
                step.graphs.met(outputs, [c.input for c in calls])
                if self.segments is not None:  # a backward through a region this call is in is refused as through it
                    self.segments.refusal = step.inner_backward_refusal(calls[0], index, self._running)
                index += 1
                ends = self._resume_all(calls, outputs, replay)
        except BaseException:
            self._abort()
            raise
        finally:
            writes.end()
            step.rng.end_turns()
            self.coroutines = []
        if grads_before is not None:  # more than one micro-batch
            step.refuse_grads_changed(grads_before, "each micro-batch's forward once")
        step.ledger.check_statistics_untouched(None, step.names, refuse=grads_before is not None)  # after the last call
        writes.refuse_moved_by_several(step.names, len(k_all), step.attributes.restore)  # before a whole-batch loss
        if step.objective.whole:  # one loss over every micro-batch's outputs
            step.graphs.check(list(zip(k_all, ends)))
            loss, scaled = step.whole_loss(lambda: step.objective.loss(concatenate(ends)))
            step.losses.whole = loss.detach()
            return [scaled]
        met = index + exits  # the met points: BatchNorm calls, and the segments schedule's region exits
        if met:  # before any backward: each micro-batch's graph is its own, but for the met calls
            step.graphs.check(list(zip(k_all, ends)))
        roots = []
        for k, loss in zip(k_all, ends):
            step.losses.micro[k] = loss.detach()
            weighted = step.objective.weighted(loss, k)
            if met == 0:
                # No met point at all: each graph is its own, and its backward frees it now, as plain
                # accumulation would.
                step.graphs.check([(k, loss)])
                step.backward(weighted)
            else:
                roots.append(weighted)
        return roots

    def _resume_all(self, calls: list[BNCall | None], outputs: list[Tensor], replay: Any) -> list[Any]:
        """Resume each micro-batch with its rows of a met call's output. The driver lets go of each one's input and
        output as it resumes it, so that they live no longer than that micro-batch's forward holds them."""
        ends = []
        for k in range(len(outputs)):
            y, outputs[k], calls[k] = outputs[k], None, None
            ends.append(self._resume(k, (y, replay)))
            del y
        return ends

    def _running(self) -> int | None:
        return self.current

    def _forward(self, k: int) -> Any:
        """The body of micro-batch k's coroutine: its forward (which pauses at each BatchNorm call).

        The mode that sends BatchNorm calls here is the coroutines' own: the driver's work runs without it.
        """
        with self.step.norm_calls(self._batch_norm, self._instance_norm, once=True):
            return self.step.forward(k)

    def _resume(self, k: int, value: object) -> Any:
        """Run micro-batch k's forward until its next met point (`_MET_POINTS`) or its end (its loss or outputs).

        Its random stream stays in the generators until the next turn's replaces it (`_forwards` ends the last)."""
        step = self.step
        self.current = k
        step.rng.begin(k)
        step.graphs.begin(k)
        try:
            end = self.coroutines[k].switch(value)
        except BaseException as e:
            if hasattr(e, "add_note") and not isinstance(e, greenlet.GreenletExit):
                e.add_note(f"(raised in micro-batch {k} of accumnorm.backward)")
            raise
        finally:
            step.graphs.end()
            self.current = None
        step.bound.check()  # what the turn freed, once the step nears its budget (`memory.heap`)
        if not isinstance(end, _MET_POINTS):
            if isinstance(end, greenlet.GreenletExit):  # raised by the forward itself: greenlet returns it as a result
                if hasattr(end, "add_note"):
                    end.add_note(f"(raised in micro-batch {k} of accumnorm.backward)")
                raise end
            self.base.apply(ThreadState.capture())  # the forward is over: whatever it left of its state goes
        if step.interrupts.pending is not None:
            step.interrupts.check()
        return end

    def _batch_norm(self, call: BNCall) -> Tensor:
        """A BatchNorm call of a micro-batch's forward: pause until all K are at it, then normalize this piece."""
        if self.current is None:
            raise RuntimeError(f"bn='exact' met a BatchNorm call outside the micro-batches' forwards "
                               f"({self.step.describe(call)})")
        own = ThreadState.capture(call.modes)
        call.saved_tensor_hooks = hooks = own.saved_tensor_hooks
        y, replay = self._pause(call, own)  # the driver comes back once all K have met, in its state
        if hooks:  # in a checkpointed region, the region's recomputation gives the output again, as the driver did
            self.step.regions.enter_forward_call(replay, hooks, dispatch_depth=len(self.base.dispatch_modes))
            if self.segments is not None and in_segment(hooks):
                self.segments.called(self.current, replay, hooks)
        return y

    def pause(self, value: Any) -> Any:
        """Pause the running micro-batch at `value` (a met point) until the driver resumes it; what it sends."""
        return self._pause(value, ThreadState.capture())

    def _pause(self, value: Any, own: ThreadState) -> Any:
        swap = own != self.base  # else (the usual case) this micro-batch runs in the driver's state: nothing to swap
        try:
            if swap:
                self.base.apply(own)
            sent = self.driver.switch(value)
        except BaseException:  # unwound by the driver: back to this micro-batch's state, from wherever it is
            own.apply(ThreadState.capture())
            raise
        if swap:
            own.apply(self.base)
        return sent

    def _instance_norm(self, call: INCall) -> Tensor:
        """An InstanceNorm call with running statistics of a micro-batch's forward: its piece goes to the ledger, and
        it pauses until all K are at the call, where the statistics move, so that a read after the call (an
        eval-mode call on the layer, a teacher pass) finds them as the whole batch's forward leaves them there."""
        k = self.current
        index = self.instance_norms[k]
        self.step.ledger.instance_norm(call, index, self.step.names)
        self.instance_norms[k] += 1
        self.step.regions.enter_instance_norm()
        self.pause(_AtInstanceNorm(index))
        return call.output()

    def _meet_at_instance_norm(self, ends: list[Any]) -> list[Any]:
        """The K micro-batches at an InstanceNorm call with running statistics: they move now, and each goes on."""
        first = next(end for end in ends if isinstance(end, _AtInstanceNorm))
        for k, end in enumerate(ends):
            if end != first:
                was = ("at a BatchNorm call" if isinstance(end, BNCall) else "at a region's exit"
                       if isinstance(end, RegionExit) else "at another InstanceNorm call"
                       if isinstance(end, _AtInstanceNorm) else "at the end of its forward")
                raise ValueError(
                    f"bn='exact' needs every micro-batch to make the same norm calls in the same order, but "
                    f"micro-batch {k} was {was} where another was at InstanceNorm call {first.index}. Nothing was "
                    "changed. Make every micro-batch's forward make the same calls, or use bn='micro'")
        self.step.ledger.move_instance_norm_now(first.index)
        return [self._resume(k, None) for k in range(len(ends))]

    def _abort(self) -> None:
        """Unwind every paused forward (its `finally` blocks run in its own state), then return to the driver's."""
        for g in self.coroutines:
            for _ in range(3):  # a forward that swallows the exit and pauses again gets it again
                if g.dead:
                    break
                try:
                    g.throw(greenlet.GreenletExit)
                except BaseException:  # noqa: S110 - the step's first error is the one raised
                    pass
        self.base.apply(ThreadState.capture())


def lockstep(step: Step, store: Store | Meter | None, before_backward: Callable[[], None] | None = None,
             segments: SegmentedRegions | None = None) -> None:
    """Exact BatchNorm with the micro-batches in lockstep (module doc); fills `step.losses` and the step's calls.
    `before_backward()` runs once the forwards are over, before the backward (a check that may raise); `segments`:
    the segments schedule's regions, whose exits are met points too."""
    try:
        step.bound.start()
        _Lockstep(step, store, before_backward, segments).run()
    finally:
        step.bound.close()


class Layerwise(Schedule):
    """The micro-batches in lockstep, meeting at every BatchNorm call (module doc)."""

    name = "layerwise"

    def run(self, step: Step, store: Store | Meter | None) -> None:
        lockstep(step, store)
