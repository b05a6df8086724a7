"""The layerwise schedule on the caller's thread, for a model whose forward has a torch.fx graph (`graph.py`).

loss_fn wraps the model's call, and only the model's part can be walked node by node. So loss_fn runs for
each micro-batch up to its call of the model, where it stops; the K calls go through the graph together,
node by node, every BatchNorm node once for all K (`Step.normalize_jointly`); then loss_fn runs again
from the start, its call of the model answered with that micro-batch's output, to the loss. A loss_fn
that calls the model n times runs n + 1 times per micro-batch, each time past one more answered call.
Everything runs on the caller's thread, with its intra-op threads and streams; the graph runs in the grad,
inference and autocast modes that loss_fn had at its model call.

Each micro-batch keeps its own random-number state, and every rerun replays it: the part of loss_fn
before a call draws the same numbers each time, the graph goes on from where that part left the
generator, and the rest of loss_fn from where the graph left it, as one run of the micro-batch alone.

NOTE: the part of loss_fn before its model call thus runs more than once (its Python side effects too);
the part after it runs once. Where this path does not fit (no graph, no model call, a BatchNorm call
outside the model's forward, micro-batches calling the model differently), it gives up before the
backward and `layerwise` runs the step in threads instead.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from ..intercept import BatchNormCalls, BNCall
from .graph import ForwardGraph, forward_graph, give_up_graph
from .step import GradModes, RngStates, Step

__all__ = ["run_traced"]

SavedTensorHooks = tuple[Callable[[Tensor], Any], Callable[[Any], Tensor]]


class _Stop(BaseException):
    """Ends a loss_fn run at a call of the model that has no answer yet. BaseException: loss_fn won't catch it.

    Keeps the grad, inference and autocast modes of the call: loss_fn may have set them around it (a teacher
    pass under no_grad, the model under autocast), and the graph must run in them.
    """

    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.args, self.kwargs, self.modes = args, kwargs, GradModes.current()


class _Captured(BaseException):
    """Stops a BatchNorm node of the graph at its F.batch_norm call, whose arguments it carries."""

    def __init__(self, call: BNCall) -> None:
        super().__init__()
        self.call = call


class _CannotTrace(Exception):
    """This step does not fit the traced path, for `reason`; `of_model`: because of the model's graph, which is then
    not used again until the model changes (else because of loss_fn, tried again next step)."""

    def __init__(self, reason: str, of_model: bool) -> None:
        super().__init__(reason)
        self.of_model = of_model


def run_traced(step: Step, store: SavedTensorHooks | None) -> bool:
    """Run the step (module doc); False, with the step as it was, if the model cannot run from its graph."""
    try:
        _Traced(step, store).run()
    except _CannotTrace as e:
        if e.of_model:
            give_up_graph(step.model, str(e))
        step.restart()
        return False
    return True


class _Traced:
    def __init__(self, step: Step, store: SavedTensorHooks | None) -> None:
        self.step, self.store = step, store
        k = len(step.micro_batches)
        step.draw_seeds()
        self.rng = RngStates(step.seeds, step.cuda_devices)
        self.answers: list[list[Any]] = [[] for _ in range(k)]  # each micro-batch's model outputs so far
        self.resume: list[list[list[Tensor]]] = [[] for _ in range(k)]  # its generator state after each answer
        self.k = 0  # the micro-batch being run
        self.calls_made = 0  # model calls answered in this loss_fn run so far
        self.bn_state = "outside"  # where an F.batch_norm call comes from: outside, capture, replay, hidden
        self.outputs: list[Tensor] = []  # a BatchNorm node's joint outputs, while they are replayed

    def run(self) -> None:
        step = self.step
        with torch.random.fork_rng(devices=step.cuda_devices), self._model_answers(), \
                torch.autograd.graph.saved_tensors_hooks(*self.store) if self.store else contextlib.nullcontext():
            while True:
                ends = [self._loss_fn_until_unanswered(k) for k in range(len(step.micro_batches))]
                stops = [end for end in ends if isinstance(end, _Stop)]
                if not stops:
                    break
                if len(stops) < len(ends):
                    raise ValueError("bn='exact' needs every micro-batch's loss_fn to call the model as often; "
                                     f"micro-batches {[k for k, e in enumerate(ends) if not isinstance(e, _Stop)]} "
                                     f"called it {min(len(a) for a in self.answers)} times, the others more")
                self._through_graph(stops)
        for k, loss in enumerate(ends):
            step.losses[k] = loss.detach()
        # One backward over every micro-batch: the joint BN nodes need all K gradients at once.
        torch.autograd.backward([step.weighted(loss, k) for k, loss in enumerate(ends)])

    def _loss_fn_until_unanswered(self, k: int) -> _Stop | Tensor:
        """Run loss_fn on micro-batch k from the start: its stop at an unanswered model call, or its loss."""
        self.rng.states[k] = None  # from the micro-batch's seed, every time
        self.rng.switch_in(k)
        self.k, self.calls_made = k, 0
        try:
            with self._batch_norm_calls():
                loss = self.step.loss(k)
        except _Stop as stop:
            self.rng.switch_out(k)  # the graph goes on from here
            return stop
        if not self.answers[k]:
            raise _CannotTrace("loss_fn did not call the model (it may call its parts)", of_model=False)
        return loss

    def _batch_norm_calls(self) -> BatchNormCalls:
        """Where F.batch_norm calls with batch statistics are watched: loss_fn's runs and some graph nodes (not
        all: a TorchFunctionMode costs every torch call it sees)."""
        return BatchNormCalls(self._batch_norm_call, self.step.owners)

    @contextlib.contextmanager
    def _model_answers(self) -> Iterator[None]:
        """During the step, a call of the model is answered from `answers`, or stops the loss_fn run (`_Stop`)."""
        model = self.step.model
        if "forward" in vars(model):
            raise _CannotTrace("the model has a forward of its own instance", of_model=True)

        def forward(*args: Any, **kwargs: Any) -> Any:
            i, self.calls_made = self.calls_made, self.calls_made + 1
            if i == len(self.answers[self.k]):
                raise _Stop(args, kwargs)
            for g, state in zip(self.rng.generators(), self.resume[self.k][i]):
                g.set_state(state)  # the rest of loss_fn draws after what the graph drew
            return self.answers[self.k][i]

        model.forward = forward
        try:
            yield
        finally:
            del model.forward

    def _through_graph(self, stops: list[_Stop]) -> None:
        """The K stopped model calls through the model's graph together; their outputs become answers."""
        if any(stop.modes != stops[0].modes for stop in stops):
            raise _CannotTrace("the micro-batches call the model under different grad or autocast modes",
                               of_model=False)
        graph, inputs = forward_graph(self.step.model, [(stop.args, stop.kwargs) for stop in stops])
        if not isinstance(graph, ForwardGraph):
            raise _CannotTrace(graph, of_model=False)  # the reason is cached with the graph already
        self.bn_state = "hidden"
        try:
            with stops[0].modes.enter():
                outputs = graph.run(inputs, self._each, self._batch_norm_node, self._batch_norm_calls)
        finally:
            self.bn_state = "outside"
        for k, out in enumerate(outputs):
            self.answers[k].append(out)
            self.resume[k].append(self.rng.states[k])

    def _each(self, k: int, run: Callable[[], Any]) -> Any:
        """Run a graph node for micro-batch k, with its random numbers."""
        self.rng.switch_in(k)
        try:
            return run()
        finally:
            self.rng.switch_out(k)

    def _batch_norm_node(self, runs: list[Callable[[], Any]]) -> list[Any]:
        """A BatchNorm node for all K: each call is captured at F.batch_norm, the K are normalized together, then
        each runs again and F.batch_norm returns its share (anything after it in the node runs once)."""
        # NOTE: a BatchNorm module's forward thus runs twice per micro-batch (its pre-hooks too); what it does
        # before F.batch_norm is checking the input and bumping num_batches_tracked, which the step resets.
        calls = []
        self.bn_state = "capture"
        try:
            with self._batch_norm_calls():
                for k, run in enumerate(runs):
                    try:
                        out = self._each(k, run)
                    except _Captured as captured:
                        calls.append(captured.call)
                        continue
                    if k == 0:  # no batch statistics here (a BatchNorm module in eval mode): an ordinary node
                        self.bn_state = "hidden"
                        return [out] + [self._each(j, r) for j, r in enumerate(runs[1:], 1)]
                    raise ValueError("bn='exact' needs the same sequence of BatchNorm calls in every micro-batch's "
                                     f"forward; micro-batch {k} made no BatchNorm call where micro-batch 0 made one")
            self.outputs = self.step.normalize_jointly(calls)
            self.bn_state = "replay"
            with self._batch_norm_calls():
                return [self._each(k, run) for k, run in enumerate(runs)]
        finally:
            self.bn_state = "hidden"

    def _batch_norm_call(self, bn: BNCall) -> Tensor:
        """Every F.batch_norm call of the step with batch statistics, wherever it comes from."""
        if self.bn_state == "capture":
            raise _Captured(bn)
        if self.bn_state == "replay":
            return self.outputs.pop(0)
        if self.bn_state == "outside":
            raise _CannotTrace(f"loss_fn made a {bn.describe()} outside the model's forward", of_model=False)
        raise _CannotTrace(f"a {bn.describe()} ran inside a graph node that is not a BatchNorm call", of_model=True)
