"""`accumnorm.backward`'s arguments: checked before anything runs, and the batch cut into micro-batches."""
from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

import torch
import torch.nn as nn
from torch import Tensor

from .memory.budget import check_budget
from .memory.store import resolve_store

__all__ = ["Batch", "BNMode", "Schedule", "check_args", "check_compile_options", "check_schedule_options",
           "check_step_args", "split"]

Batch = Tensor | Sequence[Tensor] | Mapping[str, Tensor]
BNMode = Literal["exact", "micro"]
Schedule = Literal["auto", "layerwise", "recompute", "segments", "passes"]


def check_args(model: Any, loss_fn: Any, micro_batch_size: Any, bn: Any, schedule: Any, *, forward_fn: Any = None,
               batch_loss_fn: Any = None, targets: Any = None) -> None:
    """The arguments `backward`, the Trainer and the integrations share, checked before anything runs."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _check_objective(loss_fn, forward_fn, batch_loss_fn, targets)
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int):
        raise TypeError(f"micro_batch_size must be an int, got {type(micro_batch_size).__name__} {micro_batch_size!r}")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if bn not in get_args(BNMode):
        raise ValueError(f"bn must be one of {get_args(BNMode)}, got {bn!r}")
    if schedule not in get_args(Schedule):
        raise ValueError(f"schedule must be one of {get_args(Schedule)}, got {schedule!r}")


def check_schedule_options(schedule: Any, store: Any, memory_budget: Any, keep_every: Any) -> torch.device:
    """`store`, `memory_budget` and `keep_every`, checked as `backward`, the Trainer and the integrations take them
    (`schedule` by `check_args`); the device `store` names."""
    check_budget(memory_budget)
    check_keep_every(keep_every, schedule)
    return resolve_store(store)


def check_keep_every(keep_every: Any, schedule: Any) -> None:
    """`keep_every`, the segments schedule's setting: None, or an int >= 1 given with schedule="segments"."""
    if keep_every is None:
        return
    if isinstance(keep_every, bool) or not isinstance(keep_every, int):
        raise TypeError(f"keep_every must be an int, got {type(keep_every).__name__} {keep_every!r}")
    if keep_every < 1:
        raise ValueError(f"keep_every must be >= 1, got {keep_every}")
    if schedule != "segments":
        raise ValueError(f"keep_every is the segments schedule's setting, but schedule is {schedule!r}: pass "
                         "schedule='segments' with it, or leave it out")


def check_compile_options(options: Any, bn: Any, name: str = "compile") -> None:
    """Keyword arguments for `torch.compile` that the Trainer or an integration compiles the model with (`name` says
    whose, in the messages): None, or a dict that `torch.compile` takes and that a step can keep exact. Checked before
    the model is compiled."""
    if options is None:
        return
    if not isinstance(options, dict):
        raise TypeError(f"{name} must be None or a dict of torch.compile's keyword arguments, e.g. "
                        f"{{'backend': 'aot_eager'}}, got {type(options).__name__} {options!r}. Nothing was changed")
    try:
        inspect.signature(torch.compile).bind(None, **options)
    except TypeError as err:
        keywords = ", ".join(list(inspect.signature(torch.compile).parameters)[1:])
        raise TypeError(f"{name} must hold keyword arguments of torch.compile ({keywords}), got {sorted(options)!r}: "
                        f"{err}. Nothing was changed") from err
    if options.get("fullgraph") and bn == "exact":
        raise ValueError(f"{name}={{'fullgraph': True}} makes each graph break an error, but bn='exact' needs one at "
                         "each BatchNorm call, where the micro-batches meet. Nothing was changed. Leave fullgraph "
                         "out (False), or pass bn='micro'")


def _check_objective(loss_fn: Any, forward_fn: Any, batch_loss_fn: Any, targets: Any) -> None:
    """Either loss_fn (a loss per micro-batch), or forward_fn and batch_loss_fn (one loss over the whole batch)."""
    whole = forward_fn is not None or batch_loss_fn is not None
    if whole and loss_fn is not None:
        raise TypeError("pass either loss_fn (the mean loss of each micro-batch) or forward_fn and batch_loss_fn "
                        "(one loss over the whole batch's outputs), not both")
    if whole:
        for name, fn, call in (("forward_fn", forward_fn, "forward_fn(model, micro_batch)"),
                               ("batch_loss_fn", batch_loss_fn, "batch_loss_fn(outputs, targets)")):
            if not callable(fn):
                raise TypeError(f"{name} must be callable as {call} (forward_fn and batch_loss_fn go together), "
                                f"got {type(fn).__name__}")
        return
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(model, micro_batch), got {type(loss_fn).__name__}")
    if targets is not None:
        raise TypeError("targets go to batch_loss_fn, with forward_fn: with loss_fn, put them in the batch")


def check_step_args(grad_scaler: Any, process_group: Any, whole_batch_loss: bool = False) -> None:
    """What only a step can check: its optional collaborators, and that it may build a graph at all."""
    if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
        raise TypeError(f"grad_scaler must be a torch.amp.GradScaler or None, got {type(grad_scaler).__name__} "
                        f"{grad_scaler!r}")
    if process_group is not None:
        from torch.distributed import ProcessGroup  # torch.distributed may be absent from a build

        if not isinstance(process_group, ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed.ProcessGroup or None, got "
                            f"{type(process_group).__name__} {process_group!r}")
        if whole_batch_loss:
            raise ValueError("batch_loss_fn with a process_group is not supported: the loss would need every "
                             "rank's outputs. Gather them in batch_loss_fn yourself, or use loss_fn")
    if torch.is_inference_mode_enabled():
        raise ValueError("accumnorm.backward computes gradients: it cannot run under torch.inference_mode()")
    if not torch.is_grad_enabled():
        raise ValueError("accumnorm.backward computes gradients: it cannot run under torch.no_grad(); "
                         "call it where grad mode is on")


def split(batch: Batch, size: int) -> tuple[list[Any], list[int]]:
    """Cut a batch into micro-batches of `size` samples: a Tensor along dim 0, or a tuple/list/namedtuple/dict whose
    fields are Tensors (cut along dim 0) or lists of per-sample items (cut as lists), all of one length."""
    if isinstance(batch, Tensor):
        leaves, rebuild = [("batch", batch)], lambda parts: parts[0]
    elif isinstance(batch, Mapping):
        leaves = list(batch.items())
        rebuild = lambda parts: dict(zip(batch.keys(), parts))  # noqa: E731
    elif isinstance(batch, tuple) and hasattr(type(batch), "_fields"):  # a namedtuple takes its fields one by one
        leaves = [(f"batch.{name}", t) for name, t in zip(batch._fields, batch)]
        rebuild = lambda parts: type(batch)(*parts)  # noqa: E731
    elif isinstance(batch, (list, tuple)):
        leaves = [(f"batch[{i}]", t) for i, t in enumerate(batch)]
        rebuild = lambda parts: type(batch)(parts)  # noqa: E731
    else:
        raise TypeError(f"batch must be a Tensor or a tuple/list/dict of Tensors, got {type(batch).__name__}")
    if not leaves:
        raise ValueError("batch is empty: expected at least one tensor")
    for name, t in leaves:
        if not isinstance(t, (Tensor, list)):
            raise TypeError(f"{name} must be a Tensor or a list of per-sample items, got {type(t).__name__}")
        if isinstance(t, Tensor) and t.dim() == 0:
            raise ValueError(f"{name} is a 0-dim tensor: expected a batch dimension 0")
    lengths = {name: len(t) for name, t in leaves}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"batch fields must share their length (dim 0 of a tensor, len of a list), got lengths "
                         f"{lengths}")
    n = len(leaves[0][1])
    if n == 0:
        raise ValueError("batch is empty: dimension 0 has length 0")
    chunks = [t.split(size) if isinstance(t, Tensor) else [t[i:i + size] for i in range(0, n, size)]
              for _, t in leaves]
    return [rebuild(list(parts)) for parts in zip(*chunks)], [min(size, n - i) for i in range(0, n, size)]
