"""Gradient accumulation that is exact for BatchNorm: `accumnorm.backward`.

Plain accumulation runs K micro-batches through the model and adds up their gradients. That is the
gradient of the whole batch for every layer but BatchNorm, which normalizes each micro-batch with its
own statistics. `backward(..., bn="exact")` gives every batch-norm call the statistics and backward
sums of the whole batch. This module checks the input, picks a schedule (`accumnorm.schedules`), and
makes the call a transaction: on any error, `.grad` and running statistics are as they were.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.parameter import is_lazy

from .distributed import Collectives, unwrap_ddp
from .intercept import batch_norm_modules, sync_batch_norm_as_local, update_running_stats
from .schedules import LossFn, Step, cannot_run_reason, layerwise, passes, plain, resolve_store

__all__ = ["backward", "check_args"]

Batch = Tensor | Sequence[Tensor] | Mapping[str, Tensor]
BN_MODES = ("exact", "micro")
SCHEDULES = ("auto", "layerwise", "passes")


def backward(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    *,
    micro_batch_size: int,
    bn: str = "exact",
    schedule: str = "auto",
    store: str | torch.device | None = None,
    process_group: Any = None,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> Tensor:
    """Accumulate into `.grad` the gradient of the mean loss over `batch`, one micro-batch at a time.

    Args:
        model: the module; `loss_fn(model, micro_batch)` returns the mean loss over a micro-batch.
        batch: a Tensor or a tuple/list/dict of Tensors sharing dim 0, cut into micro-batches of
            `micro_batch_size` (the last may be smaller; every sample weighs the same).
        bn: "exact": every batch-norm call that uses batch statistics (torch's BatchNorm layers and
            their subclasses, accumnorm's, direct `F.batch_norm` calls) sees the whole batch, as if it
            went through at once, and running statistics are updated once per call.
            "micro": each micro-batch uses its own statistics, as plain accumulation does.
        schedule: how exact mode runs. "layerwise": the micro-batches in lockstep, about the cost of
            plain accumulation, keeping the whole batch's saved tensors in `store`; a model that
            torch.fx traces runs from its graph on this thread (see `accumnorm.trace_safe`; the
            part of loss_fn before its model call then runs twice), any other in worker threads.
            "passes": 2L + 1 passes for L BatchNorm calls, memory of one micro-batch. "auto":
            layerwise when it can run, else passes (with a warning saying why).
        store: where the layerwise schedule keeps the whole batch's saved tensors: None (the model's
            device on CPU, pinned host memory on CUDA), "cpu", or a torch.device.
        process_group: with torch.distributed, `batch` is this rank's share of the global batch:
            statistics, sums, loss and gradients are reduced over the group (do not wrap the model in
            DDP as well; a DDP-wrapped model is unwrapped and its group used).
        grad_scaler: a `torch.amp.GradScaler`: the loss is scaled by it before backward.

    Returns the whole-batch mean loss, detached. On any error nothing is changed.

    Example::

        optimizer.zero_grad()
        loss = accumnorm.backward(model, (x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]), micro_batch_size=4)
        optimizer.step()
    """
    model, process_group = unwrap_ddp(model, process_group)
    check_args(model, loss_fn, micro_batch_size, bn, schedule)
    store_device = resolve_store(store)
    micro_batches, sizes = _split(batch, micro_batch_size)
    collectives = Collectives(process_group)
    device = _device(model)
    total = sum(sizes)
    if process_group is not None:  # every sample of the global batch weighs the same
        total = int(collectives.sum_(torch.tensor(total, device=device)).item())
    bn_modules = batch_norm_modules(model)
    owners = {id(m.running_mean): m for m in bn_modules if m.running_mean is not None}
    step = Step(model, micro_batches, [n / total for n in sizes], loss_fn, collectives, grad_scaler, owners)
    # One micro-batch on one process is the whole batch: torch's own BatchNorm is already exact.
    exact = bn == "exact" and not (len(micro_batches) == 1 and process_group is None)
    if exact:
        _check_no_scripted_batch_norm(model)
    run = _pick_schedule(schedule, store_device, device) if exact else plain

    # Transaction: new gradients go to fresh .grad tensors, merged into the old ones only on success.
    params = [p for p in model.parameters() if p.requires_grad]
    saved_grads = [p.grad for p in params]
    stateful = [m for m in model.modules() if isinstance(m, _NormBase) or hasattr(m, "accumnorm_step_end")]
    saved_buffers = [{k: b.clone() for k, b in m._buffers.items() if b is not None and not is_lazy(b)}
                     for m in stateful]
    tracked_before = {m: m.num_batches_tracked.clone() for m in bn_modules if m.num_batches_tracked is not None}
    for p in params:
        p.grad = None
    try:
        with sync_batch_norm_as_local(bn_modules) if exact else nullcontext():
            run(step)
        loss = _whole_batch_loss(step, grad_scaler is not None)
        collectives.sum_grads_(params)
        if exact:
            update_running_stats(step.calls, tracked_before)
        for m in stateful:
            if hasattr(m, "accumnorm_step_end"):
                m.accumnorm_step_end()
    except BaseException:
        for p, g in zip(params, saved_grads):
            p.grad = g
        for m, buffers in zip(stateful, saved_buffers):
            for k, b in buffers.items():
                m._buffers[k].copy_(b)
        raise
    for p, old in zip(params, saved_grads):
        if old is not None:
            p.grad = old if p.grad is None else old.add_(p.grad)
    return loss


def check_args(model: Any, loss_fn: Any, micro_batch_size: Any, bn: Any, schedule: Any) -> None:
    """The arguments `backward` and the integrations share, checked before anything runs (TypeError/ValueError)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(model, micro_batch), got {type(loss_fn).__name__}")
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int):
        raise TypeError(f"micro_batch_size must be an int, got {type(micro_batch_size).__name__} {micro_batch_size!r}")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if bn not in BN_MODES:
        raise ValueError(f"bn must be one of {BN_MODES}, got {bn!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")


def _check_no_scripted_batch_norm(model: nn.Module) -> None:
    """TorchScript runs a scripted module's BatchNorm in C++, where no schedule can see it: refuse, don't be wrong."""
    for name, m in model.named_modules():
        if isinstance(m, torch.jit.ScriptModule) and "BatchNorm" in getattr(m, "original_name", ""):
            raise ValueError(
                f"bn='exact' cannot see the BatchNorm of the TorchScript module {name or 'model'} "
                f"({m.original_name}): script the model after training, or pass bn='micro'"
            )


def _pick_schedule(schedule: str, store: torch.device, model_device: torch.device) -> Callable[[Step], None]:
    """The exact schedule to run: layerwise when asked or possible, else passes."""
    if schedule == "passes":
        return passes
    reason = cannot_run_reason()
    if reason is None and schedule == "layerwise":
        return lambda step: layerwise(step, store, model_device)
    if reason is None:
        return lambda step: _layerwise_or_passes(step, store, model_device)
    if schedule == "layerwise":
        raise ValueError(f"schedule='layerwise' cannot run here: {reason}; use schedule='passes' "
                         "(schedule='auto' falls back to it)")
    warnings.warn(f"accumnorm.backward: the layerwise schedule cannot run here ({reason}); using the passes "
                  "schedule, which costs 2L + 1 passes for L BatchNorm calls", RuntimeWarning, stacklevel=3)
    return passes


def _layerwise_or_passes(step: Step, store: torch.device, model_device: torch.device) -> None:
    """schedule="auto": layerwise, or passes (one micro-batch at a time) if the saved tensors do not fit."""
    try:
        layerwise(step, store, model_device)
    except torch.OutOfMemoryError as e:
        step.restart()
        warnings.warn(f"accumnorm.backward: the layerwise schedule ran out of memory ({e}); using the passes "
                      "schedule, which holds one micro-batch at a time (store='cpu' may let layerwise fit)",
                      RuntimeWarning, stacklevel=4)
        passes(step)


def _whole_batch_loss(step: Step, scaled: bool) -> Tensor:
    """The whole-batch mean loss; a non-finite one is an error unless a GradScaler will skip the step."""
    losses = torch.stack(step.losses)
    finite = torch.isfinite(losses)
    # Under a GradScaler an overflow is expected now and then: its inf/nan gradients make the
    # scaler skip the step and lower the scale, so only an unscaled run treats it as an error.
    if not scaled and not bool(finite.all()):
        k = int((~finite).nonzero()[0])
        raise ValueError(f"loss is not finite ({losses[k].item()}) for micro-batch {k}; nothing was changed")
    weights = torch.tensor(step.weights, dtype=losses.dtype, device=losses.device)
    return step.collectives.sum_(losses @ weights)


def _split(batch: Batch, size: int) -> tuple[list[Any], list[int]]:
    """Cut a tensor, sequence or mapping of tensors into micro-batches of `size` along dim 0."""
    if isinstance(batch, Tensor):
        leaves, rebuild = [("batch", batch)], lambda parts: parts[0]
    elif isinstance(batch, Mapping):
        leaves = list(batch.items())
        rebuild = lambda parts: dict(zip(batch.keys(), parts))  # noqa: E731
    elif isinstance(batch, (list, tuple)):
        leaves = [(f"batch[{i}]", t) for i, t in enumerate(batch)]
        rebuild = lambda parts: type(batch)(parts)  # noqa: E731
    else:
        raise TypeError(f"batch must be a Tensor or a tuple/list/dict of Tensors, got {type(batch).__name__}")
    if not leaves:
        raise ValueError("batch is empty: expected at least one tensor")
    for name, t in leaves:
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if t.dim() == 0:
            raise ValueError(f"{name} is a 0-dim tensor: expected a batch dimension 0")
    lengths = {name: t.shape[0] for name, t in leaves}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"batch tensors must share dimension 0, got lengths {lengths}")
    n = leaves[0][1].shape[0]
    if n == 0:
        raise ValueError("batch is empty: dimension 0 has length 0")
    chunks = [t.split(size) for _, t in leaves]
    return [rebuild(list(parts)) for parts in zip(*chunks)], [min(size, n - i) for i in range(0, n, size)]


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")
