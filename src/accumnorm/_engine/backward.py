"""`accumnorm.backward`: gradient accumulation that is exact for BatchNorm.

Plain accumulation runs K micro-batches through the model and adds up their gradients. That is the
gradient of the whole batch for every layer but BatchNorm, which normalizes each micro-batch with its
own statistics. `backward(..., bn="exact")` gives every batch-norm call the statistics and backward
sums of the whole batch. This module checks the arguments, picks a schedule, and makes the call a
transaction: on any error, `.grad`, every buffer and the caller's random state are as they were.
"""
from __future__ import annotations

import threading
import types
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from ..distributed import Collectives, unwrap_ddp
from .args import Batch, BNMode, Schedule, check_args, check_step_args, split
from .interrupts import SigintDeferred
from .lockstep import layerwise
from .passes import passes
from .plain import plain
from .rng import StepRng
from .step import LossFn, Step
from .store import Store, resolve_store, store_for
from .threadstate import ThreadState
from .transaction import Transaction

__all__ = ["backward"]

# torch's default random generators are process-wide, and a step swaps each micro-batch's stream in and out of
# them: steps on several threads take turns, so that each gives what it would give alone.
_STEP_LOCK = threading.RLock()


def backward(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    *,
    micro_batch_size: int,
    bn: BNMode = "exact",
    schedule: Schedule = "auto",
    store: str | torch.device | None = None,
    process_group: Any = None,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> Tensor:
    """Accumulate into `.grad` the gradient of the mean loss over `batch`, one micro-batch at a time.

    Args:
        model: the module; `loss_fn(model, micro_batch)` returns the mean loss over a micro-batch.
        batch: a Tensor, or a tuple/list/namedtuple/dict of Tensors sharing dim 0, cut into micro-batches of
            `micro_batch_size` (the last may be smaller; every sample weighs the same).
        loss_fn: called once per micro-batch, as ``loss_fn(model, micro_batch)``.
        micro_batch_size: samples per micro-batch.
        bn: "exact": every batch-norm call that uses batch statistics (torch's BatchNorm layers and their
            subclasses, SyncBatchNorm, accumnorm's, direct `F.batch_norm` calls) sees the whole batch, as if it
            went through at once, and running statistics are updated once per call (InstanceNorm's too).
            "micro": each micro-batch uses its own statistics, as plain accumulation does. Default: "exact".
        schedule: how exact mode runs. "layerwise": the micro-batches' forwards in lockstep on this thread,
            meeting at each BatchNorm call; about the cost of plain accumulation, keeping the whole batch's
            saved tensors in `store`. "passes": 2L + 1 passes for L BatchNorm calls, the memory of one
            micro-batch. "auto": layerwise, or passes if layerwise runs out of memory. Default: "auto".
        store: where layerwise keeps the whole batch's saved tensors: None (the model's device on CPU, pinned
            host memory on CUDA), "cpu", or a torch.device. Default: None.
        process_group: with torch.distributed, `batch` is this rank's share of the global batch: statistics,
            sums, loss and gradients are reduced over the group (do not wrap the model in DDP as well; a
            DDP-wrapped model is unwrapped and its group used). Default: None.
        grad_scaler: a `torch.amp.GradScaler`: the loss is scaled by it before backward. Default: None.

    Returns:
        The whole-batch mean loss, detached. On any error (an exception in `loss_fn`, a non-finite loss, a
        KeyboardInterrupt), nothing is changed.

    .. warning::
        Each micro-batch's `loss_fn` runs once, but interleaved with the others at every BatchNorm call under
        the layerwise schedule, and 2L + 1 times under passes: it should depend on its arguments only. Every
        micro-batch draws its random numbers from a stream of its own, the same under every schedule; the
        caller's generators advance by one draw per step, whatever the split.

    Example::

        optimizer.zero_grad()
        loss = accumnorm.backward(model, (x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]), micro_batch_size=4)
        optimizer.step()
    """
    model, process_group = unwrap_ddp(model, process_group)
    check_args(model, loss_fn, micro_batch_size, bn, schedule)
    check_step_args(grad_scaler, process_group)
    store_device = resolve_store(store)
    micro_batches, sizes = split(batch, micro_batch_size)
    # One micro-batch on one process is the whole batch: torch's own BatchNorm is already exact.
    exact = bn == "exact" and not (len(micro_batches) == 1 and process_group is None)
    if exact:
        _refuse_unseen_batch_norms(model, "passes" if schedule == "passes" else "layerwise")
    collectives = Collectives(process_group)
    device = _device(model)
    total = sum(sizes)
    if process_group is not None:  # every sample of the global batch weighs the same
        total = int(collectives.sum_(torch.tensor(total, device=device)).item())
    weights = [n / total for n in sizes]

    with _STEP_LOCK:
        # Copies only, until the try: an interrupt before it changes nothing.
        caller = ThreadState.capture()
        transaction = Transaction(model)
        rng = StepRng(len(micro_batches), sorted({d.index for d in _cuda_devices(model)}))
        interrupts = SigintDeferred()
        try:
            interrupts.start()
            transaction.begin()
            rng.start()
            tracked_before = {m: m.num_batches_tracked.clone() for m in model.modules()
                              if isinstance(m, _BatchNorm) and m.num_batches_tracked is not None}

            def new_step() -> Step:
                return Step(model, micro_batches, weights, loss_fn, collectives, grad_scaler, rng, interrupts)

            with _sync_batch_norm_as_local(model) if exact else nullcontext():
                step = (_run_exact(new_step, schedule, store_for(store_device, device), transaction) if exact
                        else _run(plain, new_step()))
            loss = _whole_batch_loss(step, grad_scaler is not None)
            collectives.sum_grads_(transaction.params)
            if exact:
                _check_every_call_seen(step, tracked_before)
                step.update_running_stats(tracked_before)
            for m in model.modules():
                if hasattr(m, "accumnorm_step_end"):
                    m.accumnorm_step_end()
            transaction.commit()
            rng.close(failed=False)
            interrupts.close()  # a Ctrl-C that came during the step is raised here, and undoes it
        except BaseException:
            transaction.rollback()
            rng.close(failed=True)
            raise
        finally:
            try:
                interrupts.close()
            finally:  # whatever ended the step, the caller's thread is as it was: grad mode, autocast, modes, hooks
                caller.apply(ThreadState.capture())
    return loss


def _run(schedule: Callable[[Step], None], step: Step) -> Step:
    schedule(step)
    return step


def _run_exact(new_step: Callable[[], Step], schedule: str, store: Store | None, transaction: Transaction) -> Step:
    """The exact schedule asked for; under "auto", passes when layerwise runs out of memory."""
    if schedule == "passes":
        return _run(passes, new_step())
    try:
        return _run(lambda step: layerwise(step, store), new_step())
    except torch.OutOfMemoryError as e:
        if schedule == "layerwise":
            raise
        _refuse_unseen_batch_norms(new_step().model, "passes")
        transaction.rollback()
        transaction.begin()
        warnings.warn(f"accumnorm.backward: the layerwise schedule ran out of memory ({e}); using the passes "
                      "schedule, which holds one micro-batch at a time (store='cpu' may let layerwise fit)",
                      RuntimeWarning, stacklevel=4)
        return _run(passes, new_step())


def _refuse_unseen_batch_norms(model: nn.Module, schedule: str) -> None:
    """Refuse, before anything runs, the layers whose batch statistics no schedule could see or make exact."""
    for name, m in model.named_modules():
        where = name or "the model"
        if isinstance(m, torch.jit.ScriptModule) and "BatchNorm" in getattr(m, "original_name", ""):
            raise ValueError(f"bn='exact' cannot see the BatchNorm of the TorchScript module {where} "
                             f"({m.original_name}): TorchScript runs it in C++. Script the model after training, or "
                             "pass bn='micro'")
        if isinstance(m, nn.DataParallel) and len(m.device_ids) > 1:
            raise ValueError(f"bn='exact' cannot see the BatchNorm calls of nn.DataParallel ({where}): its replicas "
                             "run in threads of their own. Use torch.distributed (accumnorm.backward's process_group, "
                             "or the Trainer under torchrun), or one device")
        refusal = getattr(m, "accumnorm_exact_refusal", None)
        reason = refusal(schedule) if callable(refusal) else None
        if reason:
            raise ValueError(f"bn='exact' cannot make {type(m).__name__} ({where}) exact under the {schedule} "
                             f"schedule: {reason}")


def _check_every_call_seen(step: Step, tracked_before: dict[_BatchNorm, Tensor]) -> None:
    """Each BatchNorm forward in training bumps num_batches_tracked: every bump must be a call the step saw.

    A call that ran where no TorchFunctionMode reaches (TorchScript, a compiled graph, a thread of its own, C++)
    normalized with one micro-batch's statistics: the step is refused rather than silently wrong.
    """
    by_device: dict[torch.device, list[_BatchNorm]] = {}
    for m in tracked_before:
        by_device.setdefault(m.num_batches_tracked.device, []).append(m)
    for modules in by_device.values():
        bumps = torch.stack([m.num_batches_tracked - tracked_before[m] for m in modules]).tolist()
        for m, bumped in zip(modules, bumps):
            if bumped != step.seen.get(m, 0):
                raise ValueError(
                    f"bn='exact' saw {step.seen.get(m, 0)} of the {bumped} training forwards of {type(m).__name__} "
                    f"{step.names.get(m, '')}: the others ran where accumnorm cannot reach them (TorchScript, a "
                    "torch.compile graph, a thread of their own, C++), with one micro-batch's statistics. Nothing "
                    "was changed. Run that layer as Python in the calling thread, or pass bn='micro'")


@contextmanager
def _sync_batch_norm_as_local(model: nn.Module) -> Iterator[None]:
    """Run SyncBatchNorm layers as plain BatchNorm for the step: the schedule reduces over micro-batches and ranks.

    NOTE: SyncBatchNorm under an initialized process group would call its own collective kernel, which
    neither sees the other micro-batches nor runs on CPU; its `_BatchNorm.forward` ends in F.batch_norm.
    """
    syncs = [m for m in model.modules() if isinstance(m, nn.SyncBatchNorm)]
    for m in syncs:
        m.forward = types.MethodType(_BatchNorm.forward, m)
    try:
        yield
    finally:
        for m in syncs:
            vars(m).pop("forward", None)


def _whole_batch_loss(step: Step, scaled: bool) -> Tensor:
    """The whole-batch mean loss; a non-finite one is an error unless a GradScaler will skip the step."""
    losses = torch.stack(step.losses)
    finite = torch.isfinite(losses)
    # Under a GradScaler an overflow is expected now and then: its inf/nan gradients make the
    # scaler skip the step and lower the scale, so only an unscaled run treats it as an error.
    if not scaled and not bool(finite.all()):
        k = int((~finite).nonzero()[0])
        raise ValueError(f"loss is not finite ({losses[k].item()}) for micro-batch {k}; nothing was changed")
    weights = torch.tensor(step.weights, dtype=losses.dtype, device=losses.device)
    return step.collectives.sum_(losses @ weights)


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _cuda_devices(model: nn.Module) -> set[torch.device]:
    return {t.device for t in (*model.parameters(), *model.buffers()) if t.device.type == "cuda"}
