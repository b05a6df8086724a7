"""schedule="auto": layerwise if its memory fits the budget, recompute if that fits, passes otherwise (`budget`).

Each schedule is judged by this model's figure for batches of this shape, when an earlier step measured one,
before it runs; without a figure it runs metered, and stops once what it keeps would pass the budget (recompute
runs metered every time, its backward's recomputation reserved before the backward starts). On
CUDA, an out-of-memory error sends the step to the next schedule as well. What ran and why is kept for
`accumnorm.last_schedule(model)`; the first time a model leaves layerwise for lack of memory, a warning says so.

Under a process group every rank runs the same schedule (its met calls are collectives): the ranks agree on
one before the step, from the figures of earlier steps, and it runs to the end, measuring for the next step.
"""
from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from .budget import Choice, Meter, OverBudget, figures, gradient_bytes, record_choice, signature
from .guards import refuse_unseen_batch_norms
from .lockstep import layerwise
from .passes import passes
from .recompute import RegionStateChanged, recompute
from .step import Step
from .store import Store

__all__ = ["run_auto"]

_SCHEDULES = {"layerwise": layerwise, "recompute": recompute}
_WARNED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models told once that auto left layerwise


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def run_auto(step: Step, new_step: Callable[[], Step], store: Store | None, start_over: Callable[[Step], None],
             samples: int, budget: int | None) -> Step:
    """Run the step under the first schedule that fits `budget` (None: any fits); fills the step as that one does."""
    if step.collectives.group is not None:
        return _run_agreed(step, new_step, store, start_over, samples, budget)
    model = step.model
    key, grads = signature(step.micro_batches[0]), gradient_bytes(model)
    known = figures(model)
    reasons: list[str] = []
    for name, schedule in _SCHEDULES.items():
        need = _known_need(known, key, name, grads, samples, budget, reasons)
        if need is not None and budget is not None and need > budget:
            continue
        # Recompute's regions and kept outputs follow the last step's measurements: its figure is measured anew.
        metered = need is None or name == "recompute"
        meter = Meter(None if budget is None else budget - grads, store, samples) if metered else None
        try:
            schedule(step, meter or store)
        except OverBudget:
            known[(key, name)] = meter.bytes / samples
            reasons.append(f"{name} would keep more than {_mib(budget)} (this step's meter stopped it first)")
        except torch.OutOfMemoryError as e:
            reasons.append(f"{name} ran out of memory ({e})")
        except RegionStateChanged as e:
            reasons.append(str(e))
        else:
            if meter is not None:
                known[(key, name)] = meter.bytes / samples
                need = grads + meter.bytes
            why = "it fits the memory budget" if not reasons else "; ".join(reasons)
            record_choice(model, Choice(name, why, need, budget))
            _tell(model, name, reasons, budget)
            return step
        start_over(step)
        step = new_step()
    return _run_passes(step, reasons, budget)


def _known_need(known: dict, key: Any, name: str, grads: int, samples: int, budget: int | None,
                reasons: list[str]) -> int | None:
    """What `name` would keep, by this model's figure from an earlier step (None: no figure); one over `budget` is
    said in `reasons`."""
    per_sample = known.get((key, name))
    need = None if per_sample is None else grads + int(per_sample * samples)
    if need is not None and budget is not None and need > budget:
        reasons.append(f"{name} would keep about {_mib(need)} (measured at an earlier step)")
    return need


def _run_passes(step: Step, reasons: list[str], budget: int | None) -> Step:
    """The step under passes, the schedule of last resort, saying why."""
    refuse_unseen_batch_norms(step.modules, "passes")
    record_choice(step.model, Choice("passes", "; ".join(reasons), None, budget))
    _tell(step.model, "passes", reasons, budget)
    passes(step)
    return step


def _run_agreed(step: Step, new_step: Callable[[], Step], store: Store | None, start_over: Callable[[Step], None],
                samples: int, budget: int | None) -> Step:
    """Under a process group: every rank must run the same schedule, whose met calls are collectives. Each rank
    names the first schedule that this model's figures from earlier steps say fits (one without a figure fits),
    the ranks take the last named, and it runs to the end: no rank stops on its own meter, which the others would
    wait on. The step measures what it keeps, for the next step's choice."""
    model = step.model
    key, grads = signature(step.micro_batches[0]), gradient_bytes(model)
    known = figures(model)
    reasons: list[str] = []
    order = [*_SCHEDULES, "passes"]
    for name in _SCHEDULES:
        need = _known_need(known, key, name, grads, samples, budget, reasons)
        if need is None or budget is None or need <= budget:
            break
    else:
        name = "passes"
    device = step.parameters[0].device if step.parameters else torch.device("cpu")
    agreed = order[step.collectives.max_(order.index(name), device)]
    if agreed != name:
        reasons.append(f"another rank of the process group needs {agreed}")
    if agreed == "passes":
        return _run_passes(step, reasons, budget)
    meter = Meter(None, store, samples)  # measures, never stops
    try:
        _SCHEDULES[agreed](step, meter)
    except RegionStateChanged as e:  # found by every rank alike, before any backward
        start_over(step)
        step, agreed, meter = new_step(), "layerwise", Meter(None, store, samples)
        reasons.append(str(e))
        layerwise(step, meter)
    known[(key, agreed)] = meter.bytes / samples
    record_choice(model, Choice(agreed, "; ".join(reasons) or "it fits the memory budget", grads + meter.bytes,
                                budget))
    _tell(model, agreed, reasons, budget)
    return step


def _tell(model: nn.Module, name: str, reasons: list[str], budget: int | None) -> None:
    if name == "layerwise" or model in _WARNED:
        return
    _WARNED.add(model)
    within = "" if budget is None else f" within the memory budget of {_mib(budget)}"
    warnings.warn(f"accumnorm.backward(schedule='auto'): running the {name} schedule{within}: {'; '.join(reasons)}. "
                  "accumnorm.last_schedule(model) tells what each step ran; this warning is given once per model",
                  RuntimeWarning, stacklevel=6)
