"""One optimizer step's gradient, made each way bench_backward.py compares, and the models prepared for it.

A method is `step(model, batch, micro, case)`: it accumulates into `.grad` the gradient of `case`'s loss over
`batch`, `micro` samples at a time. Plain accumulation is the usual loop; the others are `accumnorm.backward`'s
exact schedules, each one that this accumnorm accepts (`exact_schedules`: asked, not assumed), and, beside
recompute, plain accumulation with recompute's regions checkpointed (`checkpointed_step`).
"""
from __future__ import annotations

import copy
import sys
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from _models import MODELS, Batch, Case
from torch.overrides import TorchFunctionMode

import accumnorm

Method = Callable[[nn.Module, Batch, int, Case], None]

# The exact schedules a table can show, in its order; "recompute" where accumnorm.backward has it.
SCHEDULES = ("layerwise", "recompute", "passes")


def split(batch: Batch, micro: int) -> list[Batch]:
    """The micro-batches of a tensor or a tuple/list of tensors, micro samples each (the last may be smaller)."""
    if isinstance(batch, torch.Tensor):
        return list(batch.split(micro))
    return [type(batch)(parts) for parts in zip(*(t.split(micro) for t in batch))]


def samples(batch: Batch) -> int:
    return len(batch if isinstance(batch, torch.Tensor) else batch[0])


def to(batch: Batch, device: torch.device) -> Batch:
    return batch.to(device) if isinstance(batch, torch.Tensor) else type(batch)(t.to(device) for t in batch)


def plain_step(model: nn.Module, batch: Batch, micro: int, case: Case) -> None:
    """Plain accumulation: the models' own BatchNorm, loss * b / B, backward, once per micro-batch."""
    for part in split(batch, micro):
        (case.loss(model, part) * samples(part) / samples(batch)).backward()


def whole_step(model: nn.Module, batch: Batch, micro: int, case: Case) -> None:
    """The whole batch at once, in torch: what accumulation stands in for."""
    plain_step(model, batch, samples(batch), case)


def checkpointed_step(model: nn.Module, batch: Batch, micro: int, case: Case) -> None:
    """Plain accumulation with the regions the recompute schedule would choose for this model each run in torch's
    `checkpoint(use_reentrant=False)`, and nothing else of accumnorm's: what checkpointing those regions costs by
    itself, the floor under recompute's time. No convolution keeps its output, as recompute's may."""
    from accumnorm._engine.recompute import checkpointed  # the schedule's own regions, not a public API
    from accumnorm._engine.regions import choose_regions

    with checkpointed(choose_regions(model), lambda frame, region: None):
        plain_step(model, batch, micro, case)


def schedule_step(schedule: str) -> Method:
    def step(model: nn.Module, batch: Batch, micro: int, case: Case) -> None:
        if case.batch_loss is None:
            accumnorm.backward(model, batch, case.loss, micro_batch_size=micro, schedule=schedule)
        else:  # the loss once over the whole batch's outputs
            accumnorm.backward(model, batch, micro_batch_size=micro, schedule=schedule, forward_fn=case.forward,
                               batch_loss_fn=case.batch_loss)
    return step


def accepts(schedule: str) -> bool:
    """Whether accumnorm.backward takes `schedule`: one step of a two-layer net, asked directly."""
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    try:
        accumnorm.backward(net, torch.randn(4, 3), lambda m, x: m(x).square().mean(), micro_batch_size=2,
                           schedule=schedule)
    except ValueError as e:
        if str(e).startswith("schedule must be"):  # the argument check's refusal of a name it does not know
            return False
        raise
    return True


def exact_schedules() -> list[str]:
    return [s for s in SCHEDULES if accepts(s)]


def timed_methods(schedules: list[str]) -> list[str]:
    """The methods timed, in the table's order: plain, the schedules, and after recompute its checkpointed floor."""
    return ["plain", *(m for s in schedules for m in ((s, "checkpointed") if s == "recompute" else (s,)))]


def methods(schedules: list[str]) -> dict[str, Method]:
    """Every method by name: plain, the whole batch, the exact schedules given, and the checkpointed floor."""
    return {"plain": plain_step, "whole": whole_step, "checkpointed": checkpointed_step,
            **{s: schedule_step(s) for s in schedules}}


class CountBN(TorchFunctionMode):
    """Counts the training-mode F.batch_norm calls made under it (torch's, timm's, anyone's BatchNorm)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.batch_norm and kwargs.get("training", args[5] if len(args) > 5 else False):
            self.calls += 1
        return func(*args, **kwargs)


def bn_calls(model: nn.Module, batch: Batch, loss_fn: Callable[[nn.Module, Batch], torch.Tensor]) -> int:
    """L: the BatchNorm calls one forward makes (counted on a copy, on 2 samples, without grad)."""
    with torch.no_grad(), CountBN() as count:
        loss_fn(copy.deepcopy(model), split(batch, 2)[0])
    return count.calls


def prepare(name: str, size: int, volume: int, device: torch.device) -> tuple[nn.Module, Batch] | None:
    """The model (seeded, no dropout) and its batch on the device; None, with a note, if its library is missing."""
    case = MODELS[name]
    torch.manual_seed(0)
    try:
        model = case.build().train().to(device)
    except ImportError as e:  # a benchmark extra that is not installed
        print(f"note: {name} skipped: {e}", file=sys.stderr, flush=True)
        return None
    for m in model.modules():  # dropout would make the runs differ; timing does not need it
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
    return model, to(case.batch(size, volume), device)
