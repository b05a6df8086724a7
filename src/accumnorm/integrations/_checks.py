"""Set-up checks that the Lightning and Accelerate integrations share: each raises before any step."""
from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim import Optimizer

from .._engine.args import check_args
from .._engine.objective import LossFn
from .._engine.store import resolve_store

__all__ = ["backward_options", "check_optimizer"]


def backward_options(model: nn.Module, loss_fn: LossFn, *, micro_batch_size: Any, bn: Any, schedule: Any,
                     store: Any) -> dict[str, Any]:
    """The keyword arguments every step passes to `accumnorm.backward`, checked as it checks them but once, at
    set-up: a wrong one fails before the framework starts instead of at the first step."""
    check_args(model, loss_fn, micro_batch_size, bn, schedule)
    resolve_store(store)
    return dict(micro_batch_size=micro_batch_size, bn=bn, schedule=schedule, store=store)


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
