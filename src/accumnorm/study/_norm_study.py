"""The normalization study as a task of the runner: `accumnorm study` (--task bn), settings in `StudySettings`.

The protocol is the study's (its loop is ../shared/bench/seed_loop.py in this project's
checkout): the VGG-like SimpleModel, Adam, K micro-batches of B per optimizer step with the
loss divided by K, a validation pass every `eval_every` steps. Each run r of a cell is seeded
with seed + r for its initialization and its data order, so run r of every cell starts from
the same weights (for the same norm) and sees the same samples: cells differ by what is
being studied, not by luck. Differences from the study's loop, none of which changes the
arithmetic of a step: data preloaded as tensors, the data order an endless stream of
permutations (no short last batch at an epoch's end), train_loss the mean over all
micro-batches since the previous evaluation, the runs of a cell trained side by side, and
plain-accumulation steps of models that allow it computed as one forward/backward of the whole
batch with BatchNorm in ghost batches of B (see _fused.py: the same computation, proven by tests).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import accumnorm

from ._data import Dataset
from ._fused import fusable, use_ghost_batches
from ._model import EXACT_BN, SimpleModel, SingleRun, StackedModel, norm_fn, stackable
from ._report import write_report
from ._settings import StudySettings, parse_config
from ._tasks import data_order

__all__ = ["NORM_STUDY", "evaluate", "eval_batch"]


class _NormStudy:
    """The normalization study (StudySettings) as the runner's task (see _tasks.StudyTask)."""

    def cells(self, settings: StudySettings) -> list[tuple[str, int, int]]:
        return [(name, *parse_config(c)) for name in settings.norms for c in settings.configs]

    def groups(self, name: str, runs: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Runs of a per-channel norm train side by side in one wide model; others one at a time."""
        return [runs] if stackable(SimpleModel(norm_fn(name))) else [(r,) for r in runs]

    def train(self, *args: Any) -> list[dict[str, Any]]:
        return _train(*args)  # looked up when called: tests replace it

    def report(self, *args: Any, **kwargs: Any) -> None:
        write_report(*args, **kwargs)


NORM_STUDY = _NormStudy()


def eval_batch(device: torch.device) -> int:
    """Validation images per forward. On a GPU large batches amortize the calls; on a CPU the R-wide maps of 32
    images stay in cache, and evaluation runs twice as fast as with 256 (measured: 1.4 s against 3.2 s for 3
    stacked runs of the study net on 2,000 digits, one thread)."""
    return 32 if device.type == "cpu" else 256


def _train(name: str, b: int, k: int, runs: Sequence[int], data: Dataset, settings: StudySettings,
           on_step: Callable[[int], None]) -> list[dict[str, Any]]:
    """Train `runs` of cell (norm `name`, B=b, K=k) side by side; one row per run per evaluation."""
    device = data.train_x.device
    models = []
    for r in runs:
        torch.manual_seed(settings.seed + r)  # run r starts exactly where a lone SimpleModel under this seed would
        models.append(SimpleModel(norm_fn(name), in_channels=data.train_x.shape[1], num_classes=data.num_classes))
    bn_mode = "exact" if name == EXACT_BN else "micro"  # "micro": per-micro-batch statistics, as the study
    # A plain-accumulation step is one whole-batch forward with ghost batches where the layers allow it.
    fused = bn_mode == "micro" and fusable(models[0])
    # Else plain accumulation runs each micro-batch's backward once: conv weight gradients can wait for one
    # call per step.
    model = (StackedModel(models, defer_weight_grads=bn_mode == "micro" and not fused) if len(models) > 1
             else SingleRun(models[0])).to(device)
    if fused:
        use_ghost_batches(model, b)
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
    order = data_order(len(data.train_x), settings.iterations, b * k, [settings.seed + r for r in runs]).to(device)

    # Per-run loss of every completed forward, summed on the device: no host sync per step.
    # bn="exact" makes several complete forwards of a micro-batch, all with the same loss, so the
    # mean over forwards is still the mean over micro-batches.
    loss_sum, forwards = torch.zeros(len(runs), device=device), 0

    def loss_fn(model: nn.Module, micro_batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        nonlocal loss_sum, forwards
        x, y = micro_batch
        per_run = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none").view(y.shape).mean(0)
        loss_sum, forwards = loss_sum + per_run.detach(), forwards + 1
        return per_run.sum()  # each run's parameters get exactly the gradient of its own mean loss

    rows, start = [], time.perf_counter()
    for it in range(1, settings.iterations + 1):
        idx = order[:, it - 1].T  # (B*K, R): sample n of the effective batch, one per run
        batch = (data.train_x[idx], data.train_y[idx])
        if fused:
            loss_fn(model, batch).backward()  # the mean over the whole batch: plain accumulation's gradient
        else:
            accumnorm.backward(model, batch, loss_fn, micro_batch_size=b, bn=bn_mode)  # ends the step of bn-stale
        if isinstance(model, StackedModel):
            model.flush_weight_grads()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        on_step(len(runs))
        if it % settings.eval_every == 0:
            acc = evaluate(model, data.valid_x, data.valid_y, len(runs)).tolist()
            loss = (loss_sum / forwards).tolist()
            seconds = round(time.perf_counter() - start, 3)
            rows += [dict(norm=name, batch_size=b, num_accum=k, run=r, iter=it, train_loss=loss[i],
                          valid_acc=acc[i], seconds=seconds) for i, r in enumerate(runs)]
            loss_sum, forwards = torch.zeros_like(loss_sum), 0
    return rows


@torch.inference_mode()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, runs: int) -> torch.Tensor:
    """Validation accuracy (R,) of each run of a stacked model, in large batches."""
    model.eval()
    correct = torch.zeros(runs, device=x.device)
    size = eval_batch(x.device)
    for xb, yb in zip(x.split(size), y.split(size)):
        logits = model(xb.unsqueeze(1).expand(-1, runs, *xb.shape[1:]))  # every run sees the same images
        correct += (logits.argmax(-1) == yb[:, None]).sum(0)
    model.train()
    return correct / len(y)
