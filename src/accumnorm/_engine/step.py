"""One `accumnorm.backward` call, and the round protocol every exact schedule uses to make it exact.

The micro-batches of a step must make the same normalization calls in the same order: call j of micro-batch
k is the k-th piece of call j of the whole batch. `Step.check_same` holds them to that (shape past the batch
dimension, dtype, device, parameters, buffers, eps, modes) and says what differs where. `Step.meet` checks
the K pieces and makes them one call of the whole batch (`whole`: their inputs concatenated, normalized by
torch's own `batch_norm`, whole-batch statistics, backward and running-statistics update, as one forward of
the whole batch would make them; across ranks, reduced as SyncBatchNorm reduces them, `joint`), and each
micro-batch goes on with its rows of the output. A schedule that meets the calls otherwise (passes) merges
the statistics with `Step.joint_moments` and `record`s the call: `update_running_stats` applies one update
per such call at the end of the step.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from .._dist import Collectives
from ..functional import Moments, combine_moments, moments, update_running_stats_
from .calls import BNCall, INCall, NormCalls, describe, describe_layer
from .checkpoint import Regions
from .crossing import Graphs
from .interrupts import SigintDeferred
from .objective import BatchLoss, MicroBatchLoss
from .rng import StepRng
from .sameness import difference, identical
from .threadstate import Modes
from .whole import Recompute, normalize_whole

__all__ = ["Step"]


@dataclass(eq=False)
class _InstanceNormStats:
    """One InstanceNorm call of the whole batch: the sums of its per-sample statistics over the micro-batches."""

    call: INCall
    count: int = 0
    sum_mean: Tensor | float = 0.0
    sum_var: Tensor | float = 0.0


class Step:
    """One `accumnorm.backward` call: the micro-batches, what they minimize, and the calls they meet at.

    A schedule runs each micro-batch's `forward(k)` (its loss, or its outputs for a whole-batch loss) and fills
    `losses` (micro-batch losses, detached) or `whole_loss`; in exact mode it meets the micro-batches at each
    BatchNorm call (`meet`, or `check_same` + `joint_moments` + `record`).
    """

    def __init__(self, model: nn.Module, modules: dict[nn.Module, str], parameters: list[nn.Parameter],
                 micro_batches: list[Any], objective: MicroBatchLoss | BatchLoss,
                 collectives: Collectives, rng: StepRng, interrupts: SigintDeferred,
                 restore_buffers: Callable[[], None], tracked_before: dict[_BatchNorm, Tensor],
                 backward: Callable[..., None]) -> None:
        self.model, self.micro_batches, self.objective = model, micro_batches, objective
        # Each BatchNorm module's num_batches_tracked before the step: the micro-batch forwards bump it once per
        # call each, whole-batch torch once per call.
        self.tracked_before = tracked_before
        self.calls_so_far: Counter[nn.Module] = Counter()  # whole-batch calls met, per BatchNorm module
        self.collectives, self.rng = collectives, rng
        self.interrupts = interrupts  # a schedule calls interrupts.check() at each of its safe points
        self.restore_buffers = restore_buffers  # undoes what a forward did to the buffers (a forward run twice)
        # torch.autograd.backward, for every backward a schedule runs: the leaves it reaches outside the model join
        # the step's transaction first.
        self.backward = backward
        # Each buffer's module: a call's running statistics name the layer it belongs to.
        self.owners = {id(b): m for m in modules for b in m._buffers.values() if b is not None}
        self.seen: Counter[nn.Module] = Counter()  # the BatchNorm layers' forwards the schedule saw
        self.tracked_versions = {m: m.num_batches_tracked._version for m in tracked_before}
        self.losses: list[Tensor | None] = [None] * len(micro_batches)
        self.whole_loss: Tensor | None = None
        self.batch_norms: list[tuple[BNCall, Moments, float | None]] = []  # recorded calls, to update at the end
        self.instance_norms: list[_InstanceNormStats] = []
        self.regions = Regions(self.norm_calls)
        self.graphs = Graphs(model, micro_batches)  # who made which node of the K graphs, checked before their backward
        self.modules = modules  # every module of the model, once, with its name (`tree.module_names`)
        self.parameters = parameters  # every parameter of those modules, once (`tree.parameters`)
        self._names: dict[nn.Module, str] | None = None

    def norm_calls(self, on_batch_norm: Callable[[BNCall], Tensor], on_instance_norm: Callable[[INCall], Tensor],
                   once: bool = False) -> NormCalls:
        """The TorchFunctionMode that sends this step's norm calls to a schedule's handlers. `once`: the schedule
        runs each micro-batch's forward once, with its graph (a gradient of one micro-batch's loss is the whole
        batch's when it is the only one)."""
        mode = NormCalls(on_batch_norm, on_instance_norm, self.owners, Step.forward.__code__, self.seen,
                         self.tracked_versions, self.graphs, gradients=once and len(self.micro_batches) == 1)
        if self.regions.kept is not None:
            mode.convolutions = self.regions.convolution
        return mode

    def forward(self, k: int) -> Any:
        """Micro-batch k's forward: its loss (checked), or its outputs for a whole-batch loss."""
        return self.objective.forward(self.model, self.micro_batches[k], k)

    def result(self) -> Tensor:
        """The whole batch's loss, detached; a non-finite micro-batch loss is an error unless a GradScaler will skip
        the step."""
        if self.whole_loss is not None:
            return self.whole_loss
        losses = torch.stack(self.losses)
        finite = torch.isfinite(losses)
        # Under a GradScaler an overflow is expected now and then: its inf/nan gradients make the
        # scaler skip the step and lower the scale, so only an unscaled run treats it as an error.
        if self.objective.grad_scaler is None and not bool(finite.all()):
            k = int((~finite).nonzero()[0])
            raise ValueError(f"loss is not finite ({losses[k].item()}) for micro-batch {k}; nothing was changed")
        weights = torch.tensor(self.objective.weights, dtype=losses.dtype, device=losses.device)
        return self.collectives.sum_(losses @ weights)

    # ---------------------------------------------------------------- the round protocol
    def meet(self, calls: Sequence[BNCall], index: int, modes: Modes) -> tuple[list[Tensor], Recompute]:
        """The K micro-batches' pieces of BatchNorm call `index`, made one call of the whole batch (`whole`) in
        their modes (`modes`: the caller's now): each piece's rows of its output, and how to give a piece's output
        again from its input (for a checkpointed region's recomputation: the whole batch's statistics, no
        running-statistics update, nothing saved)."""
        self.check_same(calls, index)
        self.check_count(sum(c.input.shape[0] for c in calls), calls[0].input.shape)
        first = calls[0]
        with first.modes.entered(modes):
            if self.collectives.group is None:
                return normalize_whole(calls, self.count_call(first))
            return normalize_whole(calls, None, lambda x: self._moved(first, self.joint_moments([moments(x)])),
                                   self.collectives.sum_)

    def check_same(self, calls: Sequence[BNCall | None], index: int, micro_batches: Sequence[int] | None = None,
                   grad_mode: bool = True) -> None:
        """Raise, naming what differs and where, unless every micro-batch is at the same BatchNorm call.

        `calls[i]` is micro-batch `micro_batches[i]`'s (default: i's) piece; `grad_mode`: the grad modes must agree.
        """
        first = calls[0]
        if first is not None and all(call is not None and identical(first, call) for call in calls[1:]):
            return
        for i, call in enumerate(calls[1:], 1):
            problem = difference(first, call, grad_mode, self.names)
            if problem is not None:
                k = micro_batches[i] if micro_batches is not None else i
                theirs = self.describe(first) if first is not None else "none (it had ended its forward)"
                raise ValueError(
                    f"bn='exact' needs every micro-batch to make the same BatchNorm calls in the same order, but at "
                    f"BatchNorm call {index} micro-batch {k} {problem} where micro-batch 0 made {theirs}. No schedule "
                    "can join calls that differ into one call of the whole batch. Nothing was changed. Make every "
                    "micro-batch's forward make the same calls (layers, shapes, dtypes, grad mode, autocast), or use "
                    "bn='micro'")

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

    def check_count(self, rows: int, shape: Sequence[int]) -> None:
        """As torch's BatchNorm: batch statistics need more than one value per channel (in the whole batch of `rows`
        samples, each of `shape` past the batch dimension, as checked by `check_same`)."""
        if self.collectives.group is None and rows * math.prod(shape[2:]) <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size "
                             f"{(rows, *shape[1:])}")

    def joint_moments(self, parts: list[Moments]) -> Moments:
        """The moments of the whole batch (every micro-batch, every rank) from each micro-batch's."""
        return self.collectives.merge_moments(combine_moments(parts))

    def record(self, call: BNCall, stats: Moments) -> float | None:
        """Note a BatchNorm call of the whole batch, with its statistics, for the running-statistics update; the
        factor they will move by."""
        factor = self.count_call(call)
        self.batch_norms.append((call, stats, factor))
        return factor

    def _moved(self, call: BNCall, stats: Moments) -> Moments:
        """A met call across ranks, whose statistics are every rank's: its running statistics move now, as
        torch.batch_norm moves them at the call in one process (a later read in the forward finds them moved)."""
        factor = self.count_call(call)
        if call.running_mean is not None:
            update_running_stats_(call.running_mean, call.running_var, stats.mean, stats.unbiased_var, factor)
        return stats

    def count_call(self, call: BNCall) -> float | None:
        """Count a BatchNorm call of the whole batch; the factor its running statistics move by."""
        m = call.module
        if call.counted:  # a BatchNorm layer's forward: torch counts it in num_batches_tracked
            self.calls_so_far[m] += 1
            if m.momentum is None:  # a cumulative average over the calls so far, as torch's forward computes it
                return 1.0 / float(self.tracked_before[m] + self.calls_so_far[m])
        return call.momentum

    def instance_norm(self, call: INCall, index: int) -> None:
        """Add micro-batch's piece of InstanceNorm call `index` (in its forward) to the whole batch's statistics."""
        if call.module is None:
            raise ValueError(
                f"bn='exact' met a F.instance_norm call over {call.input.shape[1]} channels whose running statistics "
                "are not buffers of the model: make the layer part of the model")
        if index == len(self.instance_norms):
            self.instance_norms.append(_InstanceNormStats(call))
        entry = self.instance_norms[index]
        if entry.call.running_mean is not call.running_mean:
            raise ValueError(f"bn='exact' needs every micro-batch to make the same InstanceNorm calls in the same "
                             f"order; at InstanceNorm call {index} one made {self.describe(call)} where "
                             f"micro-batch 0 made {self.describe(entry.call)}")
        x = call.input.detach().flatten(2)
        with torch.no_grad():  # torch's instance_norm: per-sample mean and unbiased variance, averaged over samples
            var, mean = torch.var_mean(x if x.dtype == torch.float64 else x.float(), dim=2, correction=1)
        entry.count += call.input.shape[0]
        entry.sum_mean = entry.sum_mean + mean.sum(0)
        entry.sum_var = entry.sum_var + var.sum(0)

    # ---------------------------------------------------------------- the end of the step
    def update_running_stats(self) -> None:
        """The running-statistics updates of the calls `record`ed, and of InstanceNorm's, one per call in forward
        order, as torch's whole-batch forward makes them; each BatchNorm's num_batches_tracked one up per call."""
        for call, stats, factor in self.batch_norms:
            if call.running_mean is not None:
                update_running_stats_(call.running_mean, call.running_var, stats.mean, stats.unbiased_var, factor)
        for entry in self.instance_norms:
            count = entry.sum_mean.new_full((1,), entry.count)
            total = self.collectives.sum_(torch.cat([count, entry.sum_mean, entry.sum_var]))
            n, (mean, var), call = total[0], total[1:].chunk(2), entry.call
            update_running_stats_(call.running_mean, call.running_var, mean / n, var / n, call.momentum)
        with torch.no_grad():
            for layers in self.counted_layers_by_device():  # one foreach op per device, not two ops per layer
                torch._foreach_copy_([m.num_batches_tracked for m in layers],
                                     torch._foreach_add([self.tracked_before[m] for m in layers],
                                                        [self.calls_so_far.get(m, 0) for m in layers]))

    def counted_layers_by_device(self) -> list[list[_BatchNorm]]:
        """The BatchNorm layers whose num_batches_tracked the step counts, grouped by the counter's device (for ops
        over all of a device's counters at once)."""
        by_device: dict[torch.device, list[_BatchNorm]] = {}
        for m in self.tracked_before:
            by_device.setdefault(m.num_batches_tracked.device, []).append(m)
        return list(by_device.values())

    def describe(self, call: BNCall | INCall) -> str:
        return describe(call, self.names)

    @property
    def names(self) -> dict[nn.Module, str]:
        """Each module's name in the model, for messages ("(the model)" for the model itself)."""
        if self._names is None:
            self._names = {m: name or "(the model)" for m, name in self.modules.items()}
        return self._names
