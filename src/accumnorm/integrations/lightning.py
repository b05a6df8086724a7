"""Exact BatchNorm under gradient accumulation in Lightning: a mixin for an existing LightningModule.

    from accumnorm.integrations.lightning import ExactAccumulation

    class Model(ExactAccumulation, L.LightningModule):    # 1. the mixin, before LightningModule
        def __init__(self):
            super().__init__(micro_batch_size=8)           # 2. samples per micro-batch
            self.net = make_net()                          # torch's BatchNorm layers, as they are

        def training_loss(self, batch):                    # 3. was training_step: the mean loss of a micro-batch
            x, y = batch
            return F.cross_entropy(self.net(x), y)

    trainer = L.Trainer(precision="bf16-mixed", gradient_clip_val=1.0)
    trainer.fit(Model(), DataLoader(train_set, batch_size=64))     # 64 samples per optimizer step

Each batch the DataLoader yields is the batch of one optimizer step (under DDP, this rank's share of
it). The mixin's `training_step` runs it through `accumnorm.backward` in micro-batches, which leaves in
`.grad` the gradient of the whole batch's mean loss, BatchNorm statistics of the whole batch (and of
every rank) included, and returns that loss. Everything else is Lightning's automatic optimization,
unchanged: precision plugins (autocast; under "16-mixed" its GradScaler scales the loss, unscales the
gradient before clipping and skips a step that overflows), `Trainer(gradient_clip_val=...)`, the
optimizer step, learning-rate schedulers, checkpoints (which keep what the recompute schedule measured of the
module, so that a resumed fit steps bit for bit as one that never stopped) and loggers. To log the loss, override
`training_step`: `loss = super().training_step(batch, batch_idx); self.log("train_loss", loss)`. What the
override returns is back-propagated as Lightning would: a multiple of the loss scales its gradient, and a term
added to it (a penalty on the weights) adds its own, averaged over the ranks under DDP.
In exact mode `training_loss` may run interleaved with the other micro-batches' (the layerwise schedule)
or more than once per micro-batch (passes): log nothing from it. In a batch whose backward Lightning skips
(`StochasticWeightAveraging`'s last epoch, which recomputes the BatchNorm statistics of the averaged weights), the
whole batch's statistics move the running ones, and the gradients are left as they were.

Set-up (`on_fit_start`, before the sanity check and any step) refuses what would make the result
wrong or silently untrained, each time saying what to change: `Trainer(accumulate_grad_batches=...)`
and `GradientAccumulationScheduler`, manual optimization, an optimizer that does not step this module's
parameters, a strategy other than one device or DDP, and overrides of the hooks the mixin owns (the
mixin's own arguments are checked when the module is made, its place in the bases when the class is).
A batch is checked when it arrives, before anything changes (`accumnorm.backward` validates it).

A compiled module, `trainer.fit(torch.compile(model, ...))`, trains exactly too. Lightning then compiles
`training_step`, which here holds the whole accumnorm step, whose own code dynamo must not trace: at set-up
the mixin gives the module back its uncompiled `training_step` and compiles, with the same options, what
each micro-batch runs, `training_loss` (dynamo breaks its graph at each BatchNorm call). `validation_step`
and the others stay as Lightning compiled them. (`model.compile()` compiles only the module's own
`__call__`; a `training_loss` that calls `self.net(x)` would run uncompiled: compile `self.net` instead.)
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel

from .._dist import Collectives, rank_and_size
from .._engine.args import BNMode, Schedule
from .._engine.backward import backward
from .._engine.checkpointing.measurements import CHECKPOINT_KEY, load_measurements, measurements
from .._optimizer import check_optimizer, gradients_set_aside, stepped_tensors
from ._checks import backward_options

try:
    import lightning.pytorch as pl
except ImportError as err:  # an optional integration: the core needs only torch
    raise ImportError("accumnorm.integrations.lightning needs Lightning: pip install 'accumnorm[lightning]'") from err

__all__ = ["ExactAccumulation"]

# Hooks the mixin implements for Lightning to call; a subclass overriding one would undo the mixin.
_OWNED_HOOKS = ("backward", "optimizer_zero_grad")


class ExactAccumulation:
    """Mixin for a `lightning.pytorch.LightningModule`: every optimizer step takes the exact gradient of
    the whole batch, computed `micro_batch_size` samples at a time with `accumnorm.backward`.

    Args:
        micro_batch_size: samples per micro-batch; the DataLoader's batch (per rank under DDP) is the
            batch of one optimizer step, and its last micro-batch may be smaller.
        bn: "exact" (every BatchNorm call sees the whole batch, across ranks under DDP) or "micro"
            (per-micro-batch statistics: plain accumulation, the baseline).
        schedule, store, memory_budget, keep_every: how exact mode runs, as for `accumnorm.backward`.

    Subclasses implement `training_loss(batch)`, the mean loss over a micro-batch (what their
    `training_step` used to compute), and put the mixin before LightningModule in their bases.

    Shape:
        - batch: a Tensor or a tuple/list/dict of Tensors sharing dim 0 (the samples), as
          `accumnorm.backward` takes it.

    Examples::

        >>> class Model(ExactAccumulation, L.LightningModule):
        ...     def __init__(self):
        ...         super().__init__(micro_batch_size=4)
        ...         self.net = nn.Sequential(nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
        ...                                  nn.Linear(8 * 26 * 26, 10))
        ...     def training_loss(self, batch):
        ...         x, y = batch
        ...         return F.cross_entropy(self.net(x), y)
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.1)
        >>> L.Trainer(max_steps=10).fit(Model(), DataLoader(train_set, batch_size=32))
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse the bases in the wrong order when the class is made: LightningModule first would take the mixin's
        keyword arguments itself, and fail on them with a message about neither."""
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        if pl.LightningModule in mro and mro.index(pl.LightningModule) < mro.index(ExactAccumulation):
            raise TypeError(f"{cls.__name__} puts LightningModule before ExactAccumulation in its bases: write class "
                            f"{cls.__name__}(ExactAccumulation, L.LightningModule)")

    def __init__(self, *args: Any, micro_batch_size: int, bn: BNMode = "exact", schedule: Schedule = "auto",
                 store: str | torch.device | None = None, memory_budget: int | None = None,
                 keep_every: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self, pl.LightningModule):
            raise TypeError(f"ExactAccumulation is a mixin for lightning's LightningModule, got {type(self).__name__}; "
                            f"write class {type(self).__name__}(ExactAccumulation, L.LightningModule)")
        # One attribute, not `self.bn` and the like: LightningModules often name a BatchNorm layer so.
        self.accumnorm_options = backward_options(self, _micro_batch_loss, micro_batch_size=micro_batch_size, bn=bn,
                                                  schedule=schedule, store=store, memory_budget=memory_budget,
                                                  keep_every=keep_every)
        self._accumnorm_group: ProcessGroup | None = None
        self._accumnorm_ready = False  # set by on_fit_start's checks
        self._accumnorm_has_grad = False  # training_step made this step's gradient: backward must not be missed
        self._accumnorm_made_grad = False  # and optimizer_zero_grad must keep it
        self._accumnorm_loss = _micro_batch_loss  # compiled by on_fit_start when Lightning compiled the module
        self._accumnorm_stand_in: Tensor | None = None  # the graph of the loss training_step returns (`backward`)

    def training_loss(self, batch: Any) -> Tensor:
        """The mean loss over one micro-batch, a scalar Tensor: implement it in the subclass."""
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        """Put the whole batch's gradient in `.grad`, micro-batch by micro-batch; return its mean loss, whose graph is
        a stand-in for `backward` to read what Lightning back-propagates."""
        if not self._accumnorm_ready:
            raise RuntimeError(f"{type(self).__name__}.on_fit_start did not reach ExactAccumulation.on_fit_start, "
                               "which checks the trainer: call super().on_fit_start() from your override")
        if getattr(self.trainer.fit_loop, "_skip_backward", False):
            return self._statistics_only(batch)
        # NOTE: Lightning zeroes gradients after training_step and back-propagates its output; here the
        # gradient is made inside training_step, so it starts from none here and the two hooks below do nothing.
        # The optimizer's tensors outside the module too (a learnable temperature), as Lightning's zeroing would.
        with gradients_set_aside(stepped_tensors(self, self.trainer.optimizers), keep=True):
            loss = self._step(batch)
        self._accumnorm_has_grad = self._accumnorm_made_grad = True
        # The loss, with a stand-in of zero for its graph: `backward` reads from it what Lightning's backward of what
        # training_step returns owes the loss (1 for the loss itself, 0.25 for `0.25 * loss`).
        self._accumnorm_stand_in = torch.zeros((), dtype=loss.dtype, device=loss.device, requires_grad=True)
        return loss + self._accumnorm_stand_in

    def _step(self, batch: Any) -> Tensor:
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)  # "16-mixed" only
        return backward(self, batch, self._accumnorm_loss, process_group=self._accumnorm_group, grad_scaler=scaler,
                        **self.accumnorm_options)

    def _statistics_only(self, batch: Any) -> Tensor:
        """A batch whose backward Lightning skips (StochasticWeightAveraging's epoch that recomputes the BatchNorm
        statistics of the averaged weights): the whole batch's forward moves the running statistics, and the
        gradients stay as they were, as Lightning leaves them. accumnorm has no step without a backward: the step's
        gradient is made and put aside."""
        with gradients_set_aside(stepped_tensors(self, self.trainer.optimizers), keep=False):
            return self._step(batch)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        """Lightning calls it after training_step: the gradient training_step has just made stays. A training_step that
        made none (it returned None, Lightning's way to skip a batch) has the gradients zeroed, as Lightning's own
        hook does, so that the optimizer's step does not take the last batch's again."""
        made, self._accumnorm_made_grad = self._accumnorm_made_grad, False
        if not made:
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        """Lightning back-propagates what training_step returned (scaled by its GradScaler under "16-mixed"), whose
        gradient with respect to the step's loss training_step has already put in `.grad`. What the returned value
        owes the loss scales that gradient (`0.25 * loss` returned: a quarter of it), and a term added to it with a
        graph of its own (a penalty) adds its gradient, averaged over the ranks under DDP, as Lightning's backward
        would."""
        if not self._accumnorm_has_grad:
            raise RuntimeError(f"{type(self).__name__}.training_step returned a loss without calling "
                               "ExactAccumulation.training_step, so no gradient was computed; return "
                               "super().training_step(batch, batch_idx) from your override")
        self._accumnorm_has_grad = False
        stand_in, self._accumnorm_stand_in = self._accumnorm_stand_in, None
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)  # the step's gradient is scaled already
        _add_gradient(self, loss, stand_in, 1.0 if scaler is None else scaler.get_scale(), self._accumnorm_group)

    def on_fit_start(self) -> None:
        """Check the trainer before any step and find the process group of a DDP strategy; for a module Lightning
        compiled (`trainer.fit(torch.compile(module))`), move the compiling from training_step to training_loss."""
        super().on_fit_start()
        self._accumnorm_group = _check_trainer(self)
        compiled = getattr(self, "_compiler_ctx", None)  # what Lightning's from_compiled keeps
        if compiled is not None:
            # the compiled training_step would have dynamo trace the step's own code: the step runs as Python,
            # and each micro-batch's training_loss runs compiled
            self.training_step = compiled["original_training_step"]
            self._accumnorm_loss = compiled["dynamo_ctx"](_micro_batch_loss)
        self._accumnorm_ready = True

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep what the recompute schedule measured of the module in the checkpoint (`checkpointing.measurements`):
        a resumed fit then steps bit for bit as one that never stopped. An override calls super()."""
        super().on_save_checkpoint(checkpoint)
        checkpoint[CHECKPOINT_KEY] = measurements(self)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore what `on_save_checkpoint` kept (a checkpoint from before it kept them has none)."""
        super().on_load_checkpoint(checkpoint)
        if CHECKPOINT_KEY in checkpoint:
            load_measurements(self, checkpoint[CHECKPOINT_KEY])


def _add_gradient(module: ExactAccumulation, returned: Tensor, stand_in: Tensor, scale: float,
                  group: ProcessGroup | None) -> None:
    """Make `.grad` what Lightning's backward of `returned` would: the step's gradient (of its loss, times `scale`)
    times what `returned` owes the loss over `scale`, plus the gradient of a term added to it; under DDP, whose
    reducer the mixin keeps off, that term's as the ranks' mean for the module's parameters, as DDP would make it.
    The tensors are the module's parameters and the optimizers' outside it (a learnable temperature)."""
    params = [p for p in module.parameters() if p.requires_grad]
    tensors = [t for t in stepped_tensors(module, module.trainer.optimizers) if t.requires_grad]  # params first
    owed, *grads = (torch.autograd.grad(returned, [stand_in, *tensors], allow_unused=True) if returned.requires_grad
                    else [None] * (len(tensors) + 1))
    if owed is None:
        raise ValueError(f"{type(module).__name__}.training_step returned a value that does not depend on the loss "
                         "ExactAccumulation.training_step returned (detached?), whose gradient is already in .grad; "
                         "Lightning back-propagates what training_step returns. Return that loss, a multiple of it, "
                         "or it plus a term")
    factor = float(owed) / scale
    if factor != 1.0:
        for t in tensors:
            if t.grad is not None:
                t.grad.mul_(factor)
    if all(g is None for g in grads):
        return
    if group is not None:  # every rank reduces every parameter's (one unused as 0), in one flat all-reduce
        summed = Collectives(group).sum_each([torch.zeros_like(p) if g is None else g
                                              for p, g in zip(params, grads[:len(params)])])
        grads = [g / rank_and_size(group)[1] for g in summed] + grads[len(params):]
    for t, g in zip(tensors, grads):
        if g is not None:
            t.grad = g if t.grad is None else t.grad + g


def _micro_batch_loss(module: ExactAccumulation, micro_batch: Any) -> Tensor:
    return module.training_loss(micro_batch)


def _check_trainer(module: ExactAccumulation) -> ProcessGroup | None:
    """Refuse set-ups that would train wrongly or not at all; returns the process group to reduce over."""
    trainer, name = module.trainer, type(module).__name__
    if not module.automatic_optimization:
        raise ValueError(f"{name} sets automatic_optimization = False, but ExactAccumulation computes the gradient "
                         "in training_step for Lightning's automatic optimization to step; remove that line")
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) accumulates with each batch's own "
            "BatchNorm statistics; remove it and make the DataLoader yield the batch of a whole optimizer step "
            f"({trainer.accumulate_grad_batches}x its batch_size), which {name} splits into micro-batches of "
            f"micro_batch_size={module.accumnorm_options['micro_batch_size']}")
    if any(isinstance(c, pl.callbacks.GradientAccumulationScheduler) for c in trainer.callbacks):
        raise ValueError(
            "GradientAccumulationScheduler accumulates with each batch's own BatchNorm statistics, as "
            "Trainer(accumulate_grad_batches=...) does, and would only be undone by the gradient each training_step "
            f"makes; remove it and make the DataLoader yield the batch of a whole optimizer step, which {name} splits "
            f"into micro-batches of micro_batch_size={module.accumnorm_options['micro_batch_size']}")
    for hook in _OWNED_HOOKS:
        if getattr(type(module), hook) is not getattr(ExactAccumulation, hook):
            raise ValueError(f"{name} overrides {hook}(), which ExactAccumulation implements: its training_step "
                             "already computes the gradient; remove the override")
    if type(module).training_loss is ExactAccumulation.training_loss:
        raise ValueError(f"{name} must implement training_loss(self, batch) returning the mean loss of a "
                         "micro-batch (what training_step computed before ExactAccumulation)")
    # Automatic optimization has exactly one: Lightning refuses several, and stands in for none.
    check_optimizer(trainer.optimizers[0], module, "return an optimizer over self.parameters() from "
                    "configure_optimizers (returning None gives Lightning a placeholder optimizer)")
    wrapper = trainer.strategy.model
    if isinstance(wrapper, DistributedDataParallel):
        # accumnorm.backward all-reduces the gradient of the whole global batch itself. DDP's reducer
        # would also average, after each micro-batch's backward: never let it arm its hooks.
        wrapper.require_backward_grad_sync = False
        return wrapper.process_group
    if wrapper is not module or trainer.world_size != 1:
        raise ValueError(f"ExactAccumulation runs on one device or under strategy='ddp', got "
                         f"{type(trainer.strategy).__name__} with {trainer.world_size} processes")
    return None
