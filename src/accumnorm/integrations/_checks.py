"""Set-up checks that the Lightning and Accelerate integrations share: each raises before any step."""
from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim import Optimizer

from ..accumulation import BN_MODES

__all__ = ["check_options", "check_optimizer"]


def check_options(micro_batch_size: Any, bn: Any) -> None:
    """The arguments that every step passes to `accumnorm.backward`, checked as it checks them, but once, at
    set-up: a wrong one fails before the framework starts rather than at the first step."""
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int):
        raise TypeError(f"micro_batch_size must be an int, got {type(micro_batch_size).__name__} {micro_batch_size!r}")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if bn not in BN_MODES:
        raise ValueError(f"bn must be one of {BN_MODES}, got {bn!r}")


def check_optimizer(optimizer: Optimizer, model: nn.Module, hint: str) -> None:
    """The optimizer must step this model's parameters: `accumnorm.backward` writes gradients to them only.

    `hint` says, in the framework's terms, how to hand over the right optimizer.
    """
    own = {id(p) for p in model.parameters()}
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = sum(id(p) not in own for p in stepped)
    if stepped and not foreign:
        return
    problem = (f"steps {len(stepped)} tensors, {foreign} of them not parameters of {type(model).__name__}" if stepped
               else "steps no tensor at all")
    raise ValueError(f"the optimizer ({type(optimizer).__name__}) {problem}: accumnorm computes gradients only for "
                     f"the model's own parameters, so nothing else would train; {hint}")
