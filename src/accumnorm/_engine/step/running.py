"""Running statistics as the forwards of a schedule that runs them several times find them.

The passes schedule runs each micro-batch's forward 2L + 1 times and updates the running statistics once, at
the step's end, from the whole batch's statistics of each call. A forward may read them on its way (an
eval-mode call on the same layer after its training call, a loss term, a teacher pass after the student's): it
must find them as the whole batch's forward would at that point, moved by the calls before and by none after.
Before each write, the ledger checks that no forward wrote them since (`Ledger.check_statistics_untouched`): a hook
that decays them would do it once per pass.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn
from torch import Tensor

from ...functional import Moments, update_running_stats_
from ..intercept.calls import BNCall
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
        mean, var = call.running_mean, call.running_var
        if mean is None:
            return None
        if id(mean) not in self.before:
            self.before[id(mean)] = (mean, var, mean.clone(), None if var is None else var.clone())
        last_mean, last_var = self.now.get(id(mean), self.before[id(mean)][2:])
        new = (last_mean.clone(), None if last_var is None else last_var.clone())
        update_running_stats_(*new, stats.mean, stats.unbiased_var, factor, stats.count)
        self.now[id(mean)] = new
        return new

    def moved(self, call: BNCall, values: tuple[Tensor, Tensor | None] | None) -> None:
        """A forward made `call`, whose running statistics are now `values` (None: not known yet, or none)."""
        if values is not None:
            self._put([(call.running_mean, values[0]), (call.running_var, values[1])])

    def restore(self, check: bool = True) -> None:
        self._put([pair for mean, var, old_mean, old_var in self.before.values()
                   for pair in ((mean, old_mean), (var, old_var))], check)

    def __enter__(self) -> RunningStatistics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore(check=False)

    def _put(self, pairs: list[tuple[Tensor | None, Tensor | None]], check: bool = True) -> None:
        """Copy each value into its tensor, where both are (a layer without running variance has None for it): in one
        call, outside the step's torch-function mode. A step runs this at every BatchNorm call of every pass, and for
        every layer at each micro-batch's start."""
        targets = [(t, value) for t, value in pairs if t is not None and value is not None]
        if not targets:
            return
        tensors = [t for t, _ in targets]
        if check:
            self.ledger.check_statistics_untouched(tensors, self.names)
        with torch._C.DisableTorchFunction(), torch.no_grad():
            torch._foreach_copy_(tensors, [value for _, value in targets])
        self.ledger.statistics_written(tensors)
