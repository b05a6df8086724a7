"""A step's running-statistics ledger: the calls of the whole batch it made, and the one update each gets.

A schedule counts each BatchNorm call of the whole batch (`count_call`: the factor its running statistics move
by, 1 over the calls so far for a momentum=None layer); the layerwise schedule's met calls move them at the call,
as torch's kernel does, and a schedule that meets the calls otherwise (passes) `record`s them, and each
micro-batch's InstanceNorm calls (`instance_norm`), for one update per call at the step's end
(`update_running_stats`), but for those whose micro-batches met at them (`move_instance_norm_now`). Every training
forward of a BatchNorm layer bumps its `num_batches_tracked`: the step sets each counter to its value before the
step plus the calls counted, and refuses a step whose forwards bumped one more often than it saw
(`check_every_call_seen`: a call that normalized with one micro-batch's statistics). Nothing else may move the
running statistics under the lockstep schedules: a hook or forward that writes them in place beside their
BatchNorm call (a decay before it) would do it once per micro-batch where the whole batch's forward does it once,
and is refused (`check_statistics_untouched`).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parameter import is_lazy

from ..._dist import Collectives
from ...functional import Moments, update_running_stats_
from ..intercept.calls import BNCall, INCall, describe
from ..intercept.forwards import BATCH_NORM_BUFFERS

__all__ = ["Ledger"]


@dataclass(eq=False)
class _InstanceNormStats:
    """One InstanceNorm call of the whole batch: the sums of its per-sample statistics over the micro-batches."""

    call: INCall
    count: int = 0
    sum_mean: Tensor | float = 0.0
    sum_var: Tensor | float = 0.0
    moved: bool = False  # its running statistics moved at the call (`move_instance_norm_now`)
    totals: tuple[Tensor, Tensor] | None = None  # the whole batch's statistics, once every piece is in (`_totals`)


class Ledger:
    """The BatchNorm and InstanceNorm calls of one step's whole batch, and their running-statistics updates."""

    def __init__(self, tracked_before: dict[_BatchNorm, Tensor], collectives: Collectives) -> None:
        # Each BatchNorm module's num_batches_tracked before the step: the micro-batch forwards bump it once per
        # call each, whole-batch torch once per call.
        self.tracked_before = tracked_before
        self.collectives = collectives
        self.calls_so_far: Counter[nn.Module] = Counter()  # whole-batch calls met, per BatchNorm module
        self.seen: Counter[nn.Module] = Counter()  # the BatchNorm layers' forwards the schedule saw
        self.tracked_versions = {m: m.num_batches_tracked._version for m in tracked_before}
        self.batch_norms: list[tuple[BNCall, Moments, float | None]] = []  # recorded calls, to update at the end
        self.instance_norms: list[_InstanceNormStats] = []
        self.norms: set[nn.Module] = set(tracked_before)  # the modules whose running statistics the step updates
        self.updated: set[int] = set()  # and the ids of the running statistics its calls update, whatever their names
        # Each BatchNorm layer's running statistics, with their version counters as the step last left them (before
        # it, then after each met call's update): for `check_statistics_untouched`. A lazy layer's are made by its
        # first forward.
        self.statistics = {id(t): (t, t._version, m) for m in tracked_before
                           for t in (m._buffers.get("running_mean"), m._buffers.get("running_var"))
                           if t is not None and not is_lazy(t)}
        self.beside: dict[nn.Module, str] = {}  # layers whose statistics one forward wrote beside its calls, and which

    def record(self, call: BNCall, stats: Moments) -> float | None:
        """Note a BatchNorm call of the whole batch, with its statistics, for the running-statistics update; the
        factor they will move by."""
        factor = self.count_call(call)
        self.batch_norms.append((call, stats, factor))
        return factor

    def move_now(self, call: BNCall, stats: Moments) -> Moments:
        """A met call across ranks, whose statistics are every rank's: its running statistics move now, as
        torch.batch_norm moves them at the call in one process (a later read in the forward finds them moved)."""
        factor = self.count_call(call)
        if call.running_mean is not None:
            update_running_stats_(call.running_mean, call.running_var, stats.mean, stats.unbiased_var, factor,
                                  stats.count)
        return stats

    def count_call(self, call: BNCall) -> float | None:
        """Count a BatchNorm call of the whole batch; the factor its running statistics move by."""
        m = call.module
        if m is not None:
            self.norms.add(m)
            self.updated.update(id(t) for t in (call.running_mean, call.running_var) if t is not None)
        if call.counted:  # a BatchNorm layer's forward: torch counts it in num_batches_tracked
            self.calls_so_far[m] += 1
            if m.momentum is None:  # a cumulative average over the calls so far, as torch's forward computes it
                return 1.0 / float(self.tracked_before[m] + self.calls_so_far[m])
        return call.momentum

    def check_statistics_untouched(self, tensors: Iterable[Tensor | None] | None, names: Mapping[nn.Module, str],
                                   refuse: bool = True) -> None:
        """Raise if a forward wrote any of these running statistics (None: every layer's) in place since the step last
        left them (`statistics_written`): a hook or forward that changes them beside their BatchNorm calls, once per
        micro-batch, or per pass, where the whole batch's forward would once. (A write through `.data` counts no
        version, and is not seen.) `refuse=False`, for one micro-batch's forward, which is the whole batch's: note the
        layer instead, whose statistics a region's recomputation would write again (`changed_statistics`)."""
        entries = self.statistics.values() if tensors is None else (
            self.statistics[id(t)] for t in tensors if t is not None and id(t) in self.statistics)
        changed = self._changed(entries)
        if changed is not None and not refuse:
            self.beside.setdefault(*changed)
        elif changed is not None:
            m, which = changed
            raise ValueError(
                f"bn='exact': a forward changed the {which} of {type(m).__name__} {names.get(m) or '(the model)'} in "
                "place beside its BatchNorm calls (a hook or forward that writes it). The step runs each micro-batch's "
                "forward where the whole batch runs its one, so it would change them more often than torch does, and "
                "the step updates them once per call for the whole batch. Nothing was changed. Change the running "
                "statistics outside the step (before or after it), or pass bn='micro'")

    def changed_statistics(self, modules: Iterable[nn.Module]) -> tuple[nn.Module, str] | None:
        """The first of `modules` whose running statistics a forward wrote since the step last left them, and which."""
        wanted = set(modules)
        noted = next(((m, which) for m, which in self.beside.items() if m in wanted), None)
        return noted or self._changed(entry for entry in self.statistics.values() if entry[2] in wanted)

    @staticmethod
    def _changed(entries: Iterable[tuple[Tensor, int, nn.Module]]) -> tuple[nn.Module, str] | None:
        for t, version, m in entries:
            if t._version != version:
                return m, "running_mean" if t is m._buffers.get("running_mean") else "running_var"
        return None

    def statistics_written(self, tensors: Iterable[Tensor | None] | None) -> None:
        """These running statistics (None: every layer's) are as the step left them now (a met call's update, a
        schedule's own write, or one forward of the whole batch)."""
        for t in (entry[0] for entry in list(self.statistics.values())) if tensors is None else tensors:
            entry = self.statistics.get(id(t)) if t is not None else None
            if entry is not None:
                self.statistics[id(t)] = (t, t._version, entry[2])

    def instance_norm(self, call: INCall, index: int, names: Mapping[nn.Module, str]) -> None:
        """Add micro-batch's piece of InstanceNorm call `index` (in its forward) to the whole batch's statistics."""
        if call.module is None:
            raise ValueError(
                f"bn='exact' met a F.instance_norm call over {call.input.shape[1]} channels whose running statistics "
                "are not buffers of the model: make the layer part of the model")
        if index == len(self.instance_norms):
            self.instance_norms.append(_InstanceNormStats(call))
            self.norms.add(call.module)
            self.updated.update(id(t) for t in (call.running_mean, call.running_var) if t is not None)
        entry = self.check_instance_norm(call, index, names)
        x = call.input.detach().flatten(2)
        with torch.no_grad():  # torch's instance_norm: per-sample mean and unbiased variance, averaged over samples
            var, mean = torch.var_mean(x if x.dtype == torch.float64 else x.float(), dim=2, correction=1)
        entry.count += call.input.shape[0]
        entry.sum_mean = entry.sum_mean + mean.sum(0)
        entry.sum_var = entry.sum_var + var.sum(0)

    def instance_norm_of_the_batch(self, call: INCall, names: Mapping[nn.Module, str]) -> int:
        """Note an InstanceNorm call over the whole batch at once (in batch_loss_fn, under a schedule whose running
        statistics move at the step's end), after the forward's calls, with its statistics as torch's call has them
        (this rank's); its index."""
        index = len(self.instance_norms)
        self.instance_norm(call, index, names)
        entry = self.instance_norms[index]
        entry.totals = (entry.sum_mean / entry.count, entry.sum_var / entry.count)
        return index

    def check_instance_norm(self, call: INCall, index: int, names: Mapping[nn.Module, str]) -> _InstanceNormStats:
        """Raise unless `call` is InstanceNorm call `index` as micro-batch 0 made it (on the same layer)."""
        entry = self.instance_norms[index]
        if entry.call.running_mean is not call.running_mean:
            raise ValueError(f"bn='exact' needs every micro-batch to make the same InstanceNorm calls in the same "
                             f"order; at InstanceNorm call {index} one made {describe(call, names)} where "
                             f"micro-batch 0 made {describe(entry.call, names)}")
        return entry

    def move_instance_norm_now(self, index: int) -> None:
        """Every micro-batch's piece of InstanceNorm call `index` is in (they met at it): its running statistics
        move now, as torch's kernel moves them at the call (a later read in the forward finds them moved)."""
        entry = self.instance_norms[index]
        self._move_instance_norm(entry)
        entry.moved = True

    def update_running_stats(self) -> None:
        """The running-statistics updates of the calls `record`ed, and of InstanceNorm's not moved at their call, one
        per call in forward order, as torch's whole-batch forward makes them; each BatchNorm's num_batches_tracked one
        up per call."""
        for call, stats, factor in self.batch_norms:
            if call.running_mean is not None:
                update_running_stats_(call.running_mean, call.running_var, stats.mean, stats.unbiased_var, factor,
                                      stats.count)
        for entry in self.instance_norms:
            if not entry.moved:
                self._move_instance_norm(entry)
        with torch.no_grad():
            for layers in self.counted_layers_by_device():  # one foreach op per device, not two ops per layer
                torch._foreach_copy_([m.num_batches_tracked for m in layers],
                                     torch._foreach_add([self.tracked_before[m] for m in layers],
                                                        [self.calls_so_far.get(m, 0) for m in layers]))

    def instance_norm_statistics(self, index: int) -> tuple[Tensor, Tensor]:
        """InstanceNorm call `index`'s statistics over the whole batch, every micro-batch's piece in (on every rank):
        the mean over the samples of each one's mean and unbiased variance, by which torch's kernel moves its running
        statistics."""
        return self._totals(self.instance_norms[index])

    def _totals(self, entry: _InstanceNormStats) -> tuple[Tensor, Tensor]:
        if entry.totals is None:
            count = entry.sum_mean.new_full((1,), entry.count)
            total = self.collectives.sum_(torch.cat([count, entry.sum_mean, entry.sum_var]))
            n, (mean, var) = total[0], total[1:].chunk(2)
            entry.totals = (mean / n, var / n)
        return entry.totals

    def _move_instance_norm(self, entry: _InstanceNormStats) -> None:
        mean, var = self._totals(entry)
        call = entry.call
        update_running_stats_(call.running_mean, call.running_var, mean, var, call.momentum)

    def counted_layers_by_device(self) -> list[list[_BatchNorm]]:
        """The BatchNorm layers whose num_batches_tracked the step counts, grouped by the counter's device (for ops
        over all of a device's counters at once)."""
        by_device: dict[torch.device, list[_BatchNorm]] = {}
        for m in self.tracked_before:
            by_device.setdefault(m.num_batches_tracked.device, []).append(m)
        return list(by_device.values())

    def keeps(self, module: nn.Module, buffer: str) -> bool:
        """Whether the step updates `module`'s buffer itself, once for the whole batch: a norm's running statistics
        and counter (a layer's by their names, or any buffer a call of the step updated as running statistics: a
        direct `F.batch_norm` call on a module's own), and the state of a layer that ends each step itself
        (`accumnorm_step_end`)."""
        return ((module in self.norms and buffer in BATCH_NORM_BUFFERS)
                or id(module._buffers.get(buffer)) in self.updated or hasattr(type(module), "accumnorm_step_end"))

    def check_every_call_seen(self, names: Mapping[nn.Module, str]) -> None:
        """Each BatchNorm forward in training bumps num_batches_tracked: every bump must be a call the step saw.

        A call that ran where no TorchFunctionMode reaches (TorchScript, a compiled graph, a thread of its own, C++)
        normalized with one micro-batch's statistics: the step is refused rather than silently wrong.
        """
        tracked_before = self.tracked_before
        for modules in self.counted_layers_by_device():
            bumps = (torch.stack([m.num_batches_tracked for m in modules])
                     - torch.stack([tracked_before[m] for m in modules])).tolist()
            for m, bumped in zip(modules, bumps):
                if bumped != self.seen.get(m, 0):
                    raise ValueError(
                        f"bn='exact' saw {self.seen.get(m, 0)} of the {bumped} training forwards of {type(m).__name__} "
                        f"{names.get(m, '')}: the others ran where accumnorm cannot reach them (TorchScript, a "
                        "torch.compile graph, a thread of their own, C++) with one micro-batch's statistics, or "
                        "outside the micro-batches' forwards (in batch_loss_fn), where the step does not count them. "
                        "Nothing was changed. Run that layer as Python in the calling thread, in the forward, or pass "
                        "bn='micro'")
