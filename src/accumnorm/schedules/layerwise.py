"""The layerwise schedule: the micro-batches go through the network in lockstep, one BatchNorm call at a time.

The micro-batches' forwards (loss_fn on each) take turns: each runs until its next BatchNorm call, then
hands over to the next one. Once all K have reached the call, one autograd node normalizes all of them
with the whole batch's statistics (`functional.normalize_joint`), and they go on to the next call. The
backward is one call over the K losses: autograd runs the joint node's backward once every micro-batch's
gradient at its output is known, which is exactly when the whole-batch sums sum(dy) and sum(dy * x_hat)
can be formed.

Cost: one forward and one backward of each micro-batch, as plain accumulation, at any depth. Price:
the K graphs live together until the backward, so autograd's saved tensors of the whole batch are
kept, in `store` (on CUDA, pinned host memory by default: the device then holds about what one
micro-batch needs, plus the tensors that cross the current BatchNorm call for all K).

Two ways to run the lockstep. A model that torch.fx traces (`graph.py`) runs from its graph, on the
caller's thread (`traced.py`). Any other model runs as Python, one thread per micro-batch: a thread is
the one way to pause arbitrary Python at a BatchNorm call and resume it later without tracing it, so
any model runs as written, control flow and all. Only one thread runs at a time (a baton goes round),
so a step is deterministic; the forwards use one intra-op thread each and the backward the caller's
(see `_Lockstep._work` for why). Thread-local state reaches every worker as DataParallel hands it on:
grad mode, autocast, CUDA device and stream, saved-tensor hooks. Each micro-batch has its own
random-number state, seeded as the passes schedule seeds it, so all schedules draw the same dropout
masks.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from ..intercept import BatchNormCalls, BNCall
from .step import GradModes, RngStates, Step
from .traced import run_traced

__all__ = ["layerwise", "cannot_run_reason", "resolve_store"]


def resolve_store(store: Any) -> torch.device:
    """Where the whole batch's saved tensors live: `store`, or by default the model's device on CPU and pinned
    host memory on CUDA."""
    if store is None:
        return torch.device("cpu")
    if isinstance(store, str):
        try:
            return resolve_store(torch.device(store))
        except RuntimeError:
            raise ValueError(f"store must be None, 'cpu' or a torch.device, got the string {store!r}") from None
    if isinstance(store, torch.device):
        if store.type == "meta" or (store.type == "cuda" and not torch.cuda.is_available()):
            raise ValueError(f"store must be a device that can hold tensors here, got {store} "
                             f"(CUDA available: {torch.cuda.is_available()}); use None or 'cpu'")
        if store.type == "cuda" and store.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return store
    raise TypeError(f"store must be None, 'cpu' or a torch.device, got {type(store).__name__} {store!r}")


def cannot_run_reason() -> str | None:
    """Why the layerwise schedule cannot run in the caller's context, or None if it can."""
    modes = _get_current_dispatch_mode_stack() + torch.overrides._get_current_function_mode_stack()
    if modes:
        # Modes are thread-local and cannot be handed to worker threads.
        return f"a {type(modes[-1]).__name__} is active, and the micro-batches would run outside it"
    return None


class _Aborted(BaseException):
    """Unwinds a micro-batch's forward once the step has failed. BaseException: `except Exception` won't eat it."""


class _Store:
    """Saved-tensor hooks that keep what autograd saves on `device` (pinned when it is the host of a GPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pin = device.type == "cpu" and torch.cuda.is_available()

    def pack(self, t: Tensor) -> Any:
        # Parameters are kept by reference: copying a weight once per micro-batch would only waste memory.
        if t.device == self.device or isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad):
            return t
        packed = torch.empty_like(t, device=self.device, pin_memory=self.pin)
        packed.copy_(t, non_blocking=self.pin)
        return t.device, packed

    @staticmethod
    def unpack(packed: Any) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        device, t = packed
        return t.to(device, non_blocking=True)


class _CallerState:
    """The thread-local state of the caller that each worker thread takes on (as DataParallel's workers do)."""

    def __init__(self, store: _Store | None) -> None:
        self.modes = GradModes.current()
        self.cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        self.stream = torch.cuda.current_stream() if self.cuda_device is not None else None
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.hooks = (store.pack, store.unpack) if store is not None else top

    @contextlib.contextmanager
    def enter(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.modes.enter())
            if self.cuda_device is not None:
                stack.enter_context(torch.cuda.device(self.cuda_device))
                stack.enter_context(torch.cuda.stream(self.stream))
            if self.hooks is not None:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*self.hooks))
            yield


class _Lockstep:
    """K worker threads, one per micro-batch, passing a baton: see the module doc."""

    def __init__(self, step: Step, store: _Store | None) -> None:
        self.step = step
        k = len(step.micro_batches)
        self.caller = _CallerState(store)
        step.draw_seeds()
        self.rng = RngStates(step.seeds, step.cuda_devices)
        self.turns = [threading.Semaphore(0) for _ in range(k)]
        self.finished = threading.Semaphore(0)  # the caller waits here for the forwards
        self.arrived: list[BNCall | None] = [None] * k  # where each micro-batch stopped in this round
        self.outputs: list[Tensor | None] = [None] * k
        self.roots: list[Tensor | None] = [None] * k  # weighted losses still to back-propagate
        self.rounds = 0  # BN calls completed by all micro-batches so far
        self.error: BaseException | None = None
        self.aborted = False
        self.local = threading.local()
        self.threads = torch.get_num_threads()  # the caller's intra-op threads, for the backward

    def run(self) -> None:
        step = self.step
        threads = [threading.Thread(target=self._work, args=(k,), name=f"accumnorm-micro-batch-{k}", daemon=True)
                   for k in range(len(step.micro_batches))]
        with torch.random.fork_rng(devices=step.cuda_devices):  # the caller's generators end as they were
            for t in threads:
                t.start()
            self.turns[0].release()
            try:
                self.finished.acquire()
            except BaseException as e:  # Ctrl-C while the forwards run: stop them too
                self._abort(e)
            for t in threads:
                t.join()
        torch.set_num_threads(self.threads)  # see _work
        if self.error is not None:
            raise self.error
        roots = [root for root in self.roots if root is not None]
        if roots:
            # One backward over every micro-batch: the joint BN nodes need all K gradients at once.
            torch.autograd.backward(roots)

    def _work(self, k: int) -> None:
        self.local.k = k
        self.turns[k].acquire()
        if self.aborted:
            return
        # NOTE: the forwards run on one intra-op thread each. A thread that runs torch ops on several
        # keeps an OpenMP team of its own, and once the process holds more OpenMP threads than cores,
        # libgomp stops spinning between parallel regions for every team, plain torch's too (4 idle
        # teams cost it 40% on 2 cores). The backward, two thirds of the work, runs in the caller's
        # thread with the caller's thread count, restored before it starts.
        # torch.set_num_threads sets this thread's OpenMP count and torch's global one, which a thread's first
        # parallel op copies: get_num_threads makes that copy now, before another thread changes the global.
        torch.set_num_threads(1)
        torch.get_num_threads()
        try:
            self.rng.switch_in(k)
            with self.caller.enter(), BatchNormCalls(self._arrive, self.step.owners):
                loss = self.step.loss(k)
            self.step.losses[k] = loss.detach()
            # Weighted here, not by the caller: autograd orders its backward by the creating thread's node
            # count, and fresh worker threads count the same in every step, which keeps steps reproducible.
            weighted = self.step.weighted(loss, k)
            if self.rounds == 0:
                # No BatchNorm call so far, so (unless another micro-batch disagrees) there is none:
                # this micro-batch's graph is its own, and its backward frees it now, as plain accumulation.
                weighted.backward()
            else:
                self.roots[k] = weighted
            self._pass_baton(k)
        except _Aborted:
            pass
        except BaseException as e:
            self._abort(e)

    def _arrive(self, bn: BNCall) -> Tensor:
        """A micro-batch's forward reached a BatchNorm call: wait for the others, go on with the joint output."""
        k = self.local.k
        self.arrived[k] = bn
        self._pass_baton(k)
        self.turns[k].acquire()
        if self.aborted:
            raise _Aborted
        self.rng.switch_in(k)
        out, self.outputs[k] = self.outputs[k], None
        return out

    def _pass_baton(self, k: int) -> None:
        self.rng.switch_out(k)
        if k + 1 < len(self.turns):
            self.turns[k + 1].release()
            return
        try:  # the last micro-batch of the round closes it
            if all(a is None for a in self.arrived):
                self.finished.release()
                return
            self._check_round()
            self._normalize()
        except BaseException as e:
            self._abort(e)
            return
        self.turns[0].release()

    def _check_round(self) -> None:
        first = self.arrived[0]
        for k, bn in enumerate(self.arrived):
            if bn is None or first is None or not bn.same_layer(first):
                raise ValueError(
                    f"bn='exact' needs the same sequence of BatchNorm calls in every micro-batch's forward; at "
                    f"BatchNorm call {self.rounds} micro-batch 0 {_where(first)} while micro-batch {k} {_where(bn)}"
                )

    def _normalize(self) -> None:
        """All micro-batches are at the same BatchNorm call: normalize them together."""
        self.outputs = self.step.normalize_jointly(self.arrived)
        self.arrived = [None] * len(self.arrived)
        self.rounds += 1

    def _abort(self, error: BaseException) -> None:
        """Record the first error and wake every thread, which then unwinds."""
        if self.error is None:
            self.error = error
        self.aborted = True
        for turn in self.turns:
            turn.release()
        self.finished.release()


def _where(bn: BNCall | None) -> str:
    return "had ended its forward" if bn is None else f"was at a {bn.describe()}"


def layerwise(step: Step, store: torch.device, model_device: torch.device) -> None:
    """Exact BatchNorm with the micro-batches in lockstep (module doc); fills `step.losses` and `step.calls`."""
    hooks = _Store(store) if store != model_device else None
    if not run_traced(step, hooks and (hooks.pack, hooks.unpack)):  # the model has no graph: run it in threads
        _Lockstep(step, hooks).run()
