"""The check that an optimizer steps the model whose gradients accumnorm computes (Trainer and integrations)."""
from __future__ import annotations

from torch import nn
from torch.optim import Optimizer

__all__ = ["check_optimizer"]


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
