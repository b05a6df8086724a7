"""Every batch-norm call that normalizes with batch statistics, whoever makes it.

torch's BatchNorm1d/2d/3d, SyncBatchNorm without a process group, subclasses such as timm's
`BatchNormAct2d`, accumnorm's layers and plain user code all end in
`F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)`. Under a
`torch.overrides.TorchFunctionMode` that call reaches the mode before it runs, so exact mode needs
no conversion of the model: `BatchNormCalls` hands each `training=True` call, as a `BNCall`, to the
schedule of the step, which returns the output. Everything else runs untouched.

Running statistics are the schedule's business too: a module's forward runs once per micro-batch
(more under the passes schedule) and would bump `num_batches_tracked` each time, so the step
records the calls and `update_running_stats` applies one update per call at the end, as torch's
forward over the whole batch would.
"""
from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode

from .functional import Moments

__all__ = ["BNCall", "BatchNormCalls", "batch_norm_modules", "sync_batch_norm_as_local", "update_running_stats"]

_BATCH_NORM_ARGS = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")


@dataclass
class BNCall:
    """One `F.batch_norm(..., training=True)` call: its arguments, and the module that owns its buffers."""

    input: Tensor
    running_mean: Tensor | None
    running_var: Tensor | None
    weight: Tensor | None
    bias: Tensor | None
    momentum: float | None
    eps: float
    module: _BatchNorm | None = None  # None for a direct F.batch_norm call on buffers of no BN module
    stats: Moments | None = field(default=None, repr=False)  # whole-batch moments, once the schedule has them

    def same_layer(self, other: BNCall) -> bool:
        """Whether two micro-batches' calls are the same call of the forward (same tensors, same channels)."""
        return (self.weight is other.weight and self.running_mean is other.running_mean
                and self.input.shape[1] == other.input.shape[1])

    def describe(self) -> str:
        owner = type(self.module).__name__ if self.module is not None else "F.batch_norm"
        return f"{owner} over {self.input.shape[1]} channels"


class BatchNormCalls(TorchFunctionMode):
    """A TorchFunctionMode that sends every training-mode `F.batch_norm` call to `handler(BNCall) -> Tensor`.

    `owners` maps `id(running_mean)` to the BN module holding it, so that a call can be tied to its
    module's momentum and `num_batches_tracked`.
    """

    def __init__(self, handler: Callable[[BNCall], Tensor], owners: dict[int, _BatchNorm]) -> None:
        super().__init__()
        self.handler, self.owners = handler, owners

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: A002 - torch's signature
        kwargs = kwargs or {}
        if func is F.batch_norm:
            bound = dict(zip(_BATCH_NORM_ARGS, args), **kwargs)
            if bound.get("training", False):
                rm = bound.get("running_mean")
                return self.handler(BNCall(
                    bound["input"], rm, bound.get("running_var"), bound.get("weight"), bound.get("bias"),
                    bound.get("momentum", 0.1), bound.get("eps", 1e-5),
                    self.owners.get(id(rm)) if rm is not None else None,
                ))
        return func(*args, **kwargs)


def batch_norm_modules(model: nn.Module) -> list[_BatchNorm]:
    """Every torch BatchNorm module of the model (accumnorm's, torch's, SyncBatchNorm, subclasses)."""
    return [m for m in model.modules() if isinstance(m, _BatchNorm)]


@contextmanager
def sync_batch_norm_as_local(modules: list[_BatchNorm]) -> Iterator[None]:
    """Run SyncBatchNorm layers as plain BatchNorm for the step: the schedule reduces over micro-batches and ranks.

    NOTE: SyncBatchNorm under an initialized process group would call its own collective kernel, which
    neither sees the other micro-batches nor runs on CPU; its `_BatchNorm.forward` path ends in
    F.batch_norm, which the step intercepts.
    """
    syncs = [m for m in modules if isinstance(m, nn.SyncBatchNorm)]
    for m in syncs:
        m.forward = types.MethodType(_BatchNorm.forward, m)
    try:
        yield
    finally:
        for m in syncs:
            del m.forward


def update_running_stats(calls: list[BNCall], tracked_before: dict[_BatchNorm, Tensor]) -> None:
    """One running-statistics update per call, in forward order, as torch's whole-batch forward makes them.

    `tracked_before` holds each module's `num_batches_tracked` from before the step: the micro-batch
    forwards bumped it once per pass, whole-batch torch bumps it once per call.
    """
    calls_so_far: dict[_BatchNorm, int] = {}
    for call in calls:
        m = call.module
        factor = call.momentum
        if m is not None and m.num_batches_tracked is not None:
            calls_so_far[m] = calls_so_far.get(m, 0) + 1
            if m.momentum is None:  # cumulative average over the calls so far, as torch's forward computes it
                factor = 1.0 / float(tracked_before[m] + calls_so_far[m])
        if call.running_mean is None or call.running_var is None:
            continue
        n = call.stats.count
        with torch.no_grad():
            call.running_mean.mul_(1 - factor).add_(call.stats.mean.to(call.running_mean.dtype), alpha=factor)
            call.running_var.mul_(1 - factor).add_((call.stats.m2 / (n - 1)).to(call.running_var.dtype), alpha=factor)
    with torch.no_grad():
        for m, before in tracked_before.items():
            m.num_batches_tracked.copy_(before + calls_so_far.get(m, 0))
