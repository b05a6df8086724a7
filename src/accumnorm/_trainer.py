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
import functools
import inspect
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import _dist
from ._checkpoint import LoaderStreams, check_fits, get_rng, read_checkpoint, set_rng
from ._dist import unwrap_ddp
from ._engine.args import BNMode, Schedule, check_args, check_compile_options, check_schedule_options
from ._engine.backward import backward
from ._engine.checkpointing.measurements import check_measurements, load_measurements, measurements
from ._files import atomic_open
from ._fit import FitLoop, check_fit_args, check_log_dir, train_mode
from ._optimizer import check_optimizer, gradients_set_aside, stepped_tensors

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Trainer:
    """One exact optimizer step per batch, however it is split into micro-batches and ranks.

    ``loss_fn(model, micro_batch)`` returns the mean loss over a micro-batch. ``amp`` is None,
    "bf16" (CPU and CUDA autocast) or "fp16" (CUDA autocast with a GradScaler, whose scale holds for
    all micro-batches of a step; a step with inf/nan gradients is skipped, the scheduler's too).
    ``max_grad_norm`` clips the total norm of the unscaled gradient. ``process_group`` defaults to the
    model's own when it is wrapped in DistributedDataParallel, else to the default group when
    torch.distributed is initialized. ``bn``, ``schedule``, ``store``, ``memory_budget`` and ``keep_every`` go to
    ``accumnorm.backward``.

    Args:
        compile: None, or the keyword arguments of ``torch.compile`` for the model, e.g. ``{"backend": "aot_eager"}``
            or ``{"mode": "max-autotune-no-cudagraphs"}``: the Trainer calls ``model.compile(**compile)``, which
            compiles the model in place, so its ``state_dict`` and checkpoints keep the keys of the uncompiled
            model. The steps stay exact: dynamo breaks its graph at each BatchNorm call that uses batch statistics.
            Refused under ``bn="exact"``: ``fullgraph=True`` (a graph break is then an error). A resumed trainer
            (``Trainer.load``) compiles only when given ``compile=`` again. Default: None.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], *, micro_batch_size: int,
                 bn: BNMode = "exact", scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                 max_grad_norm: float | None = None, amp: Literal["bf16", "fp16"] | None = None,
                 process_group: ProcessGroup | None = None, schedule: Schedule = "auto",
                 store: str | torch.device | None = None, memory_budget: int | None = None,
                 keep_every: int | None = None, compile: dict[str, Any] | None = None) -> None:
        # backward all-reduces gradients itself; DDP's own hooks would reduce them a second time
        model, process_group = unwrap_ddp(model, process_group)
        check_compile_options(compile, bn)
        check_args(model, loss_fn, micro_batch_size, bn, schedule)  # as accumnorm.backward would at every step
        check_schedule_options(schedule, store, memory_budget, keep_every)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if next(model.parameters(), None) is None:
            raise ValueError(f"the model ({type(model).__name__}) has no parameters: there is nothing to train")
        check_optimizer(optimizer, model, "build it over model.parameters() (after any copy of the model)")
        if scheduler is not None and not _steps_alone(scheduler):
            raise TypeError(f"scheduler {type(scheduler).__name__} needs arguments to step (ReduceLROnPlateau takes "
                            "a metric): the Trainer steps its scheduler after each optimizer step with none. Step it "
                            "yourself after your evaluation, and leave scheduler= out")
        if process_group is None and dist.is_initialized():
            process_group = dist.group.WORLD
        if amp not in (None, *AMP_DTYPES):
            raise ValueError(f"amp must be None, 'bf16' or 'fp16', got {amp!r}")
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool)
                                          or not isinstance(max_grad_norm, (int, float))):
            raise TypeError(f"max_grad_norm must be a number or None, got {type(max_grad_norm).__name__} "
                            f"{max_grad_norm!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be a positive number or None, got {max_grad_norm!r}")
        self.device = next(model.parameters()).device
        if amp == "fp16" and self.device.type != "cuda":
            raise ValueError(f"amp='fp16' needs the model on a CUDA device (float16 training needs "
                             f"torch.amp.GradScaler), but it is on {self.device}; use amp='bf16' on CPU")
        if compile is not None:  # the last check is done: nothing was changed before here
            model.compile(**compile)
        self.model, self.optimizer, self.loss_fn, self.scheduler = model, optimizer, loss_fn, scheduler
        self.micro_batch_size, self.bn, self.max_grad_norm, self.amp = micro_batch_size, bn, max_grad_norm, amp
        self.process_group, self.schedule, self.store, self.compile = process_group, schedule, store, compile
        self.memory_budget, self.keep_every = memory_budget, keep_every
        self.rank, self.world_size = _dist.rank_and_size(process_group)
        self.scaler = torch.amp.GradScaler(self.device.type) if amp == "fp16" else None
        self.autocast = (functools.partial(torch.autocast, self.device.type, dtype=AMP_DTYPES[amp])
                         if amp else contextlib.nullcontext)
        self.step_count = 0  # optimizer steps taken (skipped fp16 steps included)
        self.epoch = 0  # epochs completed by fit
        self.batch_in_epoch = 0  # batches of the current epoch already trained on
        self._epoch_rng: dict | None = None  # RNG states when the current epoch's iterator was made
        self._streams = LoaderStreams()  # and the loader's own generators' (a DataLoader(generator=...))
        self.grad_norm: float | None = None  # total gradient norm before clipping, with max_grad_norm
        self.run_dir: Path | None = None  # the log directory of the run this trainer continues (see fit)
        if self.world_size > 1:
            _dist.broadcast_module(model, process_group)  # every rank starts from rank 0's weights

    # ------------------------------------------------------------------ one step
    def step(self, batch: Any) -> float:
        """One optimizer step over ``batch`` (this rank's shard under a process group); returns the
        mean loss over the whole (global) batch. A step that fails before the optimizer's leaves the gradients as
        they were."""
        loss = self._gradient(_dist.map_batch(lambda t: t.to(self.device, non_blocking=True), batch))
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

    def _gradient(self, batch: Any) -> torch.Tensor:
        """The whole global batch's mean loss, its gradient in `.grad` from none: of the model's parameters and the
        optimizer's tensors outside it (a learnable temperature). A failure puts back the gradients it found."""
        with gradients_set_aside(stepped_tensors(self.model, [self.optimizer]), keep=True), self.autocast():
            return backward(self.model, batch, self.loss_fn, micro_batch_size=self.micro_batch_size, bn=self.bn,
                            schedule=self.schedule, store=self.store, process_group=self.process_group,
                            grad_scaler=self.scaler, memory_budget=self.memory_budget, keep_every=self.keep_every)

    # ------------------------------------------------------------------ the loop
    def fit(self, loader: Iterable, *, steps: int | None = None, epochs: int | None = None,
            eval_fn: Callable[[torch.nn.Module], float | dict[str, float]] | None = None,
            eval_every: int | None = None, log: str | os.PathLike | None = "runs/accumnorm",
            checkpoint_every: int | None = None) -> dict[str, float]:
        """Train until ``step_count`` reaches ``steps`` or ``epoch`` reaches ``epochs`` (both count
        across resumes); returns the last logged metrics.

        The model trains in train mode, but for the layers kept in eval mode apart from the module holding them (a
        frozen BatchNorm), which stay in it.

        ``loader`` yields this rank's batches and is iterated once per epoch; the effective batch it
        reports is the loader's batch size (a DataLoader's), else the largest batch seen. ``eval_fn(model)``
        runs under ``torch.no_grad()`` in eval mode every ``eval_every`` steps and once at the end; its
        results show in the progress bar and in one line each time.

        ``log`` is the directory of this run: config.json, metrics.csv (step,name,value), TensorBoard
        events when tensorboard is installed, and checkpoint.pt, saved every ``checkpoint_every`` steps and
        when fit ends; None logs and saves nothing. A fit that an exception ends (KeyboardInterrupt
        included) keeps its last ``checkpoint_every`` checkpoint, as Lightning does: one that came between
        the optimizer's update and the step count would leave a state no checkpoint should hold.

        A directory that already holds a run with a checkpoint (config.json, metrics.csv, checkpoint.pt,
        TensorBoard events) is refused with a ValueError before anything runs: a fresh run there would
        overwrite it. A run that left no checkpoint, which nothing can continue, is replaced, with a warning.
        To continue that run, resume it: ``Trainer.load(log, ...)`` (or ``log/checkpoint.pt``) and
        ``fit(..., log=log)``; the resumed trainer continues with the very next batch of the epoch it
        stopped in, and the trainer that wrote a run may fit on in it.
        """
        check_fit_args(steps=steps, epochs=epochs, eval_every=eval_every, log=log, checkpoint_every=checkpoint_every)
        check_log_dir(self, log)
        if log is not None:
            self.run_dir = Path(log)
        train_mode(self.model)
        with FitLoop(self, loader, steps=steps, epochs=epochs, eval_fn=eval_fn, eval_every=eval_every, log=log,
                     checkpoint_every=checkpoint_every) as loop:
            while not loop.done():
                for batch in self._epoch_batches(loader):
                    loop.train(batch)
                    if loop.done():
                        break
                else:  # the loader ran out: the epoch is complete
                    self._end_epoch()
            loop.finish()
        return loop.last

    def _epoch_batches(self, loader: Iterable) -> Iterable:
        """A fresh iterator over ``loader`` for the current epoch, past the batches already trained on."""
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)  # DistributedSampler reshuffles by epoch number
        self._streams.attach(loader, mid_epoch=self.batch_in_epoch > 0)
        if self.batch_in_epoch == 0:
            self._epoch_rng = get_rng()
            self._streams.epoch_started()
            return iter(loader)
        # resuming inside an epoch: the loader draws its shuffle from the RNG when the iterator is made,
        # so replay that from the epoch's starting RNG, skip what was trained on, then carry on from now
        now = get_rng()
        set_rng(self._epoch_rng)
        self._streams.replay()
        batches = iter(loader)
        for i in range(self.batch_in_epoch):
            if next(batches, None) is None:
                raise ValueError(f"the checkpoint is at batch {self.batch_in_epoch} of epoch {self.epoch}, "
                                 f"but the loader yields only {i} batches per epoch")
        set_rng(now)
        return batches

    def _end_epoch(self) -> None:
        if self.batch_in_epoch == 0:
            raise ValueError(f"the loader yielded no batches in epoch {self.epoch}")
        self.epoch, self.batch_in_epoch = self.epoch + 1, 0

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
            # checked by load_state_dict: another class's state would load, then fail or mislead at the next step
            "optimizer_class": type(self.optimizer).__name__,
            "scheduler_class": type(self.scheduler).__name__ if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "step": self.step_count, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
            "rng": _dist.all_gather_object({"now": get_rng(), "epoch_start": self._epoch_rng,
                                            "loader": self._streams.state()}, self.process_group),
            # what recompute chose its regions by: a resumed run's first step chooses as the next one here would
            "measurements": measurements(self.model),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()``; checks everything that can fail before changing anything."""
        check_fits(state, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, scaler=self.scaler,
                   world_size=self.world_size)
        if "measurements" in state:  # a checkpoint written before they were kept has none
            check_measurements(state["measurements"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.model.load_state_dict(state["model"])
        if "measurements" in state:
            load_measurements(self.model, state["measurements"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.step_count, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        rng = state["rng"][self.rank]
        self._epoch_rng = rng["epoch_start"]
        self._streams.resumed = rng.get("loader")  # put into the loader's generators by the next fit
        set_rng(rng["now"])

    def save(self, path: str | os.PathLike) -> None:
        """Write ``state_dict()`` to ``path`` atomically: a run killed while saving keeps the previous
        checkpoint. Under a process group, call it on every rank; rank 0 writes."""
        state = self.state_dict()
        if self.rank != 0:
            return
        with atomic_open(path) as f:  # a killed save leaves .NAME.PID.tmp, which the next save removes
            torch.save(state, f)

    @classmethod
    def load(cls, path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             loss_fn: Callable, **kwargs: Any) -> Trainer:
        """A trainer resumed from ``save(path)``, or from the checkpoint.pt of a run's log directory ``path``:
        micro_batch_size, bn, max_grad_norm and amp default to the checkpoint's; pass scheduler=, process_group=,
        compile= and the schedule's options (schedule=, store=, memory_budget=, keep_every=) as when it was made.
        Its ``fit`` may log into the checkpoint's directory again.

        Refuses, before the model or optimizer changes, with a ValueError naming the file: a file that is
        truncated or corrupt, one that is not an accumnorm checkpoint, and a checkpoint of another model
        (state_dict keys, shapes), optimizer (class, param groups), scheduler or world size. No file: a
        FileNotFoundError.
        """
        path = Path(path) / "checkpoint.pt" if Path(path).is_dir() else Path(path)
        state = read_checkpoint(path)
        compile, config = kwargs.pop("compile", None), {**state["config"], **kwargs}
        check_compile_options(compile, config.get("bn"))
        trainer = cls(model, optimizer, loss_fn, **config)
        try:
            trainer.load_state_dict(state)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from err
        if compile is not None:  # once the checkpoint has loaded: a refused one leaves the model uncompiled
            trainer.model.compile(**compile)
            trainer.compile = compile
        trainer.run_dir = path.parent
        return trainer


def _steps_alone(scheduler: Any) -> bool:
    """Whether `scheduler.step()` takes no required argument."""
    try:
        inspect.signature(scheduler.step).bind()
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): trusted
        return True
    return True
