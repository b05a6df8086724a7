"""A step as a transaction: whatever ends it early, the model's gradients and buffers are as they were.

The step writes its gradients to fresh `.grad` tensors, the caller's set aside; buffers (running
statistics, counters) are copied before it starts. `commit` adds the caller's gradients back, out of
place, so that until `backward` returns the old ones are intact and `rollback` can still restore them,
even when an interrupt arrives in the middle of the merge.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn.parameter import is_lazy

__all__ = ["Transaction"]


class Transaction:
    """What a step may change in `model`: every parameter's `.grad` and every buffer (module doc)."""

    def __init__(self, model: nn.Module) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.grads: list[Tensor | None] = [p.grad for p in self.params]
        # (module, name, the buffer object, a copy of its values): a forward may change a buffer in place or
        # replace it by another tensor; both are undone.
        self.buffers = [(m, name, b, b.clone()) for m in model.modules() for name, b in m._buffers.items()
                        if b is not None and not is_lazy(b)]

    def begin(self) -> None:
        """Set the caller's gradients aside: the step accumulates into fresh ones."""
        for p in self.params:
            p.grad = None

    def commit(self) -> None:
        """Add the caller's gradients to the step's, each as a new tensor (the old ones stay intact)."""
        for p, old in zip(self.params, self.grads):
            if old is not None:
                p.grad = old if p.grad is None else old + p.grad

    def rollback(self) -> None:
        """The gradients and buffers as they were before the step."""
        for p, old in zip(self.params, self.grads):
            p.grad = old
        with torch.no_grad():
            for m, name, b, saved in self.buffers:
                m._buffers[name] = b
                b.copy_(saved)
