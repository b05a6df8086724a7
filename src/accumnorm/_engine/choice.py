"""Which exact schedule runs a step: the one asked for, or under "auto" the first that fits the memory budget.

`run_exact` takes a fresh `Step` from `new_step()` for each schedule it tries; a schedule that cannot run the
step exactly (a whole-batch loss that meets batch statistics one micro-batch at a time, a region whose forward
changed its state) is undone by `_start_over` before the next one begins, so the step that returns is the one
that ran from the start.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch.nn as nn
from torch import Tensor

from .auto import run_auto
from .budget import Choice, figures, gradient_bytes, record_choice, signature
from .guards import has_norm_statistics
from .lockstep import layerwise
from .passes import passes
from .plain import plain
from .recompute import RegionStateChanged, recompute
from .step import Step
from .store import Store
from .transaction import Transaction

__all__ = ["run_exact", "run_plain", "check_budget_fits_passes"]


def run_plain(step: Step) -> Step:
    """bn="micro": plain accumulation, each micro-batch's forward and backward in turn."""
    return _run(plain, step)


def _run(schedule: Callable[[Step], None], step: Step) -> Step:
    schedule(step)
    return step


class _NoStatistics(BaseException):
    """Ends a one-micro-batch-at-a-time run of a whole-batch loss that met a norm call with batch statistics."""


def _refuse_statistics(call: Any) -> Tensor:
    raise _NoStatistics


def check_budget_fits_passes(model: nn.Module, budget: int, micro_batch: Any, size: int) -> None:
    """Refuse, before anything runs, a budget below what even the passes schedule needs: the step's gradients, and
    one micro-batch's saved tensors where an earlier step measured them."""
    per_sample = max((v for (key, _), v in figures(model).items() if key == signature(micro_batch)), default=None)
    need = gradient_bytes(model) + (0 if per_sample is None else int(per_sample * size))
    if budget < need:
        raise ValueError(f"memory_budget is {budget} bytes, but even the passes schedule needs about {need} bytes "
                         f"(the step's gradients{', and one micro-batch' if per_sample is not None else ''}); "
                         "give a larger budget, or a smaller micro_batch_size")


def run_exact(new_step: Callable[[], Step], schedule: str, store: Store | None, transaction: Transaction,
               samples: int, budget: int | None) -> Step:
    """The exact schedule asked for; under "auto", the first that fits the memory budget (`auto`)."""
    if schedule == "passes":
        step = _run(passes, new_step())
        record_choice(step.model, Choice("passes", "asked for"))
        return step
    if schedule == "recompute":
        return _recompute_or_layerwise(new_step, store, transaction)
    step = new_step()
    if step.objective.whole and schedule == "auto" and not has_norm_statistics(step.modules):
        # No layer with batch statistics: one micro-batch at a time (GradCache's scheme) is exact too, in the
        # memory of one micro-batch; a functional batch-norm call met on the way sends the step to layerwise.
        try:
            with step.norm_calls(_refuse_statistics, _refuse_statistics):
                return _run(lambda s: plain(s, exact=True), step)
        except _NoStatistics:
            _start_over(step, transaction)
            step = new_step()
    if schedule == "layerwise":
        step = _run(lambda s: layerwise(s, store), step)
        record_choice(step.model, Choice("layerwise", "asked for"))
        return step
    return run_auto(step, new_step, store, lambda s: _start_over(s, transaction), samples, budget)


def _recompute_or_layerwise(new_step: Callable[[], Step], store: Store | None, transaction: Transaction) -> Step:
    """The recompute schedule; layerwise, with a warning, where a region's forward changed its module's state."""
    step = new_step()
    try:
        step = _run(lambda s: recompute(s, store), step)
        record_choice(step.model, Choice("recompute", "asked for"))
        return step
    except RegionStateChanged as e:
        _start_over(step, transaction)
        warnings.warn(f"accumnorm.backward: {e}; using the layerwise schedule, which runs every forward once",
                      RuntimeWarning, stacklevel=5)
        step = _run(lambda s: layerwise(s, store), new_step())
        record_choice(step.model, Choice("layerwise", f"recompute was asked for, but {e}"))
        return step


def _start_over(step: Step, transaction: Transaction) -> None:
    """Undo a schedule's partial run for another to start the step again: gradients, buffers, and every
    micro-batch's random stream back at its start (the next schedule draws what it would have drawn alone)."""
    transaction.rollback()
    transaction.begin()
    step.rng.rewind()
