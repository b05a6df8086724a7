"""Which schedule runs a step: the one asked for, "auto"'s choice by memory, and every fallback. The one place.

`bn="micro"` runs plain accumulation. An exact schedule asked for runs as asked; recompute falls back to layerwise,
with a warning, where a region's forward changed its state (`RegionStateChanged`, handled in `_attempt` alone).
Under "auto", a whole-batch loss over a model without batch statistics runs one micro-batch at a time (GradCache's
scheme, exact there); otherwise the schedules of the table (`registry`) are judged in order by this model's figure
for batches of this shape, when an earlier step measured one, before they run; without a figure one runs metered,
and stops once what it keeps would pass the budget (`memory.budget`). On CUDA, an out-of-memory error sends the
step to the next schedule as well, and interleaved forwards that each moved a number on a module (`StateChanged`)
send it to passes, which gives each run the attributes anew; the table's unmetered schedule (passes) is the last
resort, whose meter can only refuse the step (a budget below even its need). Under a process group every rank runs
the same schedule (its met calls are collectives): the ranks agree on one before the step, from the figures of
earlier steps, and it runs to the end, measuring for the next step.

Each schedule tried gets a fresh `Step` from `new_step()`; one that cannot run the step exactly is undone by
`start_over` before the next begins, so the step that returns is the one that ran from the start. What ran and
why is kept for `accumnorm.last_schedule(model)`; the first time a model leaves layerwise, a warning says so.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor
from torch.utils._pytree import tree_leaves

from ..._warn import warn_at_caller
from ..checkpointing.checkpointed import RegionStateChanged
from ..intercept.guards import (
    gradient_hooks,
    has_norm_statistics,
    refuse_node_backward_hooks,
    refuse_unseen_batch_norms,
)
from ..memory.budget import (
    Choice,
    Figure,
    Meter,
    OverBudget,
    figures,
    format_bytes,
    gradient_bytes,
    record_choice,
    signature,
    stopped_figures,
)
from ..memory.store import Store
from ..safety.writes import StateChanged
from ..step.step import Step
from .base import Schedule
from .registry import SCHEDULES

__all__ = ["refuse_before_step", "run_step"]

_WARNED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models told once that auto left layerwise


def refuse_before_step(model: nn.Module, names: dict[nn.Module, str], schedule: str) -> None:
    """An exact step's refusals, before anything runs, of what the schedule asked for could not see or make exact
    (`names`: the model's modules); "auto" is judged as layerwise, the schedule it tries first (the others are judged
    again before they run)."""
    refuse_unseen_batch_norms(names, schedule if schedule in ("passes", "recompute") else "layerwise")
    refuse_node_backward_hooks(names)
    why = None if schedule == "auto" else _cannot_run(SCHEDULES[schedule], model)
    if why is not None:
        raise ValueError(f"bn='exact': {why}. Nothing was changed. Use schedule='layerwise' or 'recompute', which "
                         "back-propagate each micro-batch once")


def _cannot_run(schedule: Schedule, model: nn.Module) -> str | None:
    """Why `schedule` cannot run a step of `model` exactly, found before it runs; None if it can."""
    return None if schedule.backward_once else gradient_hooks(model, schedule.name)


def run_step(new_step: Callable[[], Step], schedule: str, store: Store | None, start_over: Callable[[Step], None],
             samples: int, budget: int | None, settings: dict[str, Any] | None = None) -> Step:
    """Run the step under the schedule asked for (module doc): `schedule` is backward's argument, `budget` the bytes
    "auto" may let it keep (None: any), `samples` the step's, `settings` the schedule's (checked by `args`); returns
    the step that ran."""
    step = new_step()
    if not step.exact:
        SCHEDULES["plain"].run(step, store)
        return step
    if schedule != "auto":
        return _asked_for(SCHEDULES[schedule].configured(**(settings or {})), step, new_step, store, start_over)
    if step.objective.whole and not has_norm_statistics(step.modules):
        # No layer with batch statistics: one micro-batch at a time (GradCache's scheme) is exact too, in the
        # memory of one micro-batch; a functional batch-norm call met on the way sends the step to layerwise.
        try:
            with step.norm_calls(_refuse_statistics, _refuse_statistics):
                SCHEDULES["plain"].run(step, store)
            return step
        except _NoStatistics:
            start_over(step)
            step = new_step()
    if step.collectives.group is not None:
        return _agreed(step, new_step, store, start_over, samples, budget)
    return _auto(step, new_step, store, start_over, samples, budget)


class _NoStatistics(BaseException):
    """Ends a one-micro-batch-at-a-time run of a whole-batch loss that met a norm call with batch statistics."""


def _refuse_statistics(call: Any) -> Tensor:
    raise _NoStatistics


def _attempt(schedule: Schedule, step: Step, store: Store | Meter | None) -> str | None:
    """Run `schedule`; None once it ran, or why it could not run this step exactly (a region whose forward changed its
    state, found before any backward)."""
    try:
        schedule.run(step, store)
    except RegionStateChanged as e:
        return str(e)
    return None


def _asked_for(schedule: Schedule, step: Step, new_step: Callable[[], Step], store: Store | None,
               start_over: Callable[[Step], None]) -> Step:
    """The schedule asked for; layerwise, with a warning, where it cannot run the step exactly."""
    why = _attempt(schedule, step, store)
    if why is None:
        record_choice(step.model, Choice(schedule.name, "asked for" + schedule.setting(), settings=schedule.settings))
        return step
    start_over(step)
    warn_at_caller(f"accumnorm.backward: {why}; using the layerwise schedule, which runs every forward once",
                   RuntimeWarning)
    step = new_step()
    SCHEDULES["layerwise"].run(step, store)
    record_choice(step.model, Choice("layerwise", f"{schedule.name} was asked for, but {why}"))
    return step


def _by_memory() -> list[Schedule]:
    """The exact schedules "auto" judges by memory, each at the settings it tries, fastest first."""
    return [c for s in SCHEDULES.values() if s.automatic and s.exact and s.metered for c in s.choices()]


def _last_resort() -> Schedule:
    """The exact schedule that keeps least, which "auto" runs when no other fits: the table's unmetered one."""
    return next(s for s in SCHEDULES.values() if s.automatic and s.exact and not s.metered)


def _auto(step: Step, new_step: Callable[[], Step], store: Store | None, start_over: Callable[[Step], None],
          samples: int, budget: int | None) -> Step:
    """Run the step under the first schedule that fits `budget` (None: any fits); fills the step as that one does."""
    model = step.model
    key, grads = signature(step.micro_batches[0]), gradient_bytes(model)
    known, stopped = figures(model), stopped_figures(model)
    reasons: list[str] = []
    refused: set[str] = set()  # schedules that could not run this step exactly, at any of their settings
    for schedule in _by_memory():
        if schedule.name in refused:
            continue
        why = _cannot_run(schedule, model)
        if why is not None:
            reasons.append(why)
            refused.add(schedule.name)
            continue
        name = schedule.label
        need = _known_need(known, key, name, grads, samples, budget, reasons, (key, name) in stopped)
        if need is not None and budget is not None and need > budget:
            continue
        # A figure a meter stopped is only a floor: where it fits, the schedule runs metered again.
        metered = need is None or schedule.remeasured or (key, name) in stopped
        meter = Meter(None if budget is None else budget - grads, store, samples, _batch(step)) if metered else None
        try:
            with step.bound.waived(None if metered else need):  # far below the budget: no resident checks
                why = _attempt(schedule, step, meter or store)
        except OverBudget:
            known[(key, name)] = Figure(meter.need, samples)
            stopped.add((key, name))
            reasons.append(f"{name} would keep more than {format_bytes(budget)} (this step's meter stopped it first)")
        except torch.OutOfMemoryError as e:
            reasons.append(f"{name} ran out of memory ({e})")
        except StateChanged as e:  # so would every interleaved schedule: passes gives each run the attributes anew
            reasons.append(e.reason)
            refused.update(s.name for s in _by_memory())
        else:
            if why is None:
                if meter is not None:
                    known[(key, name)] = Figure(meter.need, samples)
                    stopped.discard((key, name))
                    need = grads + meter.need
                record_choice(model, Choice(schedule.name, _why(schedule, reasons), need, budget, schedule.settings))
                _tell(model, name, reasons, budget)
                return step
            reasons.append(why)
            refused.add(schedule.name)
        start_over(step)
        step = new_step()
    return _run_last_resort(step, reasons, budget, samples)


def _batch(step: Step) -> list[Tensor]:
    """The step's micro-batches' tensors: views of the batch, whose memory the step does not add (`Meter`)."""
    return [t for t in tree_leaves(step.micro_batches) if isinstance(t, Tensor)]


def _known_need(known: dict, key: Any, name: str, grads: int, samples: int, budget: int | None,
                reasons: list[str], floor: bool = False) -> int | None:
    """What `name` would keep, by this model's figure from an earlier step (None: no figure; `floor`: one a meter
    stopped, what it keeps at least); one over `budget` is said in `reasons`."""
    figure = known.get((key, name))
    need = None if figure is None else grads + figure.need(samples)
    if need is not None and budget is not None and need > budget:
        about = "at least" if floor else "about"
        reasons.append(f"{name} would keep {about} {format_bytes(need)} (measured at an earlier step)")
    return need


def _run_last_resort(step: Step, reasons: list[str], budget: int | None, samples: int, stop: bool = True) -> Step:
    """The step under the last resort, saying why. Its meter measures what its full pass keeps, for the next
    steps' check of the budget (`check_budget_fits_passes`), and refuses the step where even that passes `budget`
    (`stop`: not under a process group, whose ranks stop together or not at all)."""
    schedule, model = _last_resort(), step.model
    refuse_unseen_batch_norms(step.modules, schedule.name)
    why = _cannot_run(schedule, model)
    if why is not None:
        raise ValueError(f"bn='exact': no schedule can run this step exactly within the memory budget of "
                         f"{format_bytes(budget)}: {'; '.join([*reasons, why])}. Nothing was changed. Give it a "
                         "larger memory_budget, or take the hook off")
    key, grads = signature(step.micro_batches[0]), gradient_bytes(model)
    meter = Meter(None if budget is None or not stop else budget - grads, None, samples, _batch(step))
    known = (key, schedule.label)
    try:
        schedule.run(step, meter)
    except OverBudget:
        figures(model)[known] = Figure(meter.need, samples)
        stopped_figures(model).add(known)
        raise ValueError(
            f"memory_budget is {budget} bytes, but even the passes schedule, which keeps least, needs at least "
            f"{grads + meter.need} bytes: the step's gradients, {grads}, and at least {meter.need} that its pass of "
            f"one micro-batch keeps, as far as its meter counted before it stopped the step ({'; '.join(reasons)}). "
            "Nothing was changed. Give a larger budget, or a smaller micro_batch_size") from None
    figures(model)[known] = Figure(meter.need, samples)
    stopped_figures(model).discard(known)
    record_choice(model, Choice(schedule.name, "; ".join(reasons), grads + meter.need, budget))
    _tell(model, schedule.name, reasons, budget)
    return step


def _agreed(step: Step, new_step: Callable[[], Step], store: Store | None, start_over: Callable[[Step], None],
            samples: int, budget: int | None) -> Step:
    """Under a process group: every rank must run the same schedule, whose met calls are collectives. Each rank
    names the first schedule that this model's figures from earlier steps say fits (one without a figure fits),
    the ranks take the last named, and it runs to the end: no rank stops on its own meter, which the others would
    wait on. The step measures what it keeps, for the next step's choice."""
    model = step.model
    key, grads = signature(step.micro_batches[0]), gradient_bytes(model)
    known = figures(model)
    reasons: list[str] = []
    order = [*_by_memory(), _last_resort()]
    for schedule in order[:-1]:
        why = _cannot_run(schedule, model)
        if why is not None:  # every rank alike: each skips it
            reasons.append(why)
            continue
        need = _known_need(known, key, schedule.label, grads, samples, budget, reasons)
        if need is None or budget is None or need <= budget:
            break
    else:
        schedule = order[-1]
    device = step.parameters[0].device if step.parameters else torch.device("cpu")
    agreed = order[step.collectives.max_(order.index(schedule), device)]
    if agreed is not schedule:
        reasons.append(f"another rank of the process group needs {agreed.label}")
    if agreed is order[-1]:
        return _run_last_resort(step, reasons, budget, samples, stop=False)
    meter = Meter(None, store, samples, _batch(step))  # measures, never stops
    why = _attempt(agreed, step, meter)
    if why is not None:  # found by every rank alike, before any backward
        start_over(step)
        step = new_step()
        agreed, meter = SCHEDULES["layerwise"], Meter(None, store, samples, _batch(step))
        reasons.append(why)
        agreed.run(step, meter)
    known[(key, agreed.label)] = Figure(meter.need, samples)
    record_choice(model, Choice(agreed.name, _why(agreed, reasons), grads + meter.need, budget, agreed.settings))
    _tell(model, agreed.label, reasons, budget)
    return step


def _why(schedule: Schedule, reasons: list[str]) -> str:
    """Why "auto" ran `schedule`, and at which settings (`last_schedule`)."""
    why = "; ".join(reasons) or "it fits the memory budget"
    return f"{why}; it ran{schedule.setting()}" if schedule.setting() else why


def _tell(model: nn.Module, name: str, reasons: list[str], budget: int | None) -> None:
    if name == "layerwise" or model in _WARNED:
        return
    _WARNED.add(model)
    within = "" if budget is None else f" within the memory budget of {format_bytes(budget)}"
    warn_at_caller(f"accumnorm.backward(schedule='auto'): running the {name} schedule{within}: "
                   f"{'; '.join(reasons)}. accumnorm.last_schedule(model) tells what each step ran; this warning is "
                   "given once per model", RuntimeWarning)
