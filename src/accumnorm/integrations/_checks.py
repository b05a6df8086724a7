"""Set-up checks that the integrations share: each raises before any step."""
from __future__ import annotations

from typing import Any

from torch import nn

from .._engine.args import check_args, check_schedule_options
from .._engine.step.objective import LossFn

__all__ = ["backward_options"]


def backward_options(model: nn.Module, loss_fn: LossFn, *, micro_batch_size: Any, bn: Any, schedule: Any,
                     store: Any, memory_budget: Any = None, keep_every: Any = None) -> dict[str, Any]:
    """The keyword arguments every step passes to `accumnorm.backward`, checked as it checks them but once, at
    set-up: a wrong one fails before the framework starts instead of at the first step."""
    check_args(model, loss_fn, micro_batch_size, bn, schedule)
    check_schedule_options(schedule, store, memory_budget, keep_every)
    return dict(micro_batch_size=micro_batch_size, bn=bn, schedule=schedule, store=store, memory_budget=memory_budget,
                keep_every=keep_every)

