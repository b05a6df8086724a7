"""Run the study's grid: every norm x every BxK config x several runs, resumable, runs trained together.

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
batch with BatchNorm in ghost batches of B (see fused.py: the same computation, proven by tests).

On a CPU the cells also run in parallel, in worker processes that split the thread budget
(torch.get_num_threads()) between them: at micro-batch 1 a step is a long chain of small
calls that intra-op threads barely speed up (a step takes ~65 ms on 2 threads, ~93 ms on 1),
so two cells on one thread each get through ~1.4x more steps than one cell on two threads.
The cells are independent and every run's seed fixes its whole computation, so the results
do not depend on the process a cell ran in (_grid.py). Workers are spawned (torch is not fork-safe),
load the dataset once each, train one task (the runs of a cell trained together) at a time
and send their step counts to the parent's progress bar; the parent appends each finished
task's rows to results.csv as it comes back, so a kill loses only the tasks in progress.
On CUDA one process drives the GPU.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

import accumnorm

from . import _store as store
from ._data import OFFLINE, Dataset, load_dataset
from ._fused import fusable, use_ghost_batches
from ._grid import GridProgress, Task, in_process, in_workers, parallelism
from ._model import EXACT_BN, SimpleModel, SingleRun, StackedModel, norm_fn, stackable
from ._report import write_report
from ._settings import StudySettings, check_positive_int, parse_config
from ._tasks import study_task

if TYPE_CHECKING:
    from ._simclr import SimCLRSettings

__all__ = ["run_study", "data_order", "evaluate", "eval_batch", "NORM_STUDY"]


def eval_batch(device: torch.device) -> int:
    """Validation images per forward. On a GPU large batches amortize the calls; on a CPU the R-wide maps of 32
    images stay in cache, and evaluation runs twice as fast as with 256 (measured: 1.4 s against 3.2 s for 3
    stacked runs of the study net on 2,000 digits, one thread)."""
    return 32 if device.type == "cpu" else 256


def run_study(out: str | Path, settings: StudySettings | SimCLRSettings | None = None, *,
              device: str | torch.device | None = None, progress: bool = True, workers: int | None = None) -> Path:
    """Run (or resume) the grid of `settings` into `out`; write the reports; return `out`.

    `settings` say which task: StudySettings the normalization study, SimCLRSettings contrastive learning
    (`accumnorm.study._simclr`). Both share this grid: names x BxK configs x runs.

    Runs already in out/results.csv are skipped (rows of it that cannot be read are skipped with a warning, and
    their runs trained again). A cell that cannot run (e.g. torch's BatchNorm
    at micro-batch 1 where a feature map is 1x1) is reported with its reason and the grid goes on.
    `workers`: processes training cells in parallel on a CPU, each with torch.get_num_threads() //
    workers threads (default: one per thread of that budget, at most one per pending task); 1
    trains in this process. On CUDA always 1. The report says how many ran.
    """
    settings = settings or StudySettings()
    out = Path(out)
    device = _device(device)
    if workers is not None:
        check_positive_int("workers", workers)
    offline = settings.dataset in OFFLINE or settings.data_dir is None
    data_dir = None if offline else str(Path(settings.data_dir).resolve())
    settings = dataclasses.replace(settings, data_dir=data_dir)
    # May fail: nothing written yet (workers load their own).
    data = load_dataset(settings.dataset, settings.data_dir).to(device)
    _check_configs(settings, len(data.train_x))
    store.open_out(out, settings.to_json())

    kind = study_task(settings)
    cells = kind.cells(settings)
    runs = {(name, b, k, r) for name, b, k in cells for r in range(settings.runs)}
    rows = store.read_whole_runs(out, runs, range(settings.eval_every, settings.iterations + 1, settings.eval_every))
    done = {store.run_key(r) for r in rows}
    tasks = []
    for name, b, k in cells:
        pending = tuple(r for r in range(settings.runs) if (name, b, k, r) not in done)
        tasks += [Task(name, b, k, group) for group in kind.groups(name, pending) if group]
    workers, threads = parallelism(workers, device, len(tasks))
    total_runs = len(cells) * settings.runs
    bar = GridProgress(tasks, settings.iterations, total_runs - sum(len(t.runs) for t in tasks), total_runs, progress)
    failures: dict[tuple[str, int, int], str] = {}
    finished = (in_process(tasks, data, settings, bar) if workers == 1
                else in_workers(tasks, settings, workers, threads, bar))
    for task, outcome in finished:
        if isinstance(outcome, str):
            failures[task[:3]] = outcome
        else:
            rows += outcome
            store.write_results(out, rows)
    bar.close()
    kind.report(out, settings, rows, failures, device=str(device), workers=workers, threads=threads)
    return out


class _NormStudy:
    """The normalization study (StudySettings) as the runner's task (see tasks.StudyTask)."""

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


def _check_configs(settings: StudySettings, train_size: int) -> None:
    """Refuse, before anything runs, configs whose micro-batch the training set cannot fill."""
    too_big = [c for c in settings.configs if parse_config(c)[0] > train_size]
    if too_big:
        raise ValueError(f"configs {', '.join(too_big)} have micro-batches larger than the {train_size} training "
                         f"samples of {settings.dataset}: expected B <= {train_size}")


def _device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"device must be like 'cpu' or 'cuda', got {device!r}") from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return dev


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


def data_order(n: int, steps: int, per_step: int, seeds: Iterable[int]) -> torch.Tensor:
    """Sample indices (R, steps, per_step): per run, an endless stream of permutations of range(n) from its seed."""
    orders = []
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        epochs = math.ceil(steps * per_step / n)
        orders.append(torch.cat([torch.randperm(n, generator=gen) for _ in range(epochs)])[: steps * per_step])
    return torch.stack(orders).view(-1, steps, per_step)


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
