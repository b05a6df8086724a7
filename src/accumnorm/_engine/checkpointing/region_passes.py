"""The backward of a segments region: each micro-batch's region recomputed alone, in one pass per BatchNorm call.

A region's node (`RegionNode`) joins the K micro-batches' arguments to their outputs. Autograd calls its backward
once every micro-batch's gradient at the outputs is in. The forward fixed every BatchNorm call's whole-batch
statistics, so each micro-batch can recompute the region alone, with those statistics as constants
(`bn.normalize.normalize`); but a call's input gradient needs the whole batch's backward sums at the call, sum(dy)
and sum(dy * x_hat), which need every micro-batch's gradient at its output. So, with the calls in the region's order
(a call's output feeds later calls only):

  1. for each call t from the last: every micro-batch recomputes the region and back-propagates from its outputs
     to call t's input, cut there; the calls after t are exact (their sums are complete), and call t adds its
     micro-batch's share to its sums, which are then summed across ranks;
  2. a last pass: every micro-batch recomputes the region, exact, and back-propagates to its arguments (the node's
     input gradients), the parameters, and any other leaf the region reaches (which joins the step's transaction).

Each pass replays the micro-batch's random stream and modes from the region's entry; only one micro-batch's
recomputation lives at a time. The last pass checks that the recomputation is the forward again (`region_checks`):
its outputs, its graph.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import tree_leaves

from ..bn.normalize import GradSums, invstd, normalize, normalize_with, scale
from ..bn.replay import CallReplay
from ..intercept.calls import BNCall, INCall, NormCalls, StopPass
from ..intercept.guards import backward_hooked
from ..memory.heap import release_free_memory
from ..safety.threadstate import Modes, autocast_cache_off, close_checkpoints_left_open
from .again import check_outputs, fingerprint
from .region_checks import graph_leaves, next_sequence_nr
from .regions import region_modules

__all__ = ["RegionNode", "RegionPasses"]

# The passes of a region's recomputation (`RegionPasses._recompute`): a call's backward sums, the last pass, a
# call's correction, and its outputs again without grad.
_SUMS, _LAST, _CORRECT, _AGAIN = "sums", "last", "correct", "again"


class RegionNode(torch.autograd.Function):
    """One region's call over the K micro-batches: their arguments to their outputs (module doc)."""

    @staticmethod
    def forward(ctx, passes, *inputs):  # type: ignore[override]
        ctx.passes = passes
        return tuple(passes.take_outputs())

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):  # type: ignore[override]
        passes, ctx.passes = ctx.passes, None  # the region's arguments go with its one backward
        if passes is None:
            raise ValueError(
                "bn='exact': a second backward through a region of the segments schedule (a backward with "
                "retain_graph=True before the step's own, in batch_loss_fn or a hook). The region keeps its arguments "
                "for one backward, the step's. Nothing was changed. Add that backward's term to the loss you return "
                "instead, or use schedule='layerwise'")
        grads_in = passes.backward(list(grads))
        release_free_memory(passes.device)  # the region's recomputations are gone (`memory.heap`)
        return (None, *grads_in, *[None] * (len(ctx.needs_input_grad) - 1 - len(grads_in)))


class RegionPasses:
    """One region's call by the K micro-batches (`entries`, each a `segmented.Entry`) and its backward (module
    doc). `step`: the step (`step.Step`); `outputs[k]`: micro-batch k's outputs, without their graph."""

    def __init__(self, step: Any, entries: list[Any], outputs: list[list[Tensor]]) -> None:
        self.step, self.entries, self.outputs = step, entries, outputs
        # Every micro-batch's fingerprints of its outputs (`fingerprint`), in one tensor: a block per region node, not
        # a small one per micro-batch among the large ones of the heap until the backward.
        self.samples = torch.stack([fingerprint(o) for o in outputs])
        self.calls: list[CallReplay] = entries[0].calls  # every micro-batch's calls share their replays
        self.counts = [len(o) for o in outputs]
        self.device = next((t.device for o in outputs for t in o), torch.device("cpu"))
        self.depth = 0  # how many regions below this one let go of their arguments (`segmented`)
        self.modules = [d for m in region_modules(entries[0].region) for d in m.modules()]
        # The BatchNorm layers whose call counters each recomputation's forwards count up again: put back after it,
        # with the step's count of the calls it saw, so that a layer's own factor from its counter is the forward's.
        self.counted = [d for d in self.modules
                        if isinstance(d, _BatchNorm) and d._buffers.get("num_batches_tracked") is not None]

    def take_outputs(self) -> list[Tensor]:
        outputs, self.outputs = self.outputs, None
        return [o for os in outputs for o in os]

    def node(self, running: Callable[[], int | None]) -> list[list[Tensor]]:
        """The node over the K micro-batches: each one's outputs of it. A backward through it while a micro-batch's
        forward runs (`running()`: that one, or None) is refused."""
        inputs = [e.leaves[i] for e in self.entries for i in e.tensors]
        # The region's parameters too, which its backward accumulates into themselves: a backward into them alone
        # (`inputs=`) then reaches the node; and a region over the model's input makes outputs that require grad.
        inputs += [p for m in region_modules(self.entries[0].region) for p in m.parameters() if p.requires_grad]
        if not any(x.requires_grad for x in inputs):
            inputs.append(torch.empty(0, requires_grad=True))
        flat = list(RegionNode.apply(self, *inputs))
        if flat and flat[0].grad_fn is not None:
            refusal = self.entries[0].refusal
            flat[0].grad_fn.register_prehook(refusal if refusal is not None else self._refusal(running))
        out, start = [], 0
        for n in self.counts:
            out.append(flat[start:start + n])
            start += n
        return out

    def _refusal(self, running: Callable[[], int | None]) -> Callable[[Any], None]:
        def refuse(grad_outputs: Any) -> None:
            k = running()
            if k is not None:
                raise ValueError(
                    f"bn='exact': micro-batch {k} ran a backward (a .backward() or torch.autograd.grad in your "
                    "function) through a region of the segments schedule while the micro-batches' forwards were "
                    "still running. The region's backward needs every micro-batch's gradient at its outputs, which "
                    "no micro-batch has alone. Nothing was changed. For a loss of the whole batch's outputs use "
                    "forward_fn and batch_loss_fn; else leave the inner backward out, or use schedule='layerwise'")
        return refuse

    def backward(self, grads: list[Tensor]) -> list[Tensor | None]:
        """The input gradients of every micro-batch's arguments, in the node's order (module doc)."""
        entries, self.entries = self.entries, None
        dys, start = [], 0
        for n in self.counts:
            dys.append(grads[start:start + n])
            start += n
        # Each micro-batch's arguments: kept, or recomputed from the last kept ones below (`segmented`), for this
        # backward only.
        values = [self._arguments(entry, k) for k, entry in enumerate(entries)]
        sums = [GradSums(c.stats.mean.shape[0], c.stats.count) for c in self.calls]
        # The calls from `split` up get a sums pass each; those below, a correction pass after the last pass (module
        # doc). A module's full backward hook sees no gradient that enters its input without leaving its output, as
        # a correction does, and a hook that clamps a gradient would clamp its parts: with a hook in the region, on
        # a tensor of the step's forwards, or a custom Function of yours in it, every call gets a sums pass
        # (`backward_hooked`).
        hooked = backward_hooked(self.modules, self.step.watch.tensor_hooks or entries[0].user_functions)
        split = 0 if hooked else len(self.calls) // 2
        for t in reversed(range(split, len(self.calls))):
            for entry, given, dy in zip(entries, values, dys):
                outputs, _, cut = self._recompute(entry, given, sums, _SUMS, t)
                if cut is not None and outputs:
                    torch.autograd.grad(outputs, [cut], dy, allow_unused=True)
                del outputs, cut
            sums[t].finish(self.step.collectives.sum_)
        totals: list[list[Tensor | None]] = []
        for k, (entry, given, dy) in enumerate(zip(entries, values, dys)):
            start = next_sequence_nr()
            outputs, inputs, _ = self._recompute(entry, given, sums, _LAST, None)
            check_outputs(outputs, self.samples[k], (
                "the segments schedule runs a region's forward again in the backward, but micro-batch "
                f"{k}'s recomputation gave other outputs than its forward (state shared between micro-batches, or "
                "randomness outside torch's generators): it would not be exact"))
            totals.append(self._back_propagate(outputs, dy, inputs, start))
        for t in reversed(range(split)):
            sums[t].finish(self.step.collectives.sum_)
            if not sums[t].reached:  # no gradient went back through the call: nothing to correct (`GradSums`)
                continue
            call = self.calls[t]
            for entry, given, total in zip(entries, values, totals):
                start = next_sequence_nr()
                _, inputs, x = self._recompute(entry, given, sums, _CORRECT, t)
                if x is not None and x.requires_grad:
                    mean, inv = call.stats.mean, invstd(call.stats.var, call.eps)
                    correction = sums[t].correction(x.detach().to(mean.dtype), mean, inv, scale(inv, call.weight))
                    for i, g in enumerate(self._back_propagate([x], [correction.to(x.dtype)], inputs, start)):
                        if g is not None:
                            total[i] = g if total[i] is None else total[i] + g
                del x
        return [g for total in totals for g in total]

    def _back_propagate(self, roots: list[Tensor], grads: list[Tensor], inputs: list[Tensor],
                        start: int) -> list[Tensor | None]:
        """A recomputation's backward from `roots` to its arguments (`inputs`: their gradients, returned), the
        parameters and any other leaf it reaches (which joins the step's transaction); `start`: the sequence number
        before the recomputation."""
        wanted = [x for x in inputs if x.requires_grad]
        others = graph_leaves(roots, start, {id(x) for x in inputs}, self.step.graphs.seen)
        self.step.join(others)
        if roots and (wanted or others):
            torch.autograd.backward(roots, grads, inputs=wanted + others)
        return [x.grad for x in inputs]

    def _arguments(self, entry: Any, k: int) -> list[Tensor]:
        """Micro-batch k's tensor arguments of the region: those its entry keeps, the others recomputed."""
        return [entry.leaves[i] if i not in entry.sources else entry.sources[i][0].output_again(k, entry.sources[i][1])
                for i in entry.tensors]

    def output_again(self, k: int, j: int) -> Tensor:
        """Micro-batch k's output j of the region, recomputed without grad (for a region whose argument it is, and
        which did not keep it): every call with its whole-batch statistics, as in the forward."""
        entry = self.entries[k]
        with torch.no_grad():
            outputs, _, _ = self._recompute(entry, self._arguments(entry, k), None, _AGAIN, None)
        check_outputs(outputs[j:j + 1], self.samples[k, j:j + 1], (
            f"the segments schedule recomputes a region's output for the region after it, but micro-batch {k}'s "
            "recomputation gave another output than its forward (state shared between micro-batches, or randomness "
            "outside torch's generators): it would not be exact"))
        return outputs[j]

    def _recompute(self, entry: Any, given: list[Tensor], sums: list[GradSums] | None, mode: str,
                   target: int | None) -> tuple[list[Tensor], list[Tensor], Tensor | None]:
        """Micro-batch `entry`'s region again, from its tensor arguments `given`, in one of the passes (`mode`, at
        call `target`): its outputs that need a gradient (as in the forward; none in a correction pass, stopped at
        its call), its arguments (new leaves), and call `target`'s input (cut from below in a sums pass)."""
        self.step.bound.check()  # what the last recomputation's backward freed (`memory.heap`)
        args, kwargs, inputs = entry.arguments(given)
        calls, index, cut = self.calls, [0], [None]

        def batch_norm(call: BNCall) -> Tensor:
            i = index[0]
            index[0] += 1
            if i >= len(calls):
                raise ValueError("bn='exact': a region's recomputation made more BatchNorm calls than its forward; "
                                 "the region's function must make the same calls each time")
            stats, x = calls[i].stats, call.input
            if mode == _AGAIN or (mode == _SUMS and i < target):  # no gradient wanted from it: a constant
                return normalize_with(x.detach(), stats.mean, stats.var, call.weight, call.bias, call.eps)
            if i == target:
                if mode == _CORRECT:  # the pass has its call's input: the rest of the forward is not needed
                    cut[0] = x
                    raise StopPass
                x = cut[0] = x.detach().requires_grad_()
            return normalize(x, stats.mean, stats.var, call.weight, call.bias, call.eps, sums[i])

        generators = self.step.rng.generators
        before, counters = [g.get_state() for g in generators], self._counters()
        for g, state in zip(generators, entry.rng):
            g.set_state(state)
        try:
            # Under a budget on the CPU, the backward of the recomputation reads the step's bound at each saved tensor
            with entry.modes.entered(Modes.current()), autocast_cache_off(), \
                    NormCalls(batch_norm, INCall.output, self.step.watch, replays=True), \
                    self.step.bound.saved_tensor_hooks():
                out = entry.forward(*args, **kwargs)
        except StopPass:
            return [], inputs, cut[0]
        except BaseException as e:
            close_checkpoints_left_open(e)
            raise
        finally:
            for g, state in zip(generators, before):
                g.set_state(state)
            self._put_back(counters)
        if index[0] != len(calls):
            raise ValueError("bn='exact': a region's recomputation made fewer BatchNorm calls than its forward; the "
                             "region's function must make the same calls each time")
        leaves = tree_leaves(out)
        return [leaves[i] for i in entry.positions], inputs, cut[0]

    def _counters(self) -> list[tuple[Tensor, int]]:
        seen = self.step.watch.seen
        return [(m._buffers["num_batches_tracked"].clone(), seen[m]) for m in self.counted]

    def _put_back(self, counters: list[tuple[Tensor, int]]) -> None:
        watch = self.step.watch
        with torch.no_grad():
            for m, (value, seen) in zip(self.counted, counters):
                counter = m._buffers["num_batches_tracked"]
                counter.copy_(value)
                watch.seen[m] = seen
                if m in watch.versions:
                    watch.versions[m] = counter._version
