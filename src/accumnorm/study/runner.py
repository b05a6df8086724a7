"""Run the study's grid: every norm x every BxK config x several runs, resumable, runs trained together.

The protocol is the study's (its loop is ../shared/bench/seed_loop.py in this project's
checkout): the VGG-like SimpleModel, Adam, K micro-batches of B per optimizer step with the
loss divided by K, a validation pass every `eval_every` steps. Each run r of a cell is seeded
with seed + r for its initialization and its data order, so run r of every cell starts from
the same weights (for the same norm) and sees the same samples: cells differ by what is
being studied, not by luck. Differences from the study's loop, none of which changes the
arithmetic of a step: data preloaded as tensors, the data order an endless stream of
permutations (no short last batch at an epoch's end), train_loss the mean over all
micro-batches since the previous evaluation, and the runs of a cell trained side by side.
"""
from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import accumnorm
from . import store
from .data import Dataset, load_dataset
from .model import EXACT_BN, SimpleModel, SingleRun, StackedModel, norm_fn, stackable
from .report import write_report
from .settings import StudySettings, parse_config

EVAL_BATCH = 256  # validation images per forward: big enough to amortize calls, small enough for R-wide maps


def run_study(out: str | Path, settings: StudySettings | None = None, *, device: str | torch.device | None = None,
              progress: bool = True) -> Path:
    """Run (or resume) the grid of `settings` into `out`; write the reports; return `out`.

    Runs already in out/results.csv are skipped. A cell that cannot run (e.g. torch's BatchNorm
    at micro-batch 1 where a feature map is 1x1) is reported with its reason and the grid goes on.
    """
    settings = settings or StudySettings()
    out = Path(out)
    device = _device(device)
    data_dir = None if settings.dataset == "digits" or settings.data_dir is None else str(Path(settings.data_dir).resolve())
    settings = dataclasses.replace(settings, data_dir=data_dir)
    data = load_dataset(settings.dataset, settings.data_dir).to(device)  # may fail: nothing written yet
    store.open_out(out, settings.to_json())

    done = {(r["norm"], r["batch_size"], r["num_accum"], r["run"]) for r in store.read_results(out)}
    cells = [(name, *parse_config(c)) for name in settings.norms for c in settings.configs]
    failures: dict[tuple[str, int, int], str] = {}
    total_runs = len(cells) * settings.runs
    bar = _progress_bar(total_runs * settings.iterations, len(done) * settings.iterations, progress)
    for name, b, k in cells:
        pending = [r for r in range(settings.runs) if (name, b, k, r) not in done]
        cell_end = bar.n + len(pending) * settings.iterations
        # Runs of a per-channel norm train side by side in one wide model; others one at a time.
        groups = [pending] if stackable(SimpleModel(norm_fn(name))) else [[r] for r in pending]
        for group in filter(None, groups):
            bar.set_postfix_str(f"{bar.n // settings.iterations}/{total_runs} runs done, now {name} {b}x{k} "
                                f"run{'s' if len(group) > 1 else ''} {','.join(map(str, group))}")
            try:
                rows = _train(name, b, k, group, data, settings, bar)
            except (ValueError, RuntimeError) as err:  # e.g. torch's BatchNorm on a 1x1 map at micro-batch 1
                failures[(name, b, k)] = str(err).strip().splitlines()[0]
                break
            store.append_results(out, rows)
        bar.update(cell_end - bar.n)  # a failed cell's runs count as done: the grid goes on
    bar.set_postfix_str(f"{total_runs}/{total_runs} runs done")
    bar.close()
    write_report(out, settings, store.read_results(out), failures, device=str(device))
    return out


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


def _progress_bar(total: int, initial: int, enabled: bool):
    """One bar over the whole grid, in run-steps (a stacked step of R runs counts R)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="step", disable=not enabled, smoothing=0.05,
                bar_format="{l_bar}{bar}| {n}/{total} run-steps [{elapsed}<{remaining}] {postfix}")


def _train(name: str, b: int, k: int, runs: Sequence[int], data: Dataset, settings: StudySettings, bar) -> list[dict]:
    """Train `runs` of cell (norm `name`, B=b, K=k) side by side; one row per run per evaluation."""
    device = data.train_x.device
    models = []
    for r in runs:
        torch.manual_seed(settings.seed + r)  # run r starts exactly where a lone SimpleModel under this seed would
        models.append(SimpleModel(norm_fn(name), in_channels=data.train_x.shape[1], num_classes=data.num_classes))
    bn_mode = "exact" if name == EXACT_BN else "micro"  # "micro": per-micro-batch statistics, as the study
    # Plain accumulation runs each micro-batch's backward once: conv weight gradients can wait for one call per step.
    model = (StackedModel(models, defer_weight_grads=bn_mode == "micro") if len(models) > 1
             else SingleRun(models[0])).to(device)
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
        accumnorm.backward(model, (data.train_x[idx], data.train_y[idx]), loss_fn, micro_batch_size=b, bn=bn_mode)
        if isinstance(model, StackedModel):
            model.flush_weight_grads()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        bar.update(len(runs))
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
    for xb, yb in zip(x.split(EVAL_BATCH), y.split(EVAL_BATCH)):
        logits = model(xb.unsqueeze(1).expand(-1, runs, *xb.shape[1:]))  # every run sees the same images
        correct += (logits.argmax(-1) == yb[:, None]).sum(0)
    model.train()
    return correct / len(y)
