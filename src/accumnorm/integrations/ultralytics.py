"""Exact gradient accumulation in ultralytics' own trainer: each batch's loss and BatchNorm whole, in micro-batches.

    from ultralytics import YOLO
    from accumnorm.integrations.ultralytics import exact_trainer

    YOLO("yolov8n.yaml").train(data="coco8.yaml", batch=64, trainer=exact_trainer(micro_batch_size=8))

Every batch the trainer loads is one optimizer step. Its images go through the model `micro_batch_size` at a
time, and ultralytics' loss is taken once over the whole batch's outputs: the gradient of one forward/backward
of the whole batch (`accumnorm.backward`'s whole-batch form), BatchNorm statistics included. ultralytics' own
accumulation (`batch` below `nbs`: it accumulates round(nbs / batch) batches) is plain accumulation twice over:
each batch's BatchNorm statistics are its own, and `v8DetectionLoss` divides each batch's class and box terms
by that batch's `target_scores_sum`.

The training loop stays ultralytics' (augmentation, warmup, AMP, EMA, validation, checkpoints, callbacks).
`exact_trainer` subclasses a trainer class (DetectionTrainer by default; any whose model computes its training
loss with BaseModel's `loss(batch)`, the criterion of `forward(batch["img"])`: segment, pose, obb, classify) so
that the model it builds gets an exact `loss`: in training, `loss(batch)` puts the gradient of the whole batch
into `.grad` and returns the loss as a tensor detached from the model, so the trainer's
`scaler.scale(loss).backward()` adds nothing more; under fp16 AMP the trainer's GradScaler scales it, as the
trainer's own backward would. Copies and pickles of that model (the EMA, `last.pt`, `best.pt`) are of
ultralytics' own class: checkpoints load without accumnorm.

Refused when the model is built (a TypeError): a model with a `loss` of its own (YOLO-World, YOLOE and RT-DETR
run their forward with more of the batch than its images). Refused when training starts (a ValueError naming
what to change): ultralytics' own accumulation (batch < nbs, also after an out-of-memory retry halved the
batch), `compile=True` or a mode (its loop then runs the whole batch in one forward of its own and takes the
loss of those outputs), several GPUs (the whole-batch loss form runs in one process), a model the trainer
replaced after building it (distillation, quantization-aware training).
"""
from __future__ import annotations

import functools
import os
from typing import Any

import torch
from torch import nn

import accumnorm

from .._engine.args import BNMode, Schedule, check_args, check_schedule_options

os.environ.setdefault("YOLO_OFFLINE", "1")  # else ultralytics looks up DNS names when it is imported
try:
    from ultralytics.models.yolo.detect import DetectionTrainer
    from ultralytics.nn.tasks import BaseModel
    from ultralytics.utils.torch_utils import unwrap_model
except ImportError as err:  # an optional integration: the core needs only torch
    raise ImportError("accumnorm.integrations.ultralytics needs ultralytics: pip install ultralytics") from err

__all__ = ["exact_trainer", "exact_loss"]


class _Options:
    """What the model's exact loss passes to accumnorm.backward; the trainer adds its GradScaler."""

    def __init__(self, micro_batch_size: int, bn: BNMode, schedule: Schedule, store: str | torch.device | None,
                 memory_budget: int | None, keep_every: int | None) -> None:
        self.micro_batch_size, self.bn, self.schedule, self.store = micro_batch_size, bn, schedule, store
        self.memory_budget, self.keep_every = memory_budget, keep_every
        self.grad_scaler: torch.amp.GradScaler | None = None


def _predict(model: nn.Module, images: torch.Tensor) -> Any:
    return model(images)  # a tensor is a prediction; in train mode a dict of maps with one row per image


class _ExactLoss:
    """Put before an ultralytics model's class: `loss(batch)` in training through `accumnorm.backward`."""

    _accumnorm_base: type

    def loss(self, batch: dict[str, Any], preds: Any = None) -> tuple[torch.Tensor, Any]:
        options = self.__dict__.get("_accumnorm")
        if preds is not None or options is None or not self.training or not torch.is_grad_enabled():
            return super().loss(batch, preds)  # validation, or the caller already ran the whole batch's forward
        result: dict[str, Any] = {}

        def batch_loss(outputs: Any, targets: dict[str, Any]) -> torch.Tensor:
            loss, result["items"] = super(_ExactLoss, self).loss(targets, outputs)  # the whole batch's
            result["loss"] = loss.detach()
            return loss.sum()  # what the trainer back-propagates

        accumnorm.backward(self, batch["img"], micro_batch_size=options.micro_batch_size, forward_fn=_predict,
                           batch_loss_fn=batch_loss, targets=batch, bn=options.bn, schedule=options.schedule,
                           store=options.store, memory_budget=options.memory_budget, keep_every=options.keep_every,
                           grad_scaler=options.grad_scaler)
        # A leaf: the trainer's backward of it reaches no parameter; the gradient is in .grad already.
        return result["loss"].requires_grad_(), result["items"]

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Copies and pickles are of ultralytics' class, without accumnorm's options: deepcopy (the EMA) and
        torch.save (checkpoints) give ultralytics' own model, made as object's reduction would make it."""
        _, _, state, *rest = super().__reduce_ex__(max(protocol, 2))
        if isinstance(state, dict):
            state = {k: v for k, v in state.items() if k != "_accumnorm"}
        return (object.__new__, (self._accumnorm_base,), state, *rest)


@functools.cache
def _exact_class(cls: type) -> type:
    return type(f"Exact{cls.__name__}", (_ExactLoss, cls), {"_accumnorm_base": cls, "__module__": cls.__module__})


def exact_loss(model: nn.Module, micro_batch_size: int, *, bn: BNMode = "exact", schedule: Schedule = "auto",
               store: str | torch.device | None = None, memory_budget: int | None = None,
               keep_every: int | None = None) -> nn.Module:
    """Make `model` (an ultralytics model, e.g. DetectionModel) compute its training loss exactly in micro-batches.

    In place; returns `model`. In training with grad enabled, `model.loss(batch)` (what `model(batch)` calls)
    adds to `.grad` the gradient of the loss over the whole batch, running `micro_batch_size` images at a time,
    and returns ultralytics' (loss, loss items) with the loss detached. `bn="micro"` keeps the loss whole but
    BatchNorm per micro-batch (GradCache's scheme); `schedule`, `store`, `memory_budget` and `keep_every` as for
    `accumnorm.backward`.
    """
    if not callable(getattr(model, "loss", None)):
        raise TypeError(f"expected an ultralytics model with a loss(batch, preds) method, got {type(model).__name__}")
    check_args(model, None, micro_batch_size, bn, schedule, forward_fn=_predict, batch_loss_fn=_predict)
    check_schedule_options(schedule, store, memory_budget, keep_every)
    base = model._accumnorm_base if isinstance(model, _ExactLoss) else type(model)
    if base.loss is not BaseModel.loss:
        raise TypeError(
            f"expected an ultralytics model whose loss is BaseModel's (the criterion of forward(batch['img'])), got "
            f"{base.__name__}, whose loss() is its own: its forward takes more of the batch than the images (YOLO-"
            "World's text features, YOLOE's prompts, RT-DETR's denoising targets), which exact_loss, running each "
            "micro-batch's images through model(images), would leave out. Nothing was changed. Train it with "
            "ultralytics' own loop")
    model.__class__ = _exact_class(base)
    model._accumnorm = _Options(micro_batch_size, bn, schedule, store, memory_budget, keep_every)
    return model


def _check_trainer(trainer: Any) -> None:
    """Refuse, naming what to change, a trainer set up to train other than exactly (module doc)."""
    accumulate = max(round(trainer.args.nbs / trainer.batch_size), 1)
    if accumulate > 1:
        raise ValueError(f"ultralytics would accumulate {accumulate} batches of {trainer.batch_size} per optimizer "
                         f"step (nbs={trainer.args.nbs}), each with its own BatchNorm statistics and loss "
                         "normalization: "
                         f"set batch >= nbs (e.g. batch={trainer.args.nbs}), the batch of one step, and let "
                         "micro_batch_size set the images per forward")
    if trainer.args.compile:
        raise ValueError(f"compile={trainer.args.compile!r} makes ultralytics' loop run the whole batch through the "
                         "model in one forward (preds = model(batch['img'])) and take the loss of its outputs: every "
                         "BatchNorm call normalizes that forward alone, outside accumnorm's step, and the whole "
                         "batch's activations are held at once. Nothing was changed. Use compile=False")
    if trainer.world_size > 1:
        raise ValueError(f"training on {trainer.world_size} devices: exact accumulation of a whole-batch loss runs in "
                         "one process; train on one device")
    if "_accumnorm" not in unwrap_model(trainer.model).__dict__:
        raise ValueError(f"the trainer's model ({type(unwrap_model(trainer.model)).__name__}) is not the one "
                         "get_model built (distillation or quantization-aware training replace it): not supported")


def exact_trainer(micro_batch_size: int, trainer: type | None = None, *, bn: BNMode = "exact",
                  schedule: Schedule = "auto", store: str | torch.device | None = None,
                  memory_budget: int | None = None, keep_every: int | None = None) -> type:
    """A subclass of `trainer` (default: ultralytics' DetectionTrainer) whose steps are exact in micro-batches.

    Pass it to `YOLO(...).train(trainer=...)`, or construct it as the trainer itself (`overrides=...`). Each batch
    the trainer loads (`batch` images, at least `nbs`) is one optimizer step, run `micro_batch_size` images at a
    time; see the module doc for what is refused. `bn`, `schedule`, `store`, `memory_budget` and `keep_every` as
    for `exact_loss`.
    """
    check_schedule_options(schedule, store, memory_budget, keep_every)
    base = trainer or DetectionTrainer

    class ExactTrainer(base):  # type: ignore[valid-type, misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.add_callback("on_pretrain_routine_end", _set_up)
            self.add_callback("on_train_batch_start", _check_trainer)  # an out-of-memory retry halves the batch

        def get_model(self, *args: Any, **kwargs: Any) -> nn.Module:
            return exact_loss(super().get_model(*args, **kwargs), micro_batch_size, bn=bn, schedule=schedule,
                              store=store, memory_budget=memory_budget, keep_every=keep_every)

    ExactTrainer.__name__ = ExactTrainer.__qualname__ = f"Exact{base.__name__}"
    return ExactTrainer


def _set_up(trainer: Any) -> None:
    _check_trainer(trainer)
    unwrap_model(trainer.model)._accumnorm.grad_scaler = trainer.scaler
