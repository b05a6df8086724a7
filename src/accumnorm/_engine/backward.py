"""`accumnorm.backward`: gradient accumulation that is exact for BatchNorm, and for losses over the whole batch.

Plain accumulation runs K micro-batches through the model and adds up their gradients. That is the
gradient of the whole batch for every layer but BatchNorm, which normalizes each micro-batch with its
own statistics, and for every loss that is a mean over samples, unlike a contrastive one.
`backward(..., bn="exact")` gives every batch-norm call the statistics and backward sums of the whole
batch; `forward_fn` and `batch_loss_fn` take the loss once, over the whole batch's outputs. This module
checks the arguments and runs the step as a transaction (`step.lifecycle`): on any error, `.grad`, every
buffer and the caller's random state are as they were.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from .._dist import Collectives, unwrap_ddp
from .args import Batch, BNMode, Schedule, check_args, check_schedule_options, check_step_args, split
from .lazy_eps import warn_large_eps
from .memory.budget import check_budget_fits_passes, default_budget, model_device
from .memory.heap import ResidentBound
from .memory.store import store_for
from .safety import untraced
from .safety.tree import module_names
from .schedules.decide import refuse_before_step, run_step
from .step.lifecycle import run_in_transaction, step_running
from .step.objective import BatchLoss, BatchLossFn, ForwardFn, LossFn, MicroBatchLoss
from .step.step import StepCall

__all__ = ["backward"]


@untraced.skip_frames
def backward(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn | None = None,
    *,
    micro_batch_size: int,
    forward_fn: ForwardFn | None = None,
    batch_loss_fn: BatchLossFn | None = None,
    targets: Any = None,
    bn: BNMode = "exact",
    schedule: Schedule = "auto",
    store: str | torch.device | None = None,
    process_group: Any = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    memory_budget: int | None = None,
    keep_every: int | None = None,
) -> Tensor:
    """Accumulate into `.grad` the gradient of the loss over `batch`, running the model one micro-batch at a time.

    Two forms. A loss per micro-batch, the common case: ``backward(model, batch, loss_fn, micro_batch_size=4)``
    with ``loss_fn(model, micro_batch)`` the mean loss over a micro-batch; the whole batch's loss is their
    mean over samples. A loss over the whole batch, for losses that couple its samples (contrastive, divided
    by a count over the batch): ``backward(model, batch, micro_batch_size=4, forward_fn=f, batch_loss_fn=L)``
    with ``f(model, micro_batch)`` a micro-batch's outputs and ``L(outputs, targets)`` the loss of the whole
    batch's outputs, each tensor of them concatenated along dim 0 over the micro-batches.

    Args:
        model: the module.
        batch: a Tensor, or a tuple/list/namedtuple/dict whose fields are Tensors (cut along dim 0) or lists of
            per-sample items (cut as lists), all of one length: cut into micro-batches of `micro_batch_size`
            (the last may be smaller; every sample weighs the same).
        loss_fn: ``loss_fn(model, micro_batch)``, the mean loss over a micro-batch, called once per micro-batch. A
            backward inside it that reaches a BatchNorm call or the parameters before the step's own is refused
            (it has no whole-batch meaning, or would count once per micro-batch).
        micro_batch_size: samples per micro-batch.
        forward_fn: ``forward_fn(model, micro_batch)``, a micro-batch's outputs: a Tensor, or tuples, lists,
            namedtuples and dicts of them, each tensor with one row per sample (dim 0 of the micro-batch's size,
            checked: stack two views along dim 1). Instead of `loss_fn`, with `batch_loss_fn`.
        batch_loss_fn: ``batch_loss_fn(outputs, targets)``, the loss of the whole batch's outputs.
        targets: passed whole, never cut, to `batch_loss_fn` (boxes of a detection batch, labels). Default: None.
        bn: "exact": every batch-norm call that uses batch statistics (torch's BatchNorm layers and their
            subclasses, SyncBatchNorm, accumnorm's, direct `F.batch_norm` calls) sees the whole batch, as if it
            went through at once, and running statistics are updated once per call (InstanceNorm's too).
            "micro": each micro-batch uses its own statistics, as plain accumulation does. Default: "exact".
        schedule: how exact mode runs. "layerwise": the micro-batches' forwards in lockstep on this thread,
            meeting at each BatchNorm call; about the cost of plain accumulation, keeping the whole batch's
            saved tensors in `store`. "recompute": layerwise with the model cut into checkpointed regions
            (as ``torch.utils.checkpoint`` would, made exact): it keeps the regions' inputs of the whole batch and the
            outputs of their costliest convolutions, and recomputes the rest in the backward, at most one
            forward more (see docs/schedules.md). "segments": as recompute, but each region's backward
            recomputes one micro-batch at a time (in the passes schedule's passes, over the region alone), so
            that it never holds a region's recomputation for the whole batch; with `keep_every`, it also lets
            go of regions' arguments it can recompute; on the CPU it hands the heap's free memory back to the
            OS after each region. "passes": 2L + 1 passes for L BatchNorm calls, the memory of one
            micro-batch. "auto": the first of layerwise, recompute, segments (at keep_every 1, 2,
            then 4) and passes whose memory fits `memory_budget`, judged from this model's figures (measured at
            its first step, which runs metered and stops before it passes the budget); on CUDA, an
            out-of-memory error sends the step to the next one too. `accumnorm.last_schedule(model)` tells
            which ran, at which setting, and why; a warning says so the first time a model leaves layerwise.
            Default: "auto".
        store: where layerwise keeps the whole batch's saved tensors: None (the model's device on CPU, pinned
            host memory on CUDA), "cpu", or a torch.device. Default: None.
        process_group: with torch.distributed, `batch` is this rank's share of the global batch: statistics,
            sums, loss and gradients are reduced over the group (do not wrap the model in DDP as well; a
            DDP-wrapped model is unwrapped and its group used). Not with `batch_loss_fn`. Default: None.
        grad_scaler: a `torch.amp.GradScaler`: the loss is scaled by it before backward. Default: None.
        memory_budget: the bytes "auto" lets a step keep for its backward: the tensors its forward keeps (autograd's
            saved tensors, the regions' arguments), at a met BatchNorm call the whole batch's input and output there,
            what its backward's recomputation holds, and the gradients the step makes; gradients that exist before the
            step (``zero_grad(set_to_none=False)``) are not part of it. A positive int. A budget below what even passes
            keeps (the gradients and one micro-batch's pass) is refused with a ValueError naming both, nothing changed:
            at a model's first step once passes' meter counts past it, at later steps before anything runs. The
            process's peak rises above it by the working memory of the forward and the backward and what the allocator
            keeps of what it freed; on the CPU, the step hands the heap's free pages back once it has added four fifths
            of it (docs/schedules.md). A process's first step also makes what the process keeps for its life (torch's
            code paged in, kernels for the model's shapes), past the budget: leave room for it. A schedule asked for by
            name keeps what it keeps, whatever the budget (which must still hold the gradients): there the budget only
            says when the heap's pages go back. Default: None, a tenth less than the free memory of the model's device
            (on the CPU, the available memory the kernel reports).
        keep_every: the segments schedule's setting (with schedule="segments" only). Where regions form a chain,
            each one's output the next one's argument, the arguments of one region in `keep_every` are kept; the
            others are recomputed in the backward from the last kept ones, a region forward more for each region
            between (less memory, more time); 1 keeps them all. Default: None, which is 2.

    Returns:
        The whole batch's loss, detached. On any error (an exception in your functions, a non-finite loss, a
        KeyboardInterrupt), nothing is changed.

    .. warning::
        Under the layerwise schedule each micro-batch's forward runs once, interleaved with the others at every
        BatchNorm call; under passes 2L + 1 times; with a whole-batch loss and one micro-batch at a time (plain,
        `bn="micro"`), twice. Your functions should depend on their arguments only: a tensor one micro-batch
        leaves in shared Python state (a hook's stash, a module attribute, a global) and another uses is refused,
        but a value without autograd history (a counter, a flag, a ``threading.local``) read after a BatchNorm call
        may be another micro-batch's (docs/exact-covers.md). Every micro-batch draws its
        random numbers from a stream of its own, the same in every run of it and under every schedule; what the
        step draws outside them (in its backward, in batch_loss_fn) from one of the step's own; the
        caller's generators advance by one draw per step, whatever the split. torch's generators are
        process-wide: a draw another thread makes while a micro-batch's forward runs (between two of its
        BatchNorm calls) comes from that micro-batch's stream, so steps on several threads at once, each with
        random numbers of its own, are not reproducible. Another thread's draws are rarely repeated: passes and
        recompute replay a micro-batch's stream, and a draw during a replay, or one that lands in the instant of a
        stream swap, may repeat a value; and a replay then draws other numbers than the forward did (another
        dropout mask): passes refuses the step, recompute and segments run it under layerwise, and a
        checkpoint of your own is not exact, as in torch. Give such threads a ``torch.Generator`` of their own.
        A step cannot run inside another's `loss_fn`; a step on another thread can.

    .. warning::
        The recompute schedule (which "auto" may choose) runs each checkpointed region's forward again in the
        backward, as ``torch.utils.checkpoint`` does: forward hooks and side effects of the modules inside a
        region run twice, once in the forward and once in the backward. A region whose forward changes its
        modules' attributes or buffers is found before the backward and the step runs under layerwise instead,
        with a warning; random numbers are replayed (``preserve_rng_state``).

    .. note::
        Python's cyclic garbage collector is off while a step's forwards and backward run, on any thread; once no
        step's are running it is back as it was, before the step commits. The step's own objects go by reference
        count, and a collection during it would walk every object in the process for nothing. Reference cycles your
        functions make during the step are collected after it.

    Example::

        optimizer.zero_grad()
        loss = accumnorm.backward(model, (x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]), micro_batch_size=4)
        optimizer.step()
    """
    untraced.prepare()  # what torch.compile'd code must not trace, once dynamo is imported
    # Called from code torch.compile traces (a training step compiled whole), the step runs untraced: the graph
    # breaks at this call, and dynamo compiles none of the step's own frames.
    return untraced.call(_backward)(model, batch, loss_fn, micro_batch_size=micro_batch_size, forward_fn=forward_fn,
                                    batch_loss_fn=batch_loss_fn, targets=targets, bn=bn, schedule=schedule, store=store,
                                    process_group=process_group, grad_scaler=grad_scaler, memory_budget=memory_budget,
                                    keep_every=keep_every)


@untraced.untraced
def _backward(model: nn.Module, batch: Batch, loss_fn: LossFn | None, *, micro_batch_size: int,
              forward_fn: ForwardFn | None, batch_loss_fn: BatchLossFn | None, targets: Any, bn: BNMode,
              schedule: Schedule, store: str | torch.device | None, process_group: Any,
              grad_scaler: torch.amp.GradScaler | None, memory_budget: int | None, keep_every: int | None) -> Tensor:
    """`backward`'s step, run untraced."""
    if step_running():
        raise ValueError(
            "accumnorm.backward was called inside another accumnorm.backward step (from its loss_fn, forward_fn, "
            "batch_loss_fn or a hook): steps cannot be nested. Run the inner step before or after the outer one, or "
            "make its model part of the outer step's loss")
    model, process_group = unwrap_ddp(model, process_group)
    check_args(model, loss_fn, micro_batch_size, bn, schedule, forward_fn=forward_fn, batch_loss_fn=batch_loss_fn,
               targets=targets)
    check_step_args(grad_scaler, process_group, whole_batch_loss=batch_loss_fn is not None)
    store_device = check_schedule_options(schedule, store, memory_budget, keep_every)
    micro_batches, sizes = split(batch, micro_batch_size)
    device = model_device(model)
    if memory_budget is not None:
        check_budget_fits_passes(model, memory_budget, micro_batches[0], sum(sizes),
                                 measured=schedule == "auto" and bn == "exact" and process_group is None)
    collectives = Collectives(process_group)
    if batch_loss_fn is not None:
        objective = BatchLoss(forward_fn, batch_loss_fn, targets, grad_scaler, sizes)
        objective.check_targets()
    else:
        total = sum(sizes)
        if process_group is not None:  # every sample of the global batch weighs the same
            total = int(collectives.sum_(torch.tensor(total, device=device)).item())
        objective = MicroBatchLoss(loss_fn, [n / total for n in sizes], grad_scaler)
    # Even one micro-batch goes through the exact schedule: inside a checkpointed region, torch's own BatchNorm
    # would update the running statistics a second time in the recomputation.
    exact = bn == "exact"
    names = module_names(model)  # every module, once: what the refusals and the transaction walk over
    if exact:
        refuse_before_step(model, names, schedule)
    store_hooks = store_for(store_device, device)
    budget = memory_budget if memory_budget is not None or schedule != "auto" else default_budget(device)
    bound = ResidentBound(budget, device)  # from the resident memory before the step
    warn_large_eps(model, names)
    settings = _settings(keep_every=keep_every)
    # Nothing but the return after it: the step's own ending (this thread's flag, the recursion limit) is inside it,
    # before the last moment a Ctrl-C can still undo the step.
    return run_in_transaction(StepCall(model, micro_batches, objective, collectives, exact, bound), names,
                              lambda new_step, start_over: run_step(new_step, schedule, store_hooks, start_over,
                                                                    sum(sizes), budget, settings))


def _settings(**settings: Any) -> dict[str, Any]:
    """The schedule's settings given (those not None)."""
    return {name: value for name, value in settings.items() if value is not None}
