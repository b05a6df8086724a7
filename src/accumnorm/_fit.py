"""The pieces of `Trainer.fit`: its argument checks, its logs, and the bookkeeping around each step
(throughput, progress, evaluation, checkpoints), so that `fit` itself reads as the loop it is. The
Trainer imports this module, never the other way: the loop sees the trainer through its attributes.

A log directory holds one run. A fresh run into a directory that holds a run with a checkpoint is
refused (it would overwrite it); only the trainer that continues that run, loaded from its checkpoint,
writes there again. A run that left no checkpoint (it failed before its first) cannot be continued:
a fresh run replaces its files, with a warning. The logs themselves are `_metrics.MetricLog`'s.
"""
from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import _dist
from ._metrics import MetricLog

__all__ = ["check_fit_args", "check_log_dir", "FitLoop"]

RUN_FILES = ("config.json", "metrics.csv", "checkpoint.pt")  # and TensorBoard's events.out.tfevents.*


def check_fit_args(*, steps: Any, epochs: Any, eval_every: Any, log: Any, checkpoint_every: Any) -> None:
    """Refuse, before the loader is touched, what would fail only after steps have trained."""
    if steps is None and epochs is None:
        raise ValueError("fit needs steps=, epochs= or both to know when to stop")
    for name, value, least in (("steps", steps, 0), ("epochs", epochs, 0), ("eval_every", eval_every, 1),
                               ("checkpoint_every", checkpoint_every, 1)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int or None, got {type(value).__name__} {value!r}")
        if value < least:
            raise ValueError(f"{name} must be >= {least} or None, got {value!r}")
    if checkpoint_every is not None and log is None:
        raise ValueError("checkpoint_every needs a log directory to write checkpoint.pt into")
    if log is not None:
        existing = next(d for d in (Path(log), *Path(log).absolute().parents) if d.exists())
        if not existing.is_dir():
            raise ValueError(f"log must be a directory, but {existing} is a file" + (
                f" (in the path {log})" if existing != Path(log) else ""))
        if not os.access(existing, os.W_OK):
            raise ValueError(f"log {log}: cannot write into {existing}")
    _tqdm()


def run_files(directory: Path) -> list[str]:
    """The files of a run that `directory` holds (none when it does not exist)."""
    if not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir() if p.name in RUN_FILES or p.name.startswith("events.out."))


def check_log_dir(trainer: Any, log: str | os.PathLike | None) -> None:
    """Refuse a fresh run into a directory that holds a run with a checkpoint: only the trainer that continues it
    (`run_dir`, the directory of the checkpoint it was loaded from or of its last fit) writes there. A run without
    one, which nothing can continue, has its files removed here, with a warning. Rank 0 decides for all."""
    problem = None
    if log is not None and trainer.rank == 0:
        found = run_files(Path(log))
        continues = trainer.run_dir is not None and Path(trainer.run_dir).resolve() == Path(log).resolve()
        if found and not continues and "checkpoint.pt" in found:
            problem = (f"log {str(log)!r} already holds a run ({', '.join(found)}), which this fresh run would "
                       f"overwrite: pass another log=, resume that run with Trainer.load({str(log)!r}, model, "
                       "optimizer, loss_fn), or delete it")
        elif found and not continues:
            warnings.warn(f"log {str(log)!r} holds a run that left no checkpoint ({', '.join(found)}), which no "
                          "Trainer can continue: this run replaces its files", stacklevel=3)
            for name in found:
                (Path(log) / name).unlink()
    problem = _dist.all_gather_object(problem, trainer.process_group)[0]
    if problem is not None:
        raise ValueError(problem)


def train_mode(model: torch.nn.Module) -> None:
    """Put `model` in train mode, but for the layers in another mode than the module holding them (a BatchNorm frozen
    in eval mode, and what it holds), which keep theirs: `model.train()` would train a frozen layer's statistics."""
    modes = {m: m.training for m in model.modules()}
    apart = [child for parent in model.modules() for child in parent.children() if modes[child] != modes[parent]]
    model.train()
    for layer in apart:
        for m in layer.modules():
            m.training = modes[m]


def loader_batch_size(loader: Iterable) -> int | None:
    """The batch size a DataLoader was built with (its batch_sampler's), at most its sampler's length; None for
    a loader that does not say."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    size = getattr(batch_sampler, "batch_size", None)
    if isinstance(size, bool) or not isinstance(size, int):
        return None
    try:
        return min(size, len(batch_sampler.sampler))
    except (TypeError, AttributeError):  # an iterable dataset's sampler has no length
        return size


def _tqdm() -> Any:
    """tqdm's progress bar, imported when a fit starts rather than with accumnorm: it is an extra."""
    try:
        from tqdm.auto import tqdm
    except ImportError as err:
        raise ImportError("Trainer.fit shows its progress with tqdm: pip install 'accumnorm[train]'") from err
    return tqdm


class FitLoop:
    """One call of `Trainer.fit`: when to stop, and what happens around each step. A context manager that
    closes the progress bar and the logs. `trainer` is the Trainer that runs the steps."""

    def __init__(self, trainer: Any, loader: Iterable, *, steps: int | None, epochs: int | None,
                 eval_fn: Callable | None, eval_every: int | None, log: str | os.PathLike | None,
                 checkpoint_every: int | None):
        self.trainer, self.loader, self.steps, self.epochs = trainer, loader, steps, epochs
        self.eval_fn, self.eval_every, self.checkpoint_every = eval_fn, eval_every, checkpoint_every
        self.log = Path(log) if log is not None else None
        self.metrics = MetricLog(self.log if trainer.rank == 0 else None, trainer.step_count)
        total = steps if steps is not None else (epochs * len(loader) if hasattr(loader, "__len__") else None)
        self.bar = _tqdm()(total=total, initial=trainer.step_count, unit="step", disable=trainer.rank != 0,
                        dynamic_ncols=True)
        self.last: dict[str, float] = {}  # the last logged metrics, which fit returns
        self.postfix: dict[str, str] = {}  # the progress bar's: the last step's loss and speed, the last evaluation
        self.config: dict[str, Any] | None = None  # written at the first step
        self.evaluated = True  # no step trained since the last evaluation
        self.saved_step: int | None = None  # the step of the checkpoint this fit saved last
        self.tick = time.perf_counter()

    def __enter__(self) -> FitLoop:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.close()
        self.metrics.close()

    def done(self) -> bool:
        t = self.trainer
        return (self.steps is not None and t.step_count >= self.steps) or (self.epochs is not None
                                                                           and t.epoch >= self.epochs)

    def train(self, batch: Any) -> None:
        """One optimizer step on `batch`, then its metrics, progress, evaluation and checkpoint."""
        if self.config is None:
            self._start(batch)
        t = self.trainer
        lr = t.optimizer.param_groups[0]["lr"]
        loss = t.step(batch)
        t.batch_in_epoch += 1
        self._record(batch, loss, lr)
        self.evaluated = self.eval_fn is None or (self.eval_every is not None and t.step_count % self.eval_every == 0)
        if self.checkpoint_every is not None and t.step_count % self.checkpoint_every == 0:
            self._save()  # before the evaluation, whose failure must not cost the step its checkpoint
        if self.eval_fn is not None and self.evaluated:
            self._evaluate()
        self.tick = time.perf_counter()  # after evaluation and saving, which are not throughput

    def finish(self) -> None:
        """The checkpoint and the evaluation at the end, unless the last step had them. Not called when an
        exception (KeyboardInterrupt too) ends the loop: one that came between the parts of a step (the optimizer's
        update, the scheduler's, the counts) would leave a state no checkpoint should hold."""
        if self.log is not None and self.config is not None and self.saved_step != self.trainer.step_count:
            self._save()
        if not self.evaluated:
            self._evaluate()

    def _start(self, batch: Any) -> None:
        self.config = describe(self.trainer, batch, self.loader, steps=self.steps, epochs=self.epochs,
                               eval_every=self.eval_every, checkpoint_every=self.checkpoint_every)
        self.metrics.start(self.config)
        self.tick = time.perf_counter()  # opening the logs (TensorBoard's import) is not throughput

    def _save(self) -> None:
        t = self.trainer
        t.save(self.log / "checkpoint.pt")
        self.saved_step = t.step_count

    def _record(self, batch: Any, loss: float, lr: float) -> None:
        t = self.trainer
        n = _dist.num_samples(batch)
        if n > self.config["batch_per_rank"]:  # a loader that does not say its batch size: the largest seen
            self.config.update(sizes(t, n))
            self.metrics.write_config(self.config)
        # loading and training time; every rank is assumed to hold as many samples as this one
        samples_per_s = n * t.world_size / (time.perf_counter() - self.tick)
        self.last = {"loss": loss, "lr": lr, "samples_per_s": samples_per_s}
        if t.max_grad_norm is not None:
            self.last["grad_norm"] = t.grad_norm
        if t.scaler is not None:
            self.last["loss_scale"] = t.scaler.get_scale()
        self.metrics.log(t.step_count, self.last)
        self.postfix.update(loss=f"{loss:.4g}", samples_s=f"{samples_per_s:.0f}")
        self.bar.set_postfix(self.postfix, refresh=False)
        self.bar.update(1)

    def _evaluate(self) -> None:
        t = self.trainer
        modes = [(m, m.training) for m in t.model.modules()]  # a layer kept in eval mode stays so
        t.model.eval()
        try:
            with torch.no_grad():
                result = self.eval_fn(t.model)
        finally:  # an eval_fn that raised too: the next step trains in the modes the model trained in
            for m, training in modes:
                m.training = training
        result = result if isinstance(result, dict) else {"eval": result}
        result = {name: _scalar(name, value) for name, value in result.items()}
        self.metrics.log(t.step_count, result)
        self.last.update(result)
        self.postfix.update((name, f"{value:.4g}") for name, value in result.items())
        self.bar.set_postfix(self.postfix)
        if t.rank == 0:
            _tqdm().write(f"step {t.step_count}: " + ", ".join(f"{name} {value:.4g}" for name, value in result.items()))


def _scalar(name: str, value: Any) -> float:
    """One number of eval_fn's result, or a ValueError naming it."""
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError) as e:
        shape = f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else ""
        raise ValueError(f"eval_fn returned {type(value).__name__}{shape} for {name!r}: each of its results must "
                         "be one number (a float, or a tensor of one element) for metrics.csv") from e


def sizes(trainer: Any, per_rank: int) -> dict[str, int]:
    """What one optimizer step sees (nanoGPT-style, so runs with different splits compare) for batches of
    `per_rank` samples on each rank."""
    t = trainer
    return {"accumulation_steps": math.ceil(per_rank / t.micro_batch_size),
            "effective_batch_size": per_rank * t.world_size, "batch_per_rank": per_rank}


def describe(trainer: Any, batch: Any, loader: Iterable, **fit_args: Any) -> dict[str, Any]:
    """The run's configuration and derived sizes, printed at start and saved as config.json. The batch size is
    the loader's (a DataLoader's), not the first batch's, which may be an epoch's short last one; for a loader that
    does not say, the first batch's, raised as larger ones come."""
    t = trainer
    per_rank = loader_batch_size(loader) or _dist.num_samples(batch)
    config = {
        "micro_batch_size": t.micro_batch_size, **sizes(t, per_rank), "world_size": t.world_size,
        "bn": t.bn, "amp": t.amp, "max_grad_norm": t.max_grad_norm, "compile": t.compile, "schedule": t.schedule,
        "store": None if t.store is None else str(t.store), "memory_budget": t.memory_budget,
        "keep_every": t.keep_every,
        "backend": dist.get_backend(t.process_group) if t.process_group is not None else None,
        "device": str(t.device), "start_step": t.step_count, "batch_in_epoch": t.batch_in_epoch, **fit_args,
        "batches_per_epoch": len(loader) if hasattr(loader, "__len__") else None,
        "model": type(t.model).__name__, "parameters": sum(p.numel() for p in t.model.parameters()),
        "optimizer": type(t.optimizer).__name__,
        "optimizer_defaults": {k: v for k, v in t.optimizer.defaults.items()
                               if isinstance(v, (int, float, str, bool, tuple))},
        "scheduler": type(t.scheduler).__name__ if t.scheduler is not None else None,
        "torch": torch.__version__,
    }
    if t.rank == 0:
        short = " (the last micro-batch is short)" if per_rank % t.micro_batch_size else ""
        _tqdm().write(f"effective batch {config['effective_batch_size']} = micro-batch {t.micro_batch_size} x "
                   f"{config['accumulation_steps']} accumulation steps x {t.world_size} ranks{short}; bn={t.bn}, "
                   f"amp={t.amp}, device {t.device}, {config['parameters']:,} parameters, starting at step "
                   f"{t.step_count}")
    return config
