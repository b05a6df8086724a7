"""Running statistics as the forwards of a schedule that runs them several times find them.

The passes schedule runs each micro-batch's forward 2L + 1 times and updates the running statistics once, at
the step's end, from the whole batch's statistics of each call (BatchNorm's, and InstanceNorm's that track them). A
forward may read them on its way (an eval-mode call on the same layer after its training call, a loss term, a
teacher pass after the student's): it must find them as the whole batch's forward would at that point, moved by the
calls before and by none after. Before each write, the ledger checks that no forward wrote them since
(`Ledger.check_statistics_untouched`): a hook that decays them would do it once per pass.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn as nn
from torch import Tensor

from ...functional import Moments, update_running_stats_
from ..intercept.calls import BNCall, INCall
from .ledger import Ledger

__all__ = ["RunningStatistics"]


class RunningStatistics:
    """The running statistics as each forward of a pass finds them: as before the step at its start, and after
    call i as the whole batch's forward leaves them after its call i (a forward may read them there: an eval-mode
    call on the same layer, a loss term). The step's own update, at its end, starts from the values before it,
    which the block puts back."""

    def __init__(self, ledger: Ledger, names: Mapping[nn.Module, str]) -> None:
        self.ledger, self.names = ledger, names
        self.before: dict[int, tuple[Tensor, Tensor | None, Tensor, Tensor | None]] = {}  # id(running_mean) -> ...
        self.now: dict[int, tuple[Tensor, Tensor | None]] = {}  # the values after the last call recorded

    def after(self, call: BNCall, stats: Moments, factor: float | None) -> tuple[Tensor, Tensor | None] | None:
        """The running statistics after `call`, a call of the whole batch with `stats` (the calls recorded in
        forward order): its update applied to the values after the last call before it on the same tensors."""
        return self._next(call, lambda mean, var: update_running_stats_(
            mean, var, stats.mean, stats.unbiased_var, factor, stats.count))

    def after_instance_norm(self, call: INCall, mean: Tensor, var: Tensor) -> tuple[Tensor, Tensor | None] | None:
        """The running statistics after `call`, an InstanceNorm call of the whole batch whose samples' statistics
        average to `mean` and `var` (`Ledger.instance_norm_statistics`), as `after` gives a BatchNorm call's."""
        return self._next(call, lambda m, v: update_running_stats_(m, v, mean, var, call.momentum))

    def _next(self, call: BNCall | INCall,
              update: Callable[[Tensor, Tensor | None], None]) -> tuple[Tensor, Tensor | None] | None:
        mean, var = call.running_mean, call.running_var
        if mean is None:
            return None
        if id(mean) not in self.before:
            self.before[id(mean)] = (mean, var, mean.clone(), None if var is None else var.clone())
        last_mean, last_var = self.now.get(id(mean), self.before[id(mean)][2:])
        new = (last_mean.clone(), None if last_var is None else last_var.clone())
        update(*new)
        self.now[id(mean)] = new
        return new

    def moved(self, call: BNCall | INCall, values: tuple[Tensor, Tensor | None] | None) -> None:
        """A forward made `call`, whose running statistics are now `values` (None: not known yet, or none). As torch
        moves them: BatchNorm's kernel without counting a version, InstanceNorm's by a `copy_`, which counts one (a
        tensor saved before it for a backward is then refused there, as in torch)."""
        if values is not None:
            self._put([(call.running_mean, values[0]), (call.running_var, values[1])], counted=isinstance(call, INCall))

    def finish(self) -> None:
        """Each as the whole batch's forward leaves it, every call made: as a backward finds it, which runs after the
        forward (an eval-mode call's, which saved them before a later call moved them), for a pass stopped short."""
        self._put([pair for mean, var, _, _ in self.before.values() for pair in zip((mean, var), self.now[id(mean)])])

    def restore(self, check: bool = True) -> None:
        self._put([pair for mean, var, old_mean, old_var in self.before.values()
                   for pair in ((mean, old_mean), (var, old_var))], check)

    def __enter__(self) -> RunningStatistics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore(check=False)

    def _put(self, pairs: list[tuple[Tensor | None, Tensor | None]], check: bool = True, counted: bool = False) -> None:
        """Copy each value into its tensor, where both are (a layer without running variance has None for it): in one
        call, outside the step's torch-function mode. A step runs this at every BatchNorm call of every pass, and for
        every layer at each micro-batch's start."""
        targets = [(t, value) for t, value in pairs if t is not None and value is not None]
        if not targets:
            return
        tensors = [t for t, _ in targets]
        if check:
            self.ledger.check_statistics_untouched(tensors, self.names)
        # Uncounted through `.data`, as torch's batch-norm kernel moves them: an eval-mode call earlier in the forward
        # saved them for its backward, which a counted write would refuse.
        with torch._C.DisableTorchFunction(), torch.no_grad():
            torch._foreach_copy_(tensors if counted else [t.data for t in tensors], [value for _, value in targets])
        self.ledger.statistics_written(tensors)
