"""Exact BatchNorm under gradient accumulation in OpenMMLab's mmengine (mmdet, mmseg, mmpretrain): config only.

    custom_imports = dict(imports=["accumnorm.integrations.mmengine"], allow_failed_imports=False)
    train_dataloader = dict(batch_size=16, ...)              # the batch of one optimizer step (per GPU)
    train_cfg = dict(type="ExactEpochBasedTrainLoop", micro_batch_size=2, max_epochs=12, val_interval=1)
    # or dict(type="ExactIterBasedTrainLoop", micro_batch_size=2, max_iters=90000, ...)

Was: `batch_size=2` with `optim_wrapper=dict(accumulative_counts=8)`, which normalizes each pair of images
with its own BatchNorm statistics. Each batch the dataloader yields is now one optimizer step: the loop cuts
it (tensors along dim 0, lists of data samples as lists) into micro-batches of `micro_batch_size` and runs
them through `accumnorm.backward`, every BatchNorm call seeing the whole batch (of every GPU under DDP). The
model's own `data_preprocessor` and `loss` run on each micro-batch, inside the optim wrapper's
`optim_context` (AMP autocast), and its parsed loss, a mean over the micro-batch's samples, is weighted by
their share of the batch. The optim wrapper then steps as usual: `update_params` (gradient clipping, the
AMP loss scaler, `zero_grad`), param schedulers, hooks, logging, checkpoints and resume stay mmengine's
(a checkpoint also keeps what the recompute schedule measured of the model, for a bit-identical resume).

Losses divided by a count over the whole batch (mmdet's `avg_factor`, the positives of the batch) need the
whole batch's outputs: with `whole_batch_loss=True` the loop runs `model(inputs, data_samples, mode="tensor")`
on each micro-batch and calls the model's `loss_by_feat(outputs, data_samples)` once, on the outputs of the
whole batch (each tensor concatenated over the micro-batches) and all its data samples, which returns the dict
of losses `loss` would. One process only (accumnorm's whole-batch loss form does not run under DDP).

The runner's `compile` config (`compile=True` or a dict of torch.compile's options, e.g. `dict(backend="inductor")`)
compiles what the exact step runs: mmengine compiles `model.train_step`, which the loop bypasses, so the loop
compiles the model itself in place (`model.compile(...)`: its forward, the loss mode included, and its validation
too; checkpoints keep their keys). The steps stay exact: dynamo breaks its graph at each BatchNorm call.

Refused before the first step, saying what to change (a ValueError): `accumulative_counts > 1`, several optim
wrappers, a wrapper other than DDP (FSDP, DeepSpeed, MMSeparateDistributedDataParallel), a model with its own
`train_step` (it would be bypassed), an optimizer over none of the model's parameters, a `compile` config that
torch.compile would not take or with `fullgraph=True` (a graph break is then an error). A step that fails (a NaN
loss, an exception, Ctrl-C) changes nothing: the model, the optimizer, the schedulers and the loop's iteration
counter are as they were, and the error reaches mmengine.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import accumnorm

from .._engine.args import BNMode, Schedule, check_compile_options
from .._engine.checkpointing.measurements import CHECKPOINT_KEY, load_measurements, measurements
from .._optimizer import check_optimizer
from ._checks import backward_options

try:
    from mmengine.hooks import Hook
    from mmengine.model import BaseModel, is_model_wrapper
    from mmengine.optim import OptimWrapperDict
    from mmengine.registry import LOOPS
    from mmengine.runner import EpochBasedTrainLoop, IterBasedTrainLoop
except ImportError as err:  # an optional integration: the core needs only torch
    raise ImportError("accumnorm.integrations.mmengine needs mmengine: pip install 'accumnorm[mmengine]'") from err

__all__ = ["ExactEpochBasedTrainLoop", "ExactIterBasedTrainLoop"]

_ORDER = "_accumnorm_order"  # a field added to the batch in the whole-batch form: each micro-batch's place


class _ExactTrainStep:
    """What the two loops share: the options, the checks, and one exact step in place of `model.train_step`."""

    runner: Any
    _iter: int

    def __init__(self, runner: Any, dataloader: Any, *, micro_batch_size: int, whole_batch_loss: bool = False,
                 bn: BNMode = "exact", schedule: Schedule = "auto", store: str | torch.device | None = None,
                 memory_budget: int | None = None, keep_every: int | None = None, **kwargs: Any) -> None:
        model = runner.model.module if is_model_wrapper(runner.model) else runner.model
        self.accumnorm_options = backward_options(model, _placeholder_loss, micro_batch_size=micro_batch_size, bn=bn,
                                                  schedule=schedule, store=store, memory_budget=memory_budget,
                                                  keep_every=keep_every)
        self.whole_batch_loss = whole_batch_loss
        super().__init__(runner, dataloader, **kwargs)  # type: ignore[call-arg]
        runner.register_hook(_KeepMeasurements(model), priority="LOWEST")  # built before the runner resumes

    def run(self) -> Any:
        """Check the runner's model, optim wrapper and compile config, compile the model as configured, then run
        mmengine's loop."""
        _check_runner(self.runner, self.whole_batch_loss, self.accumnorm_options["micro_batch_size"])
        compile_options = _compile_options(self.runner.cfg.get("compile"), self.accumnorm_options["bn"])
        if compile_options is not None:
            model = self.runner.model
            (model.module if is_model_wrapper(model) else model).compile(**compile_options)
        return super().run()  # type: ignore[misc]

    def run_iter(self, *args: Any) -> None:
        """mmengine's iteration, the exact step in place of `model.train_step`: (idx, batch) in the epoch-based
        loop, (batch,) in the iteration-based one."""
        idx, data_batch = args if len(args) == 2 else (self._iter, args[0])
        self.runner.call_hook("before_train_iter", batch_idx=idx, data_batch=data_batch)
        outputs = self.train_step(data_batch)
        self.runner.call_hook("after_train_iter", batch_idx=idx, data_batch=data_batch, outputs=outputs)
        self._iter += 1

    def train_step(self, data_batch: Any) -> dict[str, Tensor]:
        """`BaseModel.train_step` over the whole batch, in micro-batches: the gradient of its loss in `.grad`, then
        the optim wrapper's update; returns the whole batch's log variables."""
        model, optim_wrapper = self.runner.model, self.runner.optim_wrapper
        scaler = getattr(optim_wrapper, "loss_scaler", None)  # AmpOptimWrapper's GradScaler
        if self.whole_batch_loss:
            loss, log_vars = _whole_batch_step(model, data_batch, optim_wrapper, scaler, self.accumnorm_options)
        else:
            loss, log_vars = _micro_batch_step(model, data_batch, optim_wrapper, scaler, self.accumnorm_options)
        # A leaf: its backward in update_params reaches no parameter. The optim wrapper clips, unscales, steps,
        # zeroes the gradient and counts the iteration as after its own backward.
        optim_wrapper.update_params(loss.detach().requires_grad_())
        return log_vars


def _micro_batch_step(model: nn.Module, data_batch: Any, optim_wrapper: Any, scaler: Any,
                      options: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
    kept: dict[int, tuple[int, dict[str, Tensor]]] = {}  # per micro-batch (alive through the step): its log vars

    def loss_fn(module: nn.Module, micro: Any) -> Tensor:
        with optim_wrapper.optim_context(module):
            data = module.data_preprocessor(micro, True)
            losses = module._run_forward(data, mode="loss")
        loss, log_vars = module.parse_losses(losses)
        kept[id(micro)] = (_samples(micro), {k: v.detach() for k, v in log_vars.items()})
        return loss

    loss = accumnorm.backward(model, data_batch, loss_fn, grad_scaler=scaler, **options)
    return loss, _whole_log_vars(list(kept.values()))


def _whole_log_vars(parts: list[tuple[int, dict[str, Tensor]]]) -> dict[str, Tensor]:
    """The whole batch's log variables from each micro-batch's (its samples, its variables), weighted by samples. A
    variable some micro-batches lack (a head's term for positives that a micro-batch has none of) is, where it is a
    loss term (mmengine sums those named `loss` into the loss), 0 there, as it added 0 to that micro-batch's loss;
    any other is the mean over the micro-batches that have it."""
    total = sum(n for n, _ in parts)
    names = dict.fromkeys(name for _, log_vars in parts for name in log_vars)
    whole = {}
    for name in names:
        having = [(n, log_vars[name]) for n, log_vars in parts if name in log_vars]
        samples = total if "loss" in name else sum(n for n, _ in having)
        whole[name] = sum(n * value for n, value in having) / samples
    return whole


class _KeepMeasurements(Hook):
    """What the recompute schedule measured of the model, in each checkpoint and back at its resume (`measurements`):
    a resumed run then steps bit for bit as one that never stopped."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def before_save_checkpoint(self, runner: Any, checkpoint: dict) -> None:
        checkpoint[CHECKPOINT_KEY] = measurements(self.model)

    def after_load_checkpoint(self, runner: Any, checkpoint: dict) -> None:
        if CHECKPOINT_KEY in checkpoint:  # a checkpoint written without the exact loop has none
            load_measurements(self.model, checkpoint[CHECKPOINT_KEY])


def _whole_batch_step(model: nn.Module, data_batch: dict[str, Any], optim_wrapper: Any, scaler: Any,
                      options: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
    samples: dict[int, Any] = {}  # the first index of each micro-batch: its preprocessed data samples
    log: dict[str, dict[str, Tensor]] = {}

    def forward_fn(module: nn.Module, micro: dict[str, Any]) -> Any:
        micro = dict(micro)
        first = micro.pop(_ORDER)[0]
        with optim_wrapper.optim_context(module):
            data = module.data_preprocessor(micro, True)
            samples[first] = data.get("data_samples")
            return module._run_forward(data, mode="tensor")

    def batch_loss_fn(outputs: Any, targets: None) -> Tensor:
        with optim_wrapper.optim_context(model):
            losses = model.loss_by_feat(outputs, _joined([samples[k] for k in sorted(samples)]))
        loss, log_vars = model.parse_losses(losses)
        log["vars"] = {k: v.detach() for k, v in log_vars.items()}
        return loss

    batch = {**data_batch, _ORDER: list(range(_samples(data_batch)))}
    loss = accumnorm.backward(model, batch, forward_fn=forward_fn, batch_loss_fn=batch_loss_fn, grad_scaler=scaler,
                              **options)
    return loss, log["vars"]


def _joined(parts: list[Any]) -> Any:
    """The micro-batches' data samples as the whole batch's, in the form the collate function gave them: a tensor
    (`default_collate`'s) concatenated along dim 0, a list (`pseudo_collate`'s) of every sample; none, an empty list."""
    if all(isinstance(p, Tensor) for p in parts):
        return torch.cat(parts)
    return [s for p in parts if p is not None for s in p]


def _placeholder_loss(module: nn.Module, micro_batch: Any) -> Tensor:
    """Stands for the model's loss in the set-up checks of accumnorm.backward's arguments."""
    raise NotImplementedError


def _samples(batch: Any) -> int:
    """Samples in a batch: the length of its first field (a tensor's dim 0, a list's length)."""
    first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0] if isinstance(batch, (list, tuple)) \
        else batch
    return len(first)


def _compile_options(config: Any, bn: str) -> dict[str, Any] | None:
    """The keyword arguments of torch.compile that the runner's `compile` config (None, a bool or a dict, as mmengine
    takes it) asks for, checked; None for no compiling. mmengine compiles `model.train_step` with them, which the
    exact loop bypasses: the loop compiles the model (its forward, the loss mode included) in place instead."""
    if config is None or config is False:
        return None
    options = {} if config is True else dict(config) if isinstance(config, dict) else config
    check_compile_options(options, bn, name="the runner's compile")
    return options


def _check_runner(runner: Any, whole_batch_loss: bool, micro_batch_size: int) -> None:
    """Refuse, before the first step, what would train other than exactly (module doc)."""
    model, optim_wrapper = runner.model, runner.optim_wrapper
    module = model.module if is_model_wrapper(model) else model
    if isinstance(optim_wrapper, OptimWrapperDict):
        raise ValueError(f"the runner has several optim wrappers ({', '.join(optim_wrapper.keys())}), which a model's "
                         "own train_step steps; the exact loops take the whole batch's gradient for one optimizer: "
                         "use EpochBasedTrainLoop or IterBasedTrainLoop for this model")
    counts = getattr(optim_wrapper, "_accumulative_counts", 1)
    if counts != 1:
        raise ValueError(
            f"optim_wrapper accumulative_counts={counts} accumulates with each batch's own BatchNorm statistics; "
            "remove it and make train_dataloader's batch_size the batch of one optimizer step (batch_size x "
            f"accumulative_counts), which the loop cuts into micro-batches of micro_batch_size={micro_batch_size}")
    if is_model_wrapper(model) and not isinstance(model, DistributedDataParallel):
        raise ValueError(f"the exact loops run on one device or under DDP (MMDistributedDataParallel), got the model "
                         f"wrapped in {type(model).__name__}: accumnorm does not shard statistics and gradients; "
                         "use launcher='pytorch' with the default model wrapper")
    if not isinstance(module, BaseModel):
        raise ValueError(f"the exact loops train an mmengine BaseModel, got {type(module).__name__}")
    if type(module).train_step is not BaseModel.train_step:
        raise ValueError(f"{type(module).__name__} has its own train_step, which the exact loop would bypass (it runs "
                         "data_preprocessor, the forward in mode='loss' and parse_losses itself): use "
                         "EpochBasedTrainLoop or IterBasedTrainLoop for this model")
    check_optimizer(optim_wrapper.optimizer, module, "build optim_wrapper's optimizer over the model's parameters")
    if whole_batch_loss and not callable(getattr(module, "loss_by_feat", None)):
        raise ValueError(f"whole_batch_loss=True takes the loss of the whole batch's outputs from the model's "
                         f"loss_by_feat(outputs, data_samples), which {type(module).__name__} does not define")
    if whole_batch_loss and is_model_wrapper(model):
        raise ValueError("whole_batch_loss=True runs in one process (accumnorm's whole-batch loss form does not "
                         "reduce over processes): train on one GPU, or leave whole_batch_loss off")


@LOOPS.register_module()
class ExactEpochBasedTrainLoop(_ExactTrainStep, EpochBasedTrainLoop):
    """mmengine's EpochBasedTrainLoop whose iterations take the exact gradient of each batch in micro-batches.

    Args:
        runner, dataloader, max_epochs, val_begin, val_interval, dynamic_intervals: EpochBasedTrainLoop's.
        micro_batch_size: samples per micro-batch; train_dataloader's batch (per GPU) is the batch of one
            optimizer step, and its last micro-batch may be smaller.
        whole_batch_loss: take the loss once over the whole batch's outputs with the model's
            `loss_by_feat(outputs, data_samples)` (for losses divided by a count over the batch). Default: False.
        bn, schedule, store, memory_budget, keep_every: as for `accumnorm.backward`. Default: "exact", "auto", None,
            None, None.

    Examples::

        >>> train_cfg = dict(type="ExactEpochBasedTrainLoop", micro_batch_size=2, max_epochs=12)
    """


@LOOPS.register_module()
class ExactIterBasedTrainLoop(_ExactTrainStep, IterBasedTrainLoop):
    """mmengine's IterBasedTrainLoop whose iterations take the exact gradient of each batch in micro-batches.

    Args:
        runner, dataloader, max_iters, val_begin, val_interval, dynamic_intervals: IterBasedTrainLoop's.
        micro_batch_size, whole_batch_loss, bn, schedule, store, memory_budget, keep_every: as for
            `ExactEpochBasedTrainLoop`.

    Examples::

        >>> train_cfg = dict(type="ExactIterBasedTrainLoop", micro_batch_size=2, max_iters=90000, val_interval=5000)
    """
