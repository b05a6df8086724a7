"""A step from its start to its end: the transaction around it, and what the process holds while it runs.

`run_in_transaction` runs a step's schedule and commits its gradients and running statistics, or, whatever ends
it early (an error, a Ctrl-C, a refusal), undoes everything: `.grad`, every buffer and the caller's random state
are as they were. While it runs, the thread is marked as running a step (a step inside another is refused:
`step_running`), SIGINT is deferred to the moments the step can still be undone, the recursion limit leaves room
for the step's own frames, Python's cyclic collector is off, and torch's layers have their step forwards.
"""
from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import torch.nn as nn
from torch import Tensor

from ..intercept.forwards import step_forwards
from ..intercept.higher_order import higher_order_ops_in_step, refused_in
from ..safety.attributes import ModuleAttributes
from ..safety.interrupts import SigintDeferred
from ..safety.rng import StepRng
from ..safety.shared import WhileStepsRun
from ..safety.threadstate import ThreadState
from ..safety.transaction import Transaction
from ..safety.writes import install_noting
from .step import Step, StepCall

__all__ = ["run_in_transaction", "step_running"]

# The steps running on this thread: a step inside another (called from its loss_fn or a hook) is refused.
_RUNNING = threading.local()


def step_running() -> bool:
    """Whether this thread is running a step now."""
    return getattr(_RUNNING, "step", False)


# The frames a step puts between the caller and the model's forward (the driver, a coroutine's start, each
# BatchNorm call's way to the schedule): the recursion limit is that much higher while steps run, so that a model
# as deeply nested as whole-batch torch can run runs in a step too.
_STEP_FRAMES = 64
_ROOM_FOR_THE_STEPS_FRAMES = WhileStepsRun(sys.getrecursionlimit, sys.setrecursionlimit,
                                           lambda limit: limit + _STEP_FRAMES)


def _set_collector(enabled: bool) -> None:
    gc.enable() if enabled else gc.disable()


# Python's cyclic garbage collector is off while a step's forwards and backward run, on any thread. The step's
# objects (its records of each BatchNorm and region call, the coroutines' frames) live from the forward to the
# backward and go by reference count as it ends; collections during it would promote them to the oldest generation,
# and so bring on full collections, each a walk over every object in the process. Training loops that count their
# milliseconds do the same for the whole run (torchtitan's `gc.disable()`).
_COLLECTOR_OFF = WhileStepsRun(gc.isenabled, _set_collector, lambda enabled: False)


@contextmanager
def _exact_forwards(modules: list[nn.Module]) -> Iterator[None]:
    """For an exact step's length: the step forwards of torch's layers, higher-order ops that dynamo traces where
    the step sees their norms, or refuses (`higher_order`), and the numbers modules set noted (`writes`)."""
    install_noting()
    with step_forwards(modules), higher_order_ops_in_step():
        yield


def run_in_transaction(call: StepCall, names: dict[nn.Module, str],
                       run: Callable[[Callable[[], Step], Callable[[Step], None]], Step]) -> Tensor:
    """Run the step (`run(new_step, start_over)`); commit its gradients and running statistics, or, whatever ends it
    early, undo everything."""
    # Copies only, until the try: an interrupt before it changes nothing.
    caller = ThreadState.capture()
    transaction = Transaction(call.model, names)
    rng = StepRng(len(call.micro_batches), transaction.cuda_devices())
    interrupts = SigintDeferred()
    steps: list[Step] = []
    room = _ROOM_FOR_THE_STEPS_FRAMES.held()
    ended = False  # the step committed and ended, and SIGINT is the caller's again
    try:
        interrupts.start()
        room.__enter__()
        _RUNNING.step = True
        transaction.begin()
        rng.start()

        def new_step() -> Step:
            steps.append(Step(call, transaction, rng, interrupts, attributes))
            return steps[-1]

        def start_over(step: Step) -> None:
            """Undo a schedule's partial run for another to start the step again: gradients, buffers, the modules'
            attributes (a flag loss_fn set, which the next run would read) and every micro-batch's random stream back
            at its start (the next schedule draws what it would have drawn alone); the run's regions, its `Step` and
            what its backward left queued let go of before the next begins."""
            transaction.rollback()
            transaction.begin()
            attributes.restore()
            step.rng.rewind()
            step.regions.clear()
            steps.remove(step)
            _drop_queued_backward()

        # The collector is back before the commit: a collection it then runs (its callbacks, __del__ methods) runs
        # while the step can still be undone.
        with _COLLECTOR_OFF.held(), _exact_forwards(transaction.modules) if call.exact else nullcontext():
            attributes = ModuleAttributes(transaction.modules)  # as the schedule's forwards find them
            try:
                step = run(new_step, start_over)
            except BaseException:
                attributes.restore()  # a flag or number a forward set, as the step found it
                raise
            finally:
                attributes.close()
        loss = step.losses.result()
        call.collectives.sum_grads_(transaction.params)
        if call.exact:
            transaction.refuse_parameters_replaced()
            step.ledger.check_every_call_seen(step.names)
            if len(call.micro_batches) > 1:  # one forward of the whole batch changes state as torch's does
                transaction.refuse_buffers_changed(len(call.micro_batches), step.ledger.keeps)
            step.ledger.update_running_stats()
        for m in transaction.modules:
            if hasattr(type(m), "accumnorm_step_end"):
                m.accumnorm_step_end()
        transaction.commit()
        rng.close(failed=False)
        _end(steps, room, caller)
        del step  # the step's objects go now, while a Ctrl-C is deferred: weakref callbacks as they go would drop it
        # The last call before the return: a Ctrl-C that came during the step, or comes until SIGINT's handler is
        # the caller's again, is raised here, and undoes the step; one after it reaches the caller's code once the
        # step has returned.
        interrupts.close()
        ended = True
    except BaseException as e:
        transaction.rollback()
        rng.close(failed=True)
        _drop_queued_backward()
        refused = refused_in(e)
        if refused is not None:  # dynamo's error, around the refusal it was told
            raise refused from e
        raise
    finally:
        if not ended:
            try:
                _end(steps, room, caller)
            finally:
                interrupts.close()
    return loss


def _drop_queued_backward() -> None:
    """Let go of what a backward that raised left queued. torch's engine runs a CPU backward on the calling thread,
    from a ready queue of the thread's own: the nodes that were ready when one raised (the other micro-batches'
    branches, or the rest of a region's) stay queued, holding their part of the graph and through it the model,
    until the thread's next backward pops and drops them. A backward of one node, here, is that next one. Should it
    fail (a mode of the caller's that refuses it), they wait for that next backward, as in torch: the error that ended
    the step is the one raised."""
    try:
        with torch.inference_mode(False), torch.enable_grad():
            x = torch.zeros((), requires_grad=True)
            torch.autograd.grad(x * 1.0, x)
    except Exception:
        pass


def _end(steps: list[Step], room: AbstractContextManager[None], caller: ThreadState) -> None:
    """What ends a step, committed or not: its regions let go, this thread's flag and recursion limit back, and the
    caller's thread as it was (grad mode, autocast, modes, hooks). Each part is done once, even if interrupted."""
    try:
        for made in steps:
            made.regions.clear()
        steps.clear()
        if step_running():
            _RUNNING.step = False
            room.__exit__(None, None, None)
    finally:
        caller.apply(ThreadState.capture())
