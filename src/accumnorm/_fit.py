"""The pieces of `Trainer.fit`: its argument checks, its logs, and the bookkeeping around each step
(throughput, progress, evaluation, checkpoints), so that `fit` itself reads as the loop it is.

metrics.csv is rewritten atomically when `fit` starts, keeping the rows up to the starting step (a run
killed after its last checkpoint logged past it); rows that cannot be read (a line cut short by a
kill, garbage) are skipped with a warning naming the file and the lines, and are not written back.
"""
from __future__ import annotations

import csv
import json
import math
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from . import _dist
from ._files import atomic_write, csv_text, read_csv

if TYPE_CHECKING:
    from ._trainer import Trainer


__all__ = ["check_fit_args", "FitLoop", "MetricLog"]

METRIC_FIELDS = ("step", "name", "value")


def check_fit_args(*, steps: Any, epochs: Any, eval_every: Any, log: Any, checkpoint_every: Any) -> None:
    """Refuse, before the loader is touched, what would fail only after steps have trained."""
    if steps is None and epochs is None:
        raise ValueError("fit needs steps=, epochs= or both to know when to stop")
    for name, value, least in (("steps", steps, 0), ("epochs", epochs, 0), ("eval_every", eval_every, 1),
                               ("checkpoint_every", checkpoint_every, 1)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise ValueError(f"{name} must be an int >= {least} or None, got {value!r}")
    if checkpoint_every is not None and log is None:
        raise ValueError("checkpoint_every needs a log directory to write checkpoint.pt into")
    if log is not None and Path(log).exists() and not Path(log).is_dir():
        raise ValueError(f"log must be a directory, but {log} is a file")
    _tqdm()


def _tqdm() -> Any:
    """tqdm's progress bar, imported when a fit starts rather than with accumnorm: it is an extra."""
    try:
        from tqdm.auto import tqdm
    except ImportError as err:
        raise ImportError("Trainer.fit shows its progress with tqdm: pip install 'accumnorm[train]'") from err
    return tqdm


class FitLoop:
    """One call of `Trainer.fit`: when to stop, and what happens around each step. A context manager that
    closes the progress bar and the logs."""

    def __init__(self, trainer: Trainer, loader: Iterable, *, steps: int | None, epochs: int | None,
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
        self.started = False
        self.evaluated = True  # no step trained since the last evaluation
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
        if not self.started:
            self._start(batch)
        t = self.trainer
        lr = t.optimizer.param_groups[0]["lr"]
        loss = t.step(batch)
        t.batch_in_epoch += 1
        self._record(batch, loss, lr)
        self.evaluated = self.eval_fn is None or (self.eval_every is not None and t.step_count % self.eval_every == 0)
        if self.eval_fn is not None and self.evaluated:
            self._evaluate()
        if self.checkpoint_every is not None and t.step_count % self.checkpoint_every == 0:
            t.save(self.log / "checkpoint.pt")
        self.tick = time.perf_counter()  # after evaluation and saving, which are not throughput

    def finish(self) -> None:
        """The evaluation at the end, unless the last step had one."""
        if not self.evaluated:
            self._evaluate()

    def _start(self, batch: Any) -> None:
        config = describe(self.trainer, batch, self.loader, steps=self.steps, epochs=self.epochs,
                          eval_every=self.eval_every, checkpoint_every=self.checkpoint_every)
        self.metrics.start(config)
        self.started = True
        self.tick = time.perf_counter()  # opening the logs (TensorBoard's import) is not throughput

    def _record(self, batch: Any, loss: float, lr: float) -> None:
        t = self.trainer
        # loading and training time; every rank is assumed to hold as many samples as this one
        samples_per_s = _dist.num_samples(batch) * t.world_size / (time.perf_counter() - self.tick)
        self.last = {"loss": loss, "lr": lr, "samples_per_s": samples_per_s}
        if t.max_grad_norm is not None:
            self.last["grad_norm"] = t.grad_norm
        if t.scaler is not None:
            self.last["loss_scale"] = t.scaler.get_scale()
        self.metrics.log(t.step_count, self.last)
        self.bar.set_postfix(loss=f"{loss:.4g}", samples_s=f"{samples_per_s:.0f}", refresh=False)
        self.bar.update(1)

    def _evaluate(self) -> None:
        model = self.trainer.model
        model.eval()
        with torch.no_grad():
            result = self.eval_fn(model)
        model.train()
        result = result if isinstance(result, dict) else {"eval": result}
        result = {name: float(value) for name, value in result.items()}
        self.metrics.log(self.trainer.step_count, result)
        self.last.update(result)


def describe(trainer: Trainer, batch: Any, loader: Iterable, **fit_args: Any) -> dict[str, Any]:
    """The run's configuration and derived sizes, printed at start and saved as config.json."""
    t = trainer
    per_rank = _dist.num_samples(batch)
    accum = math.ceil(per_rank / t.micro_batch_size)
    config = {
        "micro_batch_size": t.micro_batch_size, "accumulation_steps": accum, "world_size": t.world_size,
        # nanoGPT-style: what one optimizer step sees, so runs with different splits can be compared
        "effective_batch_size": per_rank * t.world_size, "batch_per_rank": per_rank,
        "bn": t.bn, "amp": t.amp, "max_grad_norm": t.max_grad_norm,
        "backend": dist.get_backend(t.process_group) if t.process_group is not None else None,
        "device": str(t.device), "start_step": t.step_count, **fit_args,
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
                   f"{accum} accumulation steps x {t.world_size} ranks{short}; bn={t.bn}, amp={t.amp}, "
                   f"device {t.device}, {config['parameters']:,} parameters, starting at step {t.step_count}")
    return config


class MetricLog:
    """config.json, metrics.csv and TensorBoard scalars in one directory; does nothing without one."""

    def __init__(self, directory: Path | None, step: int):
        self.directory, self.start_step = directory, step
        self.writer = self.csv = None

    def start(self, config: dict[str, Any]) -> None:
        """Open the files; rows past the starting step (left by a run killed after its last checkpoint)
        and rows that cannot be read are dropped, so a resumed run's log reads as one run."""
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        atomic_write(self.directory / "config.json", json.dumps(config, indent=2, default=str) + "\n")
        path = self.directory / "metrics.csv"
        rows = []
        if path.exists():
            rows, _ = read_csv(path, METRIC_FIELDS, {"step": int, "value": float},
                               then="this run writes the file again without them")
        kept = [r for r in rows if int(r["step"]) <= self.start_step]
        atomic_write(path, csv_text(METRIC_FIELDS, kept, lineterminator="\r\n"))  # csv's own line end, as below
        self.file = open(path, "a", newline="")
        self.csv = csv.DictWriter(self.file, METRIC_FIELDS)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # TensorBoard is optional; the CSV has everything
            return
        self.writer = SummaryWriter(self.directory, purge_step=self.start_step + 1)

    def log(self, step: int, values: dict[str, float]) -> None:
        if self.csv is None:
            return
        self.csv.writerows({"step": step, "name": k, "value": v} for k, v in values.items())
        self.file.flush()
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self.csv is not None:
            self.file.close()
        if self.writer is not None:
            self.writer.close()
