"""The optimizer beside the model whose gradients accumnorm computes (Trainer and integrations): the check that it
steps that model, the tensors a step gives gradients to, and those gradients set aside for a step."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from torch import Tensor, nn
from torch.optim import Optimizer

__all__ = ["check_optimizer", "gradients_set_aside", "stepped_tensors"]


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


def stepped_tensors(model: nn.Module, optimizers: Iterable[Optimizer]) -> list[Tensor]:
    """The tensors a step gives gradients to: the model's parameters, and the optimizers' tensors beside them (a
    learnable temperature of the loss), once each, the model's first."""
    tensors = {id(p): p for p in model.parameters()}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            tensors.update((id(p), p) for p in group["params"] if id(p) not in tensors)
    return list(tensors.values())


@contextmanager
def gradients_set_aside(tensors: list[Tensor], keep: bool) -> Iterator[None]:
    """Run the block from no gradient on `tensors`; put back the gradients they had if the block fails, and when it
    ends unless `keep` (the block's gradients are the step's)."""
    before = [t.grad for t in tensors]
    for t in tensors:
        t.grad = None
    try:
        yield
    except BaseException:
        keep = False
        raise
    finally:
        if not keep:
            for t, grad in zip(tensors, before):
                t.grad = grad
