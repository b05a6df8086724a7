"""Exact BatchNorm under gradient accumulation in the Hugging Face Trainer: one changed line.

    from accumnorm.integrations.transformers import ExactTrainer

    args = TrainingArguments("out", per_device_train_batch_size=8, gradient_accumulation_steps=4)  # as they were
    trainer = ExactTrainer(model=model, args=args, train_dataset=train_set)     # was: Trainer(...)
    trainer.train()

`per_device_train_batch_size=b` with `gradient_accumulation_steps=K` means what it says: micro-batches of b,
K of them per optimizer step. The Trainer already gathers the K micro-batches of a step before running any
(`get_batch_samples`); at the first of them `training_step` runs all K through `accumnorm.backward` as one
whole batch, so that every BatchNorm layer normalizes with the statistics of the b*K samples, and the K-1
calls after it add nothing. The result is one step of the stock Trainer with `gradient_accumulation_steps=1`
and batch b*K (under DDP: one process with the whole global batch).

The loss is the Trainer's `compute_loss` (the model's `outputs.loss`, or `compute_loss_func`, or your
override), called on each micro-batch with `num_items_in_batch` set to that micro-batch's own count of
items (the labels that are not -100, as the Trainer counts them). A loss normalized by that count and a
model that ignores it (a mean over its samples, such as ResNetForImageClassification's) then both give the
micro-batch's mean, and the micro-batches are weighted by their counts over the whole batch: exact for
token-level losses, a short last batch included. The Trainer counts items only for a model that takes
`num_items_in_batch` (or with `compute_loss_func`); the weights count them, as it would, for any model with
`labels`, so that a model's own mean over its valid labels (ignore_index=-100) is exact too. A model whose config
declares the label its loss ignores (the segmentation models' `semantic_loss_ignore_index` or `loss_ignore_index`,
255) is weighted by its labels that are not that one. Without `labels` (or labels it cannot count) the weights are
sample counts.

Everything else is the Trainer's: logging, checkpoints and resume (a checkpoint also keeps what the recompute
schedule measured of the model, so that a resumed run steps bit for bit as one that never stopped), `max_grad_norm`,
LR schedulers, callbacks, `bf16` autocast and `fp16` (its GradScaler scales the loss here), DDP under torchrun
(accumnorm reduces statistics and gradients itself; the DDP wrapper's reducer is never armed), and
`torch_compile=True` or a compiled model on one process (dynamo breaks its graph at each BatchNorm call, where the
micro-batches meet).
Refused when the Trainer is made, or at the first step before anything changes (a ValueError saying what to
change): DeepSpeed, FSDP, `torch_compile=True` under DDP (Accelerate compiles the DDP wrapper, whose forward
accumnorm cannot run as its inner module's), several GPUs in one process (DataParallel), an optimizer over none
of the model's parameters, an override of `training_step` that changes its inputs before calling this one's
(transform each micro-batch in `compute_loss` instead). A step that fails (a NaN loss, an exception, Ctrl-C)
changes nothing: the Trainer sees the error before its optimizer, scheduler or `global_step` move.
"""
from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor, nn

import accumnorm

from .._engine.args import BNMode, Schedule
from .._engine.checkpointing.measurements import CHECKPOINT_KEY, load_measurements, measurements
from .._optimizer import check_optimizer
from ._checks import backward_options

try:
    from transformers import Trainer
except ImportError as err:  # an optional integration: the core needs only torch
    raise ImportError("accumnorm.integrations.transformers needs transformers: "
                      "pip install 'accumnorm[transformers]'") from err

__all__ = ["ExactTrainer"]


class ExactTrainer(Trainer):
    """A `transformers.Trainer` whose optimizer steps take the exact gradient of the K micro-batches of each step.

    Args:
        *args, **kwargs: those of `transformers.Trainer`, unchanged.
        bn: "exact" (every BatchNorm call sees the whole batch of a step, across processes) or "micro"
            (per-micro-batch statistics: plain accumulation with whole-batch loss weights). Default: "exact".
        schedule, store, memory_budget, keep_every: how exact mode runs, as for `accumnorm.backward`. Default:
            "auto", None, None, None.

    Examples::

        >>> model = ResNetForImageClassification(ResNetConfig(num_labels=10))
        >>> args = TrainingArguments("out", per_device_train_batch_size=4, gradient_accumulation_steps=8, bf16=True)
        >>> ExactTrainer(model=model, args=args, train_dataset=train_set).train()   # BatchNorm over 32 images
    """

    def __init__(self, *args: Any, bn: BNMode = "exact", schedule: Schedule = "auto",
                 store: str | torch.device | None = None, memory_budget: int | None = None,
                 keep_every: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._accumnorm_options = backward_options(self.model, _micro_batch_loss, micro_batch_size=1, bn=bn,
                                                   schedule=schedule, store=store, memory_budget=memory_budget,
                                                   keep_every=keep_every)
        self._accumnorm_batches: list[Any] = []  # the micro-batches of the step get_batch_samples gathered
        self._accumnorm_gathered: list[Any] = []  # and what each held then (`_contents`)
        self._accumnorm_checked = False
        _check_set_up(self)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> tuple[list, Any]:
        """The Trainer's K micro-batches of a step, kept for `training_step` to run as one whole batch."""
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._accumnorm_batches = batches
        self._accumnorm_gathered = [_contents(b) for b in batches]
        return batches, num_items

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Tensor | int | None = None) -> Tensor:
        """At the step's first micro-batch, put the gradient of the whole step's loss in `.grad` and return that
        loss; at the others, return 0 (the Trainer adds the K returns up for its log)."""
        batches = self._accumnorm_batches
        if not any(inputs is b for b in batches):
            raise RuntimeError("ExactTrainer.training_step got a batch that get_batch_samples did not gather: a call "
                               f"outside the Trainer's training loop (call trainer.train()), or {_TRANSFORMED}")
        if inputs is not batches[0]:
            return torch.zeros((), device=self.args.device)
        if not _unchanged(inputs, self._accumnorm_gathered[0]):
            raise ValueError("ExactTrainer.training_step got the step's first micro-batch changed since the Trainer "
                             f"gathered it (a value replaced or changed in place): {_TRANSFORMED}. Nothing was "
                             "changed")
        if not self._accumnorm_checked:
            _check_step(self, model)
            self._accumnorm_checked = True
        model.train()
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()
        batches = [self._prepare_inputs(b) for b in batches]
        weights = self._micro_batch_weights(batches)
        scaler = getattr(self.accelerator, "scaler", None)

        def loss_fn(module: nn.Module, micro: dict[str, list]) -> Tensor:
            (batch,), ((weight, items),) = micro["batch"], micro["weight"]
            with self.compute_loss_context_manager():
                loss = self.compute_loss(module, dict(batch), num_items_in_batch=items)  # a copy: it pops labels
            return loss * weight

        loss = accumnorm.backward(model, {"batch": batches, "weight": weights}, loss_fn, grad_scaler=scaler,
                                  **self._accumnorm_options)
        return loss.to(self.args.device)

    # The two methods the Trainer calls with a checkpoint's folder, as it saves one and as it resumes from one
    def _save_rng_state(self, output_dir: str) -> None:
        """The Trainer's RNG states, and what the recompute schedule measured of the model (`measurements`): a run
        resumed from the checkpoint then steps bit for bit as one that never stopped."""
        super()._save_rng_state(output_dir)
        if self.args.should_save:
            torch.save(measurements(self.model), os.path.join(output_dir, _MEASUREMENTS))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """The checkpoint's RNG states, and what `_save_rng_state` kept beside them (a checkpoint without: none)."""
        super()._load_rng_state(checkpoint)
        path = None if checkpoint is None else os.path.join(checkpoint, _MEASUREMENTS)
        if path is not None and os.path.isfile(path):
            load_measurements(self.model, torch.load(path, weights_only=True))

    def _micro_batch_weights(self, batches: list[dict[str, Any]]) -> list[tuple[float, Any]]:
        """Per micro-batch: the factor on its `compute_loss` that makes accumnorm's equal weights (1 / micro-batches,
        over all processes) the whole batch's weights (its share of the items, or of the samples), and the
        count of items to pass as `num_items_in_batch` (None where the Trainer counts none)."""
        items = [_local_items(self, b) for b in batches]
        ignored = None if self.compute_loss_func is not None else _ignored_label(self)
        if ignored is not None:  # the model's own loss, over the labels its config does not ignore
            labels = [_labels_not(b, *ignored) for b in batches]
        elif all(n is None for n in items):
            labels = [_local_items(self, b, always=True) for b in batches]
        else:
            labels = items
        counts = [float(n) if n is not None else float(_samples(b)) for n, b in zip(labels, batches)]
        totals = torch.tensor([sum(counts), len(batches)], dtype=torch.float64, device=self.args.device)
        if self.accelerator.num_processes > 1:
            totals = self.accelerator.reduce(totals, reduction="sum")
        count, micro_batches = totals.tolist()
        factors = [_loss_scale(self, n) for n in items]  # what compute_loss multiplied its loss by
        # A micro-batch without items weighs 0; its count passed as 1 keeps a loss summed over no item at 0, not 0/0.
        passed = [n if n is None else torch.clamp(torch.as_tensor(n), min=1) for n in items]
        return [(c / count * micro_batches / f, n) for c, n, f in zip(counts, passed, factors)]


_MEASUREMENTS = f"{CHECKPOINT_KEY}.pt"  # in a checkpoint's folder


_TRANSFORMED = ("an override of training_step that changes its inputs before calling ExactTrainer's. ExactTrainer "
                "runs the K micro-batches of a step together at the step's first call, from the batches the Trainer "
                "gathered, and the others would go untransformed: transform each micro-batch in compute_loss, which "
                "runs once per micro-batch, or in the data collator")


def _contents(batch: dict[str, Any]) -> list[tuple[str, Any, int | None]]:
    """What a batch holds: each key, its value, and a tensor's version (which an in-place change moves)."""
    return [(key, value, value._version if isinstance(value, Tensor) else None) for key, value in batch.items()]


def _unchanged(batch: dict[str, Any], contents: list[tuple[str, Any, int | None]]) -> bool:
    """Whether `batch` holds what `contents` says it held: the same keys, each the same object, no tensor changed."""
    return len(batch) == len(contents) and all(
        key == k and value is v and (not isinstance(value, Tensor) or value._version == version)
        for (key, value), (k, v, version) in zip(batch.items(), contents))


def _micro_batch_loss(module: nn.Module, micro_batch: Any) -> Tensor:
    """Stands for the Trainer's loss in the set-up checks of accumnorm.backward's arguments."""
    raise NotImplementedError


def _samples(batch: dict[str, Any]) -> int:
    """Samples in an HF batch: dim 0 of its first tensor."""
    for value in batch.values():
        if isinstance(value, Tensor) and value.dim() > 0:
            return len(value)
    raise ValueError(f"a batch of the Trainer holds no tensor with a batch dimension: keys {sorted(batch)}")


def _local_items(trainer: Trainer, batch: dict[str, Any], always: bool = False) -> Tensor | None:
    """The Trainer's own count of items (labels that are not -100) in one micro-batch of this process; `always`:
    counted as the Trainer counts them even for a model it counts none for (one that does not take
    `num_items_in_batch`)."""
    args = trainer.args
    averaged, args.average_tokens_across_devices = args.average_tokens_across_devices, False  # no all-gather
    accepts = trainer.model_accepts_loss_kwargs
    trainer.model_accepts_loss_kwargs = accepts or always
    try:
        return trainer._get_num_items_in_batch([batch], args.device)
    finally:
        args.average_tokens_across_devices = averaged
        trainer.model_accepts_loss_kwargs = accepts


def _ignored_label(trainer: Trainer) -> tuple[int, bool] | None:
    """The label the model's own loss leaves out, where its config declares one (Hugging Face's segmentation models:
    `semantic_loss_ignore_index`, UperNet's `loss_ignore_index`, 255 by default), and whether the loss is a mean over
    every label all the same (a head of one label: Segformer's binary loss masks the ignored pixels but divides by
    all of them). None where the config declares none: the Trainer's count, which leaves out -100, holds."""
    config = getattr(trainer.accelerator.unwrap_model(trainer.model), "config", None)
    for name in ("semantic_loss_ignore_index", "loss_ignore_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value, getattr(config, "num_labels", None) == 1
    return None


def _labels_not(batch: dict[str, Any], ignored: int, every: bool) -> Tensor | int | None:
    """The labels of one micro-batch that are not `ignored` (`every`: all of them); None without labels."""
    labels = batch.get("labels")
    if not isinstance(labels, Tensor):
        return None
    return labels.numel() if every else labels.ne(ignored).sum()


def _loss_scale(trainer: Trainer, num_items: Any) -> float:
    """The factor the stock `compute_loss` multiplies a loss by, as it decides it (the process count, for DDP's
    mean of the ranks' gradients to be their sum)."""
    if (trainer.args.average_tokens_across_devices and num_items is not None
            and (trainer.model_accepts_loss_kwargs or trainer.compute_loss_func)):
        return float(trainer.accelerator.num_processes // trainer.get_tp_size())
    return 1.0


_COMPILED_DDP = ("TrainingArguments(torch_compile=True) on {processes} processes: Accelerate compiles the DDP wrapper "
                 "of the model, whose forward accumnorm cannot run as its inner module's (it reduces the statistics "
                 "and gradients itself, and the wrapper's reducer would wait for a backward of its own). Nothing was "
                 "changed. Set torch_compile=False, or train on one process")


def _check_set_up(trainer: Trainer) -> None:
    """Refuse, when the Trainer is made, the settings under which its steps would not be exact."""
    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        engine = "DeepSpeed" if trainer.is_deepspeed_enabled else "FSDP"
        raise ValueError(f"ExactTrainer runs on one device or under DDP, got {engine}: accumnorm does not shard "
                         f"the model's statistics and gradients; remove the {engine.lower()} setting from "
                         "TrainingArguments (or the accelerate config) to train with DDP")
    if trainer.args.torch_compile and trainer.args.world_size > 1:
        raise ValueError(_COMPILED_DDP.format(processes=trainer.args.world_size))
    if trainer.args.n_gpu > 1:
        raise ValueError(f"the Trainer would run nn.DataParallel over {trainer.args.n_gpu} GPUs in one process, "
                         "whose replicas normalize their shares alone: launch one process per GPU with torchrun "
                         "(DDP), or make one GPU visible")
    if trainer.optimizer is not None:
        check_optimizer(trainer.optimizer, trainer.model, "pass optimizers=(optimizer, scheduler) over "
                        "model.parameters(), or let the Trainer make them")


def _check_step(trainer: Trainer, model: nn.Module) -> None:
    """Refuse, at the first step and before it changes anything, what only the prepared objects show."""
    # checked before unwrap_model, which puts the module inside the DDP wrapper in the compiled wrapper's place
    if isinstance(getattr(model, "_orig_mod", None), nn.parallel.DistributedDataParallel):
        raise ValueError(_COMPILED_DDP.format(processes=trainer.accelerator.num_processes))
    inner = trainer.accelerator.unwrap_model(model, keep_torch_compile=True)
    if model is not inner and not isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError(f"ExactTrainer runs on one device or under DDP, got the model wrapped in "
                         f"{type(model).__name__}")
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # inside accelerate's wrapper
    check_optimizer(optimizer, inner, "pass optimizers=(optimizer, scheduler) over model.parameters(), or let "
                    "the Trainer make them")
