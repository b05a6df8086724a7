"""The check that an optimizer steps the model whose gradients accumnorm computes (Trainer and integrations)."""
from __future__ import annotations

from torch import nn
from torch.optim import Optimizer

__all__ = ["check_optimizer"]


def check_optimizer(optimizer: Optimizer, model: nn.Module, hint: str) -> None:
    """The optimizer must step this model's parameters, which `accumnorm.backward` writes gradients to: one over none
    of them (built for another model, or for a copy of this one) would train nothing of it. Tensors outside the model
    beside them (a learnable temperature of the loss) get their gradients as in torch, where the loss reaches them.

    `hint` says, in the framework's terms, how to hand over the right optimizer.
    """
    own = {id(p) for p in model.parameters()}
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = sum(id(p) not in own for p in stepped)
    if foreign < len(stepped):
        return
    problem = (f"steps {len(stepped)} tensors, {foreign} of them not parameters of {type(model).__name__}" if stepped
               else "steps no tensor at all")
    raise ValueError(f"the optimizer ({type(optimizer).__name__}) {problem}: accumnorm computes the gradients of the "
                     f"model's parameters, so it would train nothing of the model; {hint}")
