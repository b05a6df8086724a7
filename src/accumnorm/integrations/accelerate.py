"""Exact BatchNorm under gradient accumulation in a Hugging Face Accelerate training loop.

    from accumnorm.integrations.accelerate import ExactAccumulator

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    exact = ExactAccumulator(accelerator, model, optimizer, loss_fn, micro_batch_size=8)   # checks the set-up
    for batch in loader:                                   # the batch of one optimizer step (per process)
        optimizer.zero_grad()
        loss = exact.backward(batch)                       # was: accelerator.backward(loss_fn(model, batch))
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

`backward` runs the batch through `accumnorm.backward` in micro-batches, which adds to `.grad` the
gradient of the whole batch's mean loss, BatchNorm statistics of the whole batch included, and returns
that loss. The rest is the Accelerator's: it placed the model and the loader's batches on its device;
its mixed precision autocasts the model's forward and, under fp16, its GradScaler scales the loss here
while `clip_grad_norm_` and the prepared optimizer's `step` unscale, clip and skip steps that overflow;
`save_state`/`load_state` checkpoint as usual (after `accelerator.register_for_checkpointing(exact)`, with
what the recompute schedule measured of the model, so that a resumed run steps bit for bit as one that never
stopped). On several processes, `prepare` wraps the model in DDP:
accumnorm runs the forwards on the module inside and reduces statistics and gradients over the DDP
model's process group itself, so the wrapper's own reducer is never armed (forward through the wrapped
model only under `torch.no_grad()`, e.g. to evaluate).

`Accelerator(dynamo_backend=...)` on one process compiles the model `prepare` returns, and the steps stay
exact: dynamo breaks its graph at each BatchNorm call.

`ExactAccumulator(...)` refuses, before any step and saying what to change, what would train wrongly:
`Accelerator(gradient_accumulation_steps=...)` (plain accumulation), an optimizer that `prepare` has
not seen or that steps other tensors, set-ups other than one process or DDP (FSDP, DeepSpeed), a
compiled DDP wrapper (`dynamo_backend` on several processes: accumnorm runs a DDP model as its inner
module, which the compiled wrapper hides), and arguments that `accumnorm.backward` would refuse.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from .._dist import map_batch
from .._engine.args import Batch, BNMode, Schedule
from .._engine.backward import backward
from .._engine.checkpointing.measurements import load_measurements, measurements
from .._engine.step.objective import LossFn
from .._optimizer import check_optimizer
from ._checks import backward_options

try:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import DistributedType
except ImportError as err:  # an optional integration: the core needs only torch
    raise ImportError("accumnorm.integrations.accelerate needs Accelerate: "
                      "pip install 'accumnorm[accelerate]'") from err

__all__ = ["ExactAccumulator"]


class ExactAccumulator:
    """The whole batch's exact gradient for an `accelerate.Accelerator` loop, `micro_batch_size` samples at a time.

    Args:
        accelerator: the Accelerator that prepared `model` and `optimizer`.
        model: the model as `accelerator.prepare` returned it (DDP-wrapped on several processes).
        optimizer: the optimizer as `accelerator.prepare` returned it, stepping the model's parameters.
        loss_fn: `loss_fn(model, micro_batch)` returns the mean loss of a micro-batch.
        micro_batch_size: samples per micro-batch; the batch given to `backward` (per process) is the
            batch of one optimizer step, and its last micro-batch may be smaller.
        bn: "exact" (every BatchNorm call sees the whole batch, across processes) or "micro"
            (per-micro-batch statistics: plain accumulation, the baseline).
        schedule, store, memory_budget, keep_every: how exact mode runs, as for `accumnorm.backward`.

    Shape:
        - batch: a Tensor or a tuple/list/dict of Tensors sharing dim 0 (the samples), as
          `accumnorm.backward` takes it.

    Examples::

        >>> accelerator = Accelerator(mixed_precision="bf16")
        >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        >>> loss_fn = lambda model, batch: F.cross_entropy(model(batch[0]), batch[1])
        >>> exact = ExactAccumulator(accelerator, model, optimizer, loss_fn, micro_batch_size=8)
        >>> for batch in loader:
        ...     optimizer.zero_grad()
        ...     loss = exact.backward(batch)
        ...     accelerator.clip_grad_norm_(model.parameters(), 1.0)
        ...     optimizer.step()
    """

    def __init__(self, accelerator: Accelerator, model: nn.Module, optimizer: AcceleratedOptimizer, loss_fn: LossFn,
                 *, micro_batch_size: int, bn: BNMode = "exact", schedule: Schedule = "auto",
                 store: str | torch.device | None = None, memory_budget: int | None = None,
                 keep_every: int | None = None) -> None:
        self.options = backward_options(model, loss_fn, micro_batch_size=micro_batch_size, bn=bn, schedule=schedule,
                                        store=store, memory_budget=memory_budget, keep_every=keep_every)
        steps = accelerator.gradient_accumulation_steps
        if steps != 1:
            raise ValueError(
                f"Accelerator(gradient_accumulation_steps={steps}) accumulates with each batch's own BatchNorm "
                f"statistics; leave it at 1 and give backward the batch of a whole optimizer step ({steps}x the "
                f"loader's batch_size), which it splits into micro-batches of micro_batch_size={micro_batch_size}")
        if isinstance(getattr(model, "_orig_mod", None), DistributedDataParallel):
            raise ValueError("the model is a torch.compile'd DDP wrapper (Accelerator(dynamo_backend=...) on several "
                             "processes): accumnorm runs a DDP model as its inner module, reducing statistics and "
                             "gradients itself, which the compiled wrapper hides, and the wrapper's reducer would wait "
                             "for a backward of its own. Nothing was changed. Prepare the model with "
                             "dynamo_backend='no', or train on one process")
        if not isinstance(model, DistributedDataParallel) and accelerator.distributed_type != DistributedType.NO:
            raise ValueError(f"ExactAccumulator runs on one process or on DDP processes (multi-GPU, multi-CPU), "
                             f"got distributed_type={accelerator.distributed_type.value} with a "
                             f"{type(model).__name__} model; on several processes pass the model that "
                             "accelerator.prepare returned")
        if not isinstance(optimizer, AcceleratedOptimizer):
            raise ValueError(f"the optimizer ({type(optimizer).__name__}) did not go through accelerator.prepare, "
                             "whose optimizer unscales and steps through the GradScaler under fp16; pass the one "
                             "accelerator.prepare returned")
        inner = model.module if isinstance(model, DistributedDataParallel) else model
        check_optimizer(optimizer.optimizer, inner, "prepare an optimizer over model.parameters()")
        self.accelerator, self.model, self.loss_fn = accelerator, model, loss_fn

    def backward(self, batch: Batch) -> Tensor:
        """Add the gradient of the mean loss over `batch` (this process's share) to `.grad`; return that
        loss over the whole (global) batch, detached. On any error nothing is changed."""
        batch = map_batch(lambda t: t.to(self.accelerator.device), batch)
        # A DDP model is unwrapped by accumnorm.backward, which then reduces over its process group.
        return backward(self.model, batch, self.loss_fn, grad_scaler=self.accelerator.scaler, **self.options)

    def state_dict(self) -> dict[str, Any]:
        """What the recompute schedule measured of the model (`checkpointing.measurements`), for
        `accelerator.register_for_checkpointing(exact)`: a run resumed by `load_state` then steps bit for bit as one
        that never stopped."""
        return measurements(self.model)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` gave, checked first."""
        load_measurements(self.model, state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.options.items())})"
