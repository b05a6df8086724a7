"""Set-up checks that the integrations share: each raises before any step."""
from __future__ import annotations

from typing import Any

from torch import nn

from .._engine.args import check_args
from .._engine.memory.store import resolve_store
from .._engine.step.objective import LossFn

__all__ = ["backward_options", "refuse_compiled"]


def backward_options(model: nn.Module, loss_fn: LossFn, *, micro_batch_size: Any, bn: Any, schedule: Any,
                     store: Any) -> dict[str, Any]:
    """The keyword arguments every step passes to `accumnorm.backward`, checked as it checks them but once, at
    set-up: a wrong one fails before the framework starts instead of at the first step."""
    check_args(model, loss_fn, micro_batch_size, bn, schedule)
    resolve_store(store)
    return dict(micro_batch_size=micro_batch_size, bn=bn, schedule=schedule, store=store)


def refuse_compiled(model: nn.Module, remedy: str) -> None:
    """A torch.compile'd model (its wrapper, or `module.compile()`) hides its BatchNorm calls from accumnorm, which
    refuses it at its first step; the integrations refuse it at set-up, in their framework's terms (`remedy`)."""
    for name, module in model.named_modules():
        if type(module).__name__ == "OptimizedModule" or vars(module).get("_compiled_call_impl") is not None:
            where = f"its submodule {name}" if name else "it"
            raise ValueError(f"the model ({type(model).__name__}) is compiled ({where}): accumnorm cannot see the "
                             f"BatchNorm calls inside a torch.compile'd graph; {remedy}")
