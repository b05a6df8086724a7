"""What a step minimizes: a loss per micro-batch (`loss_fn`), or one loss over the whole batch's outputs.

`MicroBatchLoss`: `loss_fn(model, micro_batch)` is the mean loss over a micro-batch, and the whole batch's is
their sample-weighted mean. `BatchLoss`: `forward_fn(model, micro_batch)` gives a micro-batch's outputs, and
`batch_loss_fn(outputs, targets)` the loss over the whole batch's outputs, for losses that couple the samples
of a batch (contrastive, normalized by a count over the batch). Both check what the user's functions return.
`Losses`: what a schedule leaves of them, and the whole batch's loss the step returns.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor
from torch.utils._pytree import keystr, tree_flatten_with_path

from ..._dist import Collectives

__all__ = ["LossFn", "ForwardFn", "BatchLossFn", "MicroBatchLoss", "BatchLoss", "Losses"]

LossFn = Callable[[nn.Module, Any], Tensor]
ForwardFn = Callable[[nn.Module, Any], Any]
BatchLossFn = Callable[[Any, Any], Tensor]


def _checked(loss: Any, what: str, where: str) -> Tensor:
    if not isinstance(loss, Tensor):
        hint = ": return the loss tensor itself (float(loss) and loss.item() cut it from the graph)" if isinstance(
            loss, (float, int)) else ""
        raise TypeError(f"{what} must return a scalar Tensor, got {type(loss).__name__}{where}{hint}")
    if loss.dim() != 0:
        raise ValueError(f"{what} must return a scalar (0-dim) Tensor, got shape {tuple(loss.shape)}{where}")
    if not loss.is_floating_point():
        raise TypeError(f"{what} must return a floating-point loss, got {loss.dtype}{where}")
    if not loss.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{what}'s loss{where} does not require grad: it is detached from the model's "
                         "parameters (a .detach(), .item(), or a forward under torch.no_grad)")
    return loss


def _scaled(loss: Tensor, grad_scaler: torch.amp.GradScaler | None) -> Tensor:
    """The loss to back-propagate: times the AMP scale, if any."""
    return grad_scaler.scale(loss) if grad_scaler is not None else loss


class MicroBatchLoss:
    """`loss_fn(model, micro_batch)`, the mean loss of each micro-batch, weighted by its share of the samples."""

    whole = False

    def __init__(self, loss_fn: LossFn, weights: list[float], grad_scaler: torch.amp.GradScaler | None) -> None:
        self.loss_fn, self.weights, self.grad_scaler = loss_fn, weights, grad_scaler

    def forward(self, model: nn.Module, micro_batch: Any, k: int) -> Tensor:
        return _checked(self.loss_fn(model, micro_batch), "loss_fn", f" for micro-batch {k}")

    def weighted(self, loss: Tensor, k: int) -> Tensor:
        """Micro-batch k's share of the whole-batch mean loss (times the AMP scale, if any)."""
        return _scaled(loss * self.weights[k], self.grad_scaler)


class BatchLoss:
    """`forward_fn(model, micro_batch)` for each micro-batch's outputs, `batch_loss_fn(outputs, targets)` once over
    all of them (concatenated along dim 0); `targets` is passed whole, never split."""

    whole = True

    def __init__(self, forward_fn: ForwardFn, batch_loss_fn: BatchLossFn, targets: Any,
                 grad_scaler: torch.amp.GradScaler | None, sizes: list[int]) -> None:
        self.forward_fn, self.batch_loss_fn, self.targets = forward_fn, batch_loss_fn, targets
        self.grad_scaler, self.sizes = grad_scaler, sizes  # sizes: samples per micro-batch

    def forward(self, model: nn.Module, micro_batch: Any, k: int) -> Any:
        """Micro-batch k's outputs, each tensor of them checked to hold one row per sample.

        The outputs are put together along dim 0, so rows of another count (two views concatenated along dim 0, a
        statistic of the micro-batch, per-box rows) would interleave across micro-batches where the whole batch's
        forward keeps them apart: refused, whatever batch_loss_fn would make of them.
        """
        outputs = self.forward_fn(model, micro_batch)
        n = self.sizes[k]
        for path, t in tree_flatten_with_path(outputs)[0]:
            if isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] != n:
                raise ValueError(
                    f"forward_fn's output {keystr(path) or 'the output'} has {t.shape[0]} rows (shape "
                    f"{tuple(t.shape)}) for micro-batch {k} of {n} samples: every output tensor needs one row per "
                    f"sample, dim 0 of size {n}, for the micro-batches' outputs to join into the whole batch's. Rows "
                    "of another count would interleave across micro-batches: stack two views along dim 1 (or return "
                    "them as two outputs), and return per-sample rows rather than a micro-batch's statistic")
        return outputs

    def check_targets(self) -> None:
        """Targets given as one tensor hold one row per sample (per-box targets go in a dict or list)."""
        num_samples = sum(self.sizes)
        if isinstance(self.targets, Tensor) and (self.targets.dim() == 0 or len(self.targets) != num_samples):
            rows = "a 0-dim tensor" if self.targets.dim() == 0 else f"{len(self.targets)} rows"
            raise ValueError(f"targets is {rows}, but the batch has {num_samples} samples: a targets tensor needs one "
                             "row per sample (targets of another length, such as boxes, go in a dict or a list)")

    def loss(self, outputs: Any) -> tuple[Tensor, Tensor]:
        """The whole batch's loss of its `outputs`, and the same times the AMP scale (what to back-propagate)."""
        loss = _checked(self.batch_loss_fn(outputs, self.targets), "batch_loss_fn", "")
        # Under a GradScaler an overflow is expected now and then: its inf/nan gradients make the scaler skip
        # the step and lower the scale, so only an unscaled run treats it as an error.
        if self.grad_scaler is None and not bool(torch.isfinite(loss)):
            raise ValueError(f"batch_loss_fn's loss is not finite ({loss.item()}); nothing was changed")
        return loss, _scaled(loss, self.grad_scaler)


class Losses:
    """The losses a schedule leaves: each micro-batch's, detached (`micro`), or the whole batch's (`whole`)."""

    def __init__(self, objective: MicroBatchLoss | BatchLoss, collectives: Collectives, num_micro_batches: int) -> None:
        self.objective, self.collectives = objective, collectives
        self.micro: list[Tensor | None] = [None] * num_micro_batches
        self.whole: Tensor | None = None

    def result(self) -> Tensor:
        """The whole batch's loss, detached; a non-finite micro-batch loss is an error unless a GradScaler will skip
        the step."""
        if self.whole is not None:
            return self.whole
        losses = torch.stack(self.micro)
        finite = torch.isfinite(losses)
        # Under a GradScaler an overflow is expected now and then: its inf/nan gradients make the
        # scaler skip the step and lower the scale, so only an unscaled run treats it as an error.
        if self.objective.grad_scaler is None and not bool(finite.all()):
            k = int((~finite).nonzero()[0])
            raise ValueError(f"loss is not finite ({losses[k].item()}) for micro-batch {k}; nothing was changed")
        weights = torch.tensor(self.objective.weights, dtype=losses.dtype, device=losses.device)
        with torch.autocast(losses.device.type, enabled=False):  # the caller's would sum them in bfloat16 or float16
            return self.collectives.sum_(losses @ weights)
