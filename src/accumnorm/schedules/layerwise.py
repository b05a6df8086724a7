"""The layerwise schedule: the micro-batches go through the network in lockstep, one BatchNorm call at a time.

Each micro-batch's forward (loss_fn on it) runs in a thread of its own, and the threads take turns:
each runs until its next BatchNorm call, then hands over to the next one. Once all K have reached the
call, one autograd node normalizes all of them with the whole batch's statistics
(`functional.normalize_joint`), and they go on to the next call. The backward is one call over the K
losses: autograd runs the joint node's backward once every micro-batch's gradient at its output is
known, which is exactly when the whole-batch sums sum(dy) and sum(dy * x_hat) can be formed.

Cost: one forward and one backward of each micro-batch, as plain accumulation, at any depth. Price:
the K graphs live together until the backward, so autograd's saved tensors of the whole batch are
kept, in `store` (on CUDA, pinned host memory by default: the device then holds about what one
micro-batch needs, plus the tensors that cross the current BatchNorm call for all K).

Why threads: the forward is arbitrary Python (the model and loss_fn); a thread is the one way to pause
it at a BatchNorm call and resume it later without tracing it, so any model runs as written, control
flow and all. Only one thread runs at a time (a baton goes round), so a step is deterministic; the
workers use one intra-op thread each and the backward the caller's (see `_Lockstep._work` for why).
When the model traces with torch.fx (`graph.py`), the workers only run loss_fn: their calls of the model
meet in a round like a BatchNorm call's, and the caller's thread runs the model's graph for all K, one
node at a time, with the caller's intra-op threads. Thread-local state reaches every worker as
DataParallel hands it on: grad mode, autocast, CUDA device and stream, saved-tensor hooks. Each
micro-batch has its own random-number state, seeded as the passes schedule seeds it, so both
schedules draw the same dropout masks.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from ..functional import moments, normalize_joint, stack_moments
from ..intercept import BatchNormCalls, BNCall
from .graph import forward_graph, give_up_graph
from .step import Step

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


class _Captured(BaseException):
    """Stops a BatchNorm node of the graph at its F.batch_norm call, whose arguments it carries."""

    def __init__(self, call: BNCall) -> None:
        super().__init__()
        self.call = call


class _GraphMissedCall(Exception):
    """A BatchNorm call ran inside a graph node not marked as one: the graph cannot run this model's forward."""


class _ModelCall:
    """A micro-batch's call of the model, stopped until the K calls run through the model's graph together."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        self.args, self.kwargs = args, kwargs

    @staticmethod
    def describe() -> str:
        return "call of the model"


_AS_PYTHON = object()  # the answer to a model call when the model has no graph: run the forward in the worker


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
        self.grad = torch.is_grad_enabled()
        self.autocast = [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
        self.cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        self.stream = torch.cuda.current_stream() if self.cuda_device is not None else None
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.hooks = (store.pack, store.unpack) if store is not None else top

    @contextlib.contextmanager
    def enter(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for device_type, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
            if self.cuda_device is not None:
                stack.enter_context(torch.cuda.device(self.cuda_device))
                stack.enter_context(torch.cuda.stream(self.stream))
            if self.hooks is not None:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*self.hooks))
            yield


class _RngStates:
    """One generator state per micro-batch, switched in and out with the baton."""

    def __init__(self, seeds: list[int], cuda_devices: list[int]) -> None:
        self.seeds, self.cuda_devices = seeds, cuda_devices
        self.states: list[list[Tensor] | None] = [None] * len(seeds)

    def _generators(self) -> list[torch.Generator]:
        return [torch.default_generator] + [torch.cuda.default_generators[d] for d in self.cuda_devices]

    def switch_in(self, k: int) -> None:
        state = self.states[k]
        for i, g in enumerate(self._generators()):
            if state is None:
                g.manual_seed(self.seeds[k])
            else:
                g.set_state(state[i])

    def switch_out(self, k: int) -> None:
        self.states[k] = [g.get_state() for g in self._generators()]


class _Lockstep:
    """K worker threads, one per micro-batch, passing a baton: see the module doc."""

    def __init__(self, step: Step, store: _Store | None, use_graph: bool) -> None:
        self.step, self.store, self.use_graph = step, store, use_graph
        k = len(step.micro_batches)
        self.caller = _CallerState(store)
        step.draw_seeds()
        self.rng = _RngStates(step.seeds, step.cuda_devices)
        self.turns = [threading.Semaphore(0) for _ in range(k)]
        self.finished = threading.Semaphore(0)  # the caller waits here for the forwards
        self.arrived: list[BNCall | _ModelCall | None] = [None] * k  # where each micro-batch stopped in this round
        self.outputs: list[Any] = [None] * k
        self.graph_round = False  # the workers wait for the caller to run the model's graph
        self.capturing = False  # a graph BatchNorm node: True while its calls are captured, False while replayed
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
        with torch.random.fork_rng(devices=step.cuda_devices), self._model_calls_meet():
            for t in threads:
                t.start()
            self.turns[0].release()
            try:
                self.finished.acquire()
                while self.graph_round and not self.aborted:
                    self.graph_round = False
                    self._run_graph()
                    self.turns[0].release()
                    self.finished.acquire()
            except BaseException as e:  # Ctrl-C while the forwards run, or the graph failed: stop the workers too
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
        torch.set_num_threads(1)
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

    @contextlib.contextmanager
    def _model_calls_meet(self) -> Iterator[None]:
        """While the step runs, the workers' calls of the model wait for each other (to run the graph) in `_call`."""
        model = self.step.model
        if not self.use_graph or "forward" in vars(model):
            yield
            return
        own_forward = model.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if getattr(self.local, "k", None) is None:  # not a worker's call
                return own_forward(*args, **kwargs)
            out = self._arrive(_ModelCall(args, kwargs))
            return own_forward(*args, **kwargs) if out is _AS_PYTHON else out

        model.forward = forward
        try:
            yield
        finally:
            del model.forward

    def _arrive(self, call: BNCall | _ModelCall) -> Any:
        """A micro-batch's forward reached a BatchNorm call or a model call: wait for the others, go on with the
        joint output."""
        k = self.local.k
        self.arrived[k] = call
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
            if isinstance(self.arrived[0], _ModelCall):  # the caller runs the graph, then restarts the round
                self.graph_round = True
                self.finished.release()
                return
            self._normalize()
        except BaseException as e:
            self._abort(e)
            return
        self.turns[0].release()

    def _check_round(self) -> None:
        first = self.arrived[0]
        for k, bn in enumerate(self.arrived):
            if bn is None or first is None or type(bn) is not type(first) or (
                    isinstance(bn, BNCall) and not bn.same_layer(first)):
                raise ValueError(
                    f"bn='exact' needs the same sequence of BatchNorm calls in every micro-batch's forward; at "
                    f"BatchNorm call {self.rounds} micro-batch 0 {_where(first)} while micro-batch {k} {_where(bn)}"
                )

    def _normalize(self) -> None:
        """All micro-batches are at the same BatchNorm call: normalize them together."""
        calls, first = self.arrived, self.arrived[0]
        with torch.no_grad():
            local = stack_moments([moments(bn.input) for bn in calls])
        first.stats = self.step.collectives.merge_moments(local)
        self.outputs = list(normalize_joint([bn.input for bn in calls], first.stats, first.weight, first.bias,
                                            first.eps, self.step.collectives.sum_))
        self.arrived = [None] * len(calls)
        self.step.calls.append(first)
        self.rounds += 1

    def _run_graph(self) -> None:
        """On the caller's thread: the K model calls of this round through the model's graph, node by node."""
        calls, self.arrived = self.arrived, [None] * len(self.arrived)
        graph, inputs = forward_graph(self.step.model, [(call.args, call.kwargs) for call in calls])
        if isinstance(graph, str):
            self.outputs = [_AS_PYTHON] * len(calls)  # each worker runs the forward itself
            return
        torch.set_num_threads(self.threads)  # the workers' setting reaches MKL's global one (see _work)
        with contextlib.ExitStack() as stack:
            if self.store is not None:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self.store.pack, self.store.unpack))
            self.outputs = graph.run(inputs, self._each, self._graph_batch_norm, self._guarded)

    def _guarded(self) -> BatchNormCalls:
        """The caller thread's view of F.batch_norm calls while it runs a graph node that may make one."""
        return BatchNormCalls(self._graph_call, self.step.owners)

    def _each(self, k: int, run: Callable[[], Any]) -> Any:
        """Run a graph node for micro-batch k, with its random numbers."""
        self.rng.switch_in(k)
        try:
            return run()
        finally:
            self.rng.switch_out(k)

    def _graph_batch_norm(self, runs: list[Callable[[], Any]]) -> list[Any]:
        """A BatchNorm node of the graph for all K: each call is captured at F.batch_norm, the K are normalized
        together, then each runs again and F.batch_norm returns its share (anything after it runs once)."""
        # NOTE: a BatchNorm module's forward thus runs twice per micro-batch (its pre-hooks too); what it does
        # before F.batch_norm is checking the input and bumping num_batches_tracked, which the step resets.
        calls = []
        with self._guarded():
            self.capturing = True
            try:
                for k, run in enumerate(runs):
                    try:
                        out = self._each(k, run)
                    except _Captured as captured:
                        calls.append(captured.call)
                        continue
                    if k == 0:  # no batch statistics here (a BatchNorm module in eval mode): an ordinary node
                        self.capturing = False
                        return [out] + [self._each(j, r) for j, r in enumerate(runs[1:], 1)]
                    raise ValueError("bn='exact' needs the same sequence of BatchNorm calls in every micro-batch's "
                                     f"forward; micro-batch {k} made no BatchNorm call where micro-batch 0 made one")
            finally:
                self.capturing = False
        self.arrived = calls
        self._check_round()
        self._normalize()
        with self._guarded():
            return [self._each(k, run) for k, run in enumerate(runs)]

    def _graph_call(self, bn: BNCall) -> Tensor:
        """The caller thread's F.batch_norm calls, while it runs the graph."""
        if self.capturing:
            raise _Captured(bn)
        k = next((k for k, out in enumerate(self.outputs) if out is not None), None)
        if k is None:
            raise _GraphMissedCall(f"a {bn.describe()} ran inside a graph node that is not a BatchNorm call")
        out, self.outputs[k] = self.outputs[k], None
        return out

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
    store_hooks = _Store(store) if store != model_device else None
    try:
        _Lockstep(step, store_hooks, use_graph=True).run()
    except _GraphMissedCall as e:
        # The trace hid a BatchNorm call inside another node: run this model's forward as Python from now on.
        give_up_graph(step.model, str(e))
        step.restart()
        _Lockstep(step, store_hooks, use_graph=False).run()
