"""The training engine: exact gradient accumulation across micro-batches and ranks, mixed
precision, logging and checkpoints that resume as if the run had never stopped.

    trainer = Trainer(model, optimizer, loss_fn, micro_batch_size=8)
    trainer.fit(loader, steps=1000, log="runs/exp1", checkpoint_every=100)

Each ``step(batch)`` is one optimizer step over the whole batch: ``accumnorm.backward`` runs it as
micro-batches of ``micro_batch_size`` (and, under a process group, as every rank's shard of one global
batch), and the gradient and BatchNorm statistics come out as if the whole batch had run at once.
"""
from __future__ import annotations

import contextlib
import csv
import functools
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import distributed
from .accumulation import backward, check_args
from .distributed import unwrap_ddp
from .schedules import resolve_store

try:
    from tqdm.auto import tqdm
except ImportError:  # the progress bar is an extra: pip install 'accumnorm[train]'
    tqdm = None

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Trainer:
    """One exact optimizer step per batch, however it is split into micro-batches and ranks.

    ``loss_fn(model, micro_batch)`` returns the mean loss over a micro-batch. ``amp`` is None,
    "bf16" (CPU and CUDA autocast) or "fp16" (CUDA autocast with a GradScaler, whose scale holds for
    all micro-batches of a step; a step with inf/nan gradients is skipped, the scheduler's too).
    ``max_grad_norm`` clips the total norm of the unscaled gradient. ``process_group`` defaults to the
    model's own when it is wrapped in DistributedDataParallel, else to the default group when
    torch.distributed is initialized. ``bn``, ``schedule`` and ``store`` go to ``accumnorm.backward``.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], *, micro_batch_size: int,
                 bn: str = "exact", scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                 max_grad_norm: float | None = None, amp: str | None = None,
                 process_group: ProcessGroup | None = None, schedule: str = "auto",
                 store: str | torch.device | None = None):
        # backward all-reduces gradients itself; DDP's own hooks would reduce them a second time
        model, process_group = unwrap_ddp(model, process_group)
        check_args(model, loss_fn, micro_batch_size, bn, schedule)  # as accumnorm.backward would at every step
        resolve_store(store)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if next(model.parameters(), None) is None:
            raise ValueError(f"the model ({type(model).__name__}) has no parameters: there is nothing to train")
        if process_group is None and dist.is_initialized():
            process_group = dist.group.WORLD
        if amp not in (None, *AMP_DTYPES):
            raise ValueError(f"amp must be None, 'bf16' or 'fp16', got {amp!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be a positive number or None, got {max_grad_norm!r}")
        self.device = next(model.parameters()).device
        if amp == "fp16" and self.device.type != "cuda":
            raise ValueError(f"amp='fp16' needs the model on a CUDA device (float16 training needs "
                             f"torch.amp.GradScaler), but it is on {self.device}; use amp='bf16' on CPU")
        self.model, self.optimizer, self.loss_fn, self.scheduler = model, optimizer, loss_fn, scheduler
        self.micro_batch_size, self.bn, self.max_grad_norm, self.amp = micro_batch_size, bn, max_grad_norm, amp
        self.process_group, self.schedule, self.store = process_group, schedule, store
        self.rank, self.world_size = distributed.rank_and_size(process_group)
        self.scaler = torch.amp.GradScaler(self.device.type) if amp == "fp16" else None
        self.autocast = (functools.partial(torch.autocast, self.device.type, dtype=AMP_DTYPES[amp])
                         if amp else contextlib.nullcontext)
        self.step_count = 0  # optimizer steps taken (skipped fp16 steps included)
        self.epoch = 0  # epochs completed by fit
        self.batch_in_epoch = 0  # batches of the current epoch already trained on
        self._epoch_rng: dict | None = None  # RNG states when the current epoch's iterator was made
        self.grad_norm: float | None = None  # total gradient norm before clipping, with max_grad_norm
        if self.world_size > 1:
            distributed.broadcast_module(model, process_group)  # every rank starts from rank 0's weights

    # ------------------------------------------------------------------ one step
    def step(self, batch: Any) -> float:
        """One optimizer step over ``batch`` (this rank's shard under a process group); returns the
        mean loss over the whole (global) batch."""
        self.model.zero_grad(set_to_none=True)
        batch = distributed.map_batch(lambda t: t.to(self.device, non_blocking=True), batch)
        with self.autocast():
            # the gradient of the mean loss over the whole global batch, summed across ranks inside
            loss = backward(self.model, batch, self.loss_fn, micro_batch_size=self.micro_batch_size, bn=self.bn,
                            schedule=self.schedule, store=self.store, process_group=self.process_group,
                            grad_scaler=self.scaler)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradient, not the scaled one
        if self.max_grad_norm is not None:
            self.grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm))
        if self.scaler is None:
            self.optimizer.step()
            stepped = True
        else:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)  # skipped when the gradient holds inf/nan
            self.scaler.update()
            stepped = self.scaler.get_scale() >= scale  # the scale only falls after a skipped step
        if self.scheduler is not None and stepped:
            self.scheduler.step()
        self.step_count += 1
        return loss.item()

    # ------------------------------------------------------------------ the loop
    def fit(self, loader: Iterable, *, steps: int | None = None, epochs: int | None = None,
            eval_fn: Callable[[torch.nn.Module], float | dict[str, float]] | None = None,
            eval_every: int | None = None, log: str | os.PathLike | None = "runs/accumnorm",
            checkpoint_every: int | None = None) -> dict[str, float]:
        """Train until ``step_count`` reaches ``steps`` or ``epoch`` reaches ``epochs`` (both count
        across resumes); returns the last logged metrics.

        ``loader`` yields this rank's batches and is iterated once per epoch. ``eval_fn(model)`` runs
        under ``torch.no_grad()`` in eval mode every ``eval_every`` steps and once at the end.
        ``log`` is a directory for config.json, metrics.csv (step,name,value), TensorBoard events when
        tensorboard is installed, and checkpoint.pt every ``checkpoint_every`` steps; None logs nothing.
        A resumed trainer continues with the very next batch of the epoch it stopped in.
        """
        if steps is None and epochs is None:
            raise ValueError("fit needs steps=, epochs= or both to know when to stop")
        if checkpoint_every is not None and log is None:
            raise ValueError("checkpoint_every needs a log directory to write checkpoint.pt into")
        if tqdm is None:
            raise ImportError("Trainer.fit shows its progress with tqdm: pip install 'accumnorm[train]'")
        def done() -> bool:
            return (steps is not None and self.step_count >= steps) or (epochs is not None and self.epoch >= epochs)
        metrics = _MetricLog(Path(log) if log is not None and self.rank == 0 else None, self.step_count)
        total = steps if steps is not None else (epochs * len(loader) if hasattr(loader, "__len__") else None)
        bar = tqdm(total=total, initial=self.step_count, unit="step", disable=self.rank != 0, dynamic_ncols=True)
        last: dict[str, float] = {}
        config = None
        evaluated = True
        self.model.train()
        tick = time.perf_counter()
        try:
            while not done():
                for batch in self._epoch_batches(loader):
                    if config is None:
                        config = self._describe(batch, loader, steps=steps, epochs=epochs, eval_every=eval_every,
                                                checkpoint_every=checkpoint_every)
                        metrics.start(config)
                        tick = time.perf_counter()  # opening the logs (TensorBoard's import) is not throughput
                    lr = self.optimizer.param_groups[0]["lr"]
                    loss = self.step(batch)
                    self.batch_in_epoch += 1
                    # loading and training time; every rank is assumed to hold as many samples as this one
                    samples_per_s = distributed.num_samples(batch) * self.world_size / (time.perf_counter() - tick)
                    last = {"loss": loss, "lr": lr, "samples_per_s": samples_per_s}
                    if self.max_grad_norm is not None:
                        last["grad_norm"] = self.grad_norm
                    if self.scaler is not None:
                        last["loss_scale"] = self.scaler.get_scale()
                    metrics.log(self.step_count, last)
                    bar.set_postfix(loss=f"{loss:.4g}", samples_s=f"{samples_per_s:.0f}", refresh=False)
                    bar.update(1)
                    evaluated = eval_fn is None or (eval_every is not None and self.step_count % eval_every == 0)
                    if eval_fn is not None and evaluated:
                        last.update(self._evaluate(eval_fn, metrics))
                    if checkpoint_every is not None and self.step_count % checkpoint_every == 0:
                        self.save(Path(log) / "checkpoint.pt")
                    if done():
                        break
                    tick = time.perf_counter()  # after evaluation and saving, which are not throughput
                else:  # the loader ran out: the epoch is complete
                    if self.batch_in_epoch == 0:
                        raise ValueError(f"the loader yielded no batches in epoch {self.epoch}")
                    self.epoch, self.batch_in_epoch = self.epoch + 1, 0
            if not evaluated:
                last.update(self._evaluate(eval_fn, metrics))
        finally:
            bar.close()
            metrics.close()
        return last

    def _epoch_batches(self, loader: Iterable) -> Iterable:
        """A fresh iterator over ``loader`` for the current epoch, past the batches already trained on."""
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)  # DistributedSampler reshuffles by epoch number
        if self.batch_in_epoch == 0:
            self._epoch_rng = _get_rng()
            return iter(loader)
        # resuming inside an epoch: the loader draws its shuffle from the RNG when the iterator is made,
        # so replay that from the epoch's starting RNG, skip what was trained on, then carry on from now
        now = _get_rng()
        _set_rng(self._epoch_rng)
        batches = iter(loader)
        for i in range(self.batch_in_epoch):
            if next(batches, None) is None:
                raise ValueError(f"the checkpoint is at batch {self.batch_in_epoch} of epoch {self.epoch}, "
                                 f"but the loader yields only {i} batches per epoch")
        _set_rng(now)
        return batches

    def _evaluate(self, eval_fn: Callable, metrics: _MetricLog) -> dict[str, float]:
        self.model.eval()
        with torch.no_grad():
            result = eval_fn(self.model)
        self.model.train()
        result = result if isinstance(result, dict) else {"eval": result}
        result = {name: float(value) for name, value in result.items()}
        metrics.log(self.step_count, result)
        return result

    def _describe(self, batch: Any, loader: Iterable, **fit_args: Any) -> dict[str, Any]:
        """The run's configuration and derived sizes, printed at start and saved as config.json."""
        per_rank = distributed.num_samples(batch)
        accum = math.ceil(per_rank / self.micro_batch_size)
        config = {
            "micro_batch_size": self.micro_batch_size, "accumulation_steps": accum, "world_size": self.world_size,
            # nanoGPT-style: what one optimizer step sees, so runs with different splits can be compared
            "effective_batch_size": per_rank * self.world_size, "batch_per_rank": per_rank,
            "bn": self.bn, "amp": self.amp, "max_grad_norm": self.max_grad_norm,
            "backend": dist.get_backend(self.process_group) if self.process_group is not None else None,
            "device": str(self.device), "start_step": self.step_count, **fit_args,
            "batches_per_epoch": len(loader) if hasattr(loader, "__len__") else None,
            "model": type(self.model).__name__, "parameters": sum(p.numel() for p in self.model.parameters()),
            "optimizer": type(self.optimizer).__name__,
            "optimizer_defaults": {k: v for k, v in self.optimizer.defaults.items()
                                   if isinstance(v, (int, float, str, bool, tuple))},
            "scheduler": type(self.scheduler).__name__ if self.scheduler is not None else None,
            "torch": torch.__version__,
        }
        if self.rank == 0:
            short = " (the last micro-batch is short)" if per_rank % self.micro_batch_size else ""
            tqdm.write(f"effective batch {config['effective_batch_size']} = micro-batch {self.micro_batch_size} x "
                       f"{accum} accumulation steps x {self.world_size} ranks{short}; bn={self.bn}, amp={self.amp}, "
                       f"device {self.device}, {config['parameters']:,} parameters, starting at step {self.step_count}")
        return config

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs. Under a process group, call it on every rank (it gathers
        each rank's RNG states)."""
        return {
            "config": {"micro_batch_size": self.micro_batch_size, "bn": self.bn,
                       "max_grad_norm": self.max_grad_norm, "amp": self.amp},
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "step": self.step_count, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
            "rng": distributed.all_gather_object({"now": _get_rng(), "epoch_start": self._epoch_rng},
                                                 self.process_group),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()``; checks everything that can fail before changing anything."""
        own = self.model.state_dict()
        missing = sorted(own.keys() - state["model"].keys())
        unexpected = sorted(state["model"].keys() - own.keys())
        shapes = [f"{k} {tuple(state['model'][k].shape)} in checkpoint, {tuple(v.shape)} in model"
                  for k, v in own.items() if k in state["model"] and state["model"][k].shape != v.shape]
        if missing or unexpected or shapes:
            raise ValueError("the checkpoint is from another model:" + "".join(
                f"\n  {what}: {'; '.join(keys)}" for what, keys in (
                    ("missing in checkpoint", missing), ("not in model", unexpected), ("shapes differ", shapes))
                if keys))
        for name, ours in (("scheduler", self.scheduler), ("scaler", self.scaler)):
            if (state[name] is None) != (ours is None):
                raise ValueError(f"the checkpoint {'has no' if state[name] is None else 'has a'} {name} "
                                 f"state but this trainer {'has one' if ours is not None else 'has none'}")
        if len(state["rng"]) != self.world_size:
            raise ValueError(f"the checkpoint holds RNG states of {len(state['rng'])} ranks, this run has "
                             f"{self.world_size}; resume with the same world size")
        self.optimizer.load_state_dict(state["optimizer"])  # validates its groups before it changes anything
        self.model.load_state_dict(state["model"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.step_count, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        rng = state["rng"][self.rank]
        self._epoch_rng = rng["epoch_start"]
        _set_rng(rng["now"])

    def save(self, path: str | os.PathLike) -> None:
        """Write ``state_dict()`` to ``path`` atomically: a run killed while saving keeps the previous
        checkpoint. Under a process group, call it on every rank; rank 0 writes."""
        state = self.state_dict()
        if self.rank != 0:
            return
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # atomic: readers see the old file or the new one, never half of one
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             loss_fn: Callable, **kwargs: Any) -> Trainer:
        """A trainer resumed from ``save(path)``: micro_batch_size, bn, max_grad_norm and amp default to
        the checkpoint's; pass scheduler= and process_group= as when it was made."""
        state = torch.load(path, map_location="cpu", weights_only=True)
        trainer = cls(model, optimizer, loss_fn, **{**state["config"], **kwargs})
        trainer.load_state_dict(state)
        return trainer


class _MetricLog:
    """config.json, metrics.csv and TensorBoard scalars in one directory; does nothing without one."""

    def __init__(self, directory: Path | None, step: int):
        self.directory, self.start_step = directory, step
        self.writer = self.csv = None

    def start(self, config: dict[str, Any]) -> None:
        """Open the files; rows past the starting step (left by a run killed after its last checkpoint)
        are dropped, so a resumed run's log reads as one run."""
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
        path = self.directory / "metrics.csv"
        rows = []
        if path.exists():
            with open(path, newline="") as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= self.start_step]
        self.file = open(path, "w", newline="")
        self.csv = csv.DictWriter(self.file, ["step", "name", "value"])
        self.csv.writeheader()
        self.csv.writerows(rows)
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


def _get_rng() -> dict[str, Any]:
    """torch (CPU and, once used, CUDA), python and numpy RNG states, in types torch.load(weights_only=True) reads."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:  # only a program that imported numpy can depend on its RNG
        name, keys, pos, has_gauss, gauss = sys.modules["numpy"].random.get_state()
        state["numpy"] = (name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss)
    return state


def _set_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
