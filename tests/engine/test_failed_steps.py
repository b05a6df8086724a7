"""Failed steps leave nothing alive: 300 failing steps under every schedule, errors before, during and after the
forward, with and without a checkpointed region, in both forms of the loss, keep the number of live tensors and
models flat, and a model dropped after a failed step is freed, one that failed in its backward too."""
from __future__ import annotations

import contextvars
import gc
import itertools
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import accumnorm
from helpers import failing_below

_FAILING = contextvars.ContextVar("failing", default=False)  # per micro-batch: each coroutine has its own context
FAILURES = ("before the forward", "at a BatchNorm call", "after the forward", "nan loss", "in batch_loss_fn")


class _Net(nn.Module):
    """BatchNorm, and a Tanh whose output its backward keeps, in or out of a checkpointed region."""

    def __init__(self, checkpointed: bool, norms: bool = True) -> None:
        super().__init__()
        self.checkpointed, self.norms = checkpointed, norms
        norm = nn.BatchNorm1d if norms else nn.Identity  # without: "auto" runs a whole-batch loss as GradCache does
        self.block = nn.Sequential(nn.Linear(6, 8), norm(8), nn.Tanh())
        self.head = nn.Sequential(nn.Linear(8, 8), norm(8), nn.Tanh(), nn.Linear(8, 4))

    def forward(self, x):
        h = checkpoint(self.block, x, use_reentrant=False) if self.checkpointed else self.block(x)
        return self.head(h)


def _live(cls: type) -> int:
    gc.collect()
    return sum(issubclass(type(o), cls) for o in gc.get_objects())


def _failing_step(model: nn.Module, failure: str, whole: bool, schedule: str, x: torch.Tensor, y: torch.Tensor) -> None:
    """One step of `model` that fails as `failure` says, in micro-batch 2 of 3; `whole`: with a whole-batch loss."""
    poisoned = x[4:6]

    def fail_at_batch_norm(module, args):
        if _FAILING.get():
            raise RuntimeError("failure in micro-batch 2")

    def forward_fn(m, b):
        if failure == "before the forward" and torch.equal(b, poisoned):
            raise RuntimeError("failure in micro-batch 2")
        token = _FAILING.set(failure == "at a BatchNorm call" and torch.equal(b, poisoned))
        try:
            out = m(b)
        finally:
            _FAILING.reset(token)
        if failure == "after the forward" and torch.equal(b, poisoned):
            raise RuntimeError("failure in micro-batch 2")
        return out * float("nan") if failure == "nan loss" and torch.equal(b, poisoned) else out

    def loss_fn(m, b):
        return F.cross_entropy(forward_fn(m, b[0]), b[1])

    def batch_loss_fn(outputs, targets):
        if failure == "in batch_loss_fn":
            raise RuntimeError("failure in micro-batch 2 (the whole batch's loss)")
        return F.cross_entropy(outputs, targets)

    handle = model.head[1].register_forward_pre_hook(fail_at_batch_norm)
    try:
        with pytest.raises((RuntimeError, ValueError), match="failure in micro-batch 2|not finite"):
            how = dict(bn="micro") if schedule == "micro" else dict(schedule=schedule)
            if whole:
                accumnorm.backward(model, x, micro_batch_size=2, forward_fn=forward_fn, batch_loss_fn=batch_loss_fn,
                                   targets=y, **how)
            else:
                accumnorm.backward(model, (x, y), loss_fn, micro_batch_size=2, **how)
    finally:
        handle.remove()


@pytest.mark.parametrize("schedule", ["layerwise", "recompute", "segments", "passes", "auto", "micro"])
def test_300_failed_steps_leave_live_tensors_and_models_flat(schedule, one_thread):
    torch.manual_seed(0)
    x, y = torch.randn(6, 6), torch.randint(0, 4, (6,))
    kept = [_Net(False), _Net(True), _Net(True, norms=False)]
    every = [(failure, whole, model) for failure, whole, model in itertools.product(FAILURES, (False, True), kept)
             if whole or failure != "in batch_loss_fn"]
    cases = itertools.cycle(every)
    for failure, whole, model in itertools.islice(cases, 2 * len(every)):  # warm: each model's figures, each case twice
        _failing_step(model, failure, whole, schedule, x, y)
    tensors, models = _live(torch.Tensor), _live(_Net)
    dropped = []
    for i, (failure, whole, model) in enumerate(itertools.islice(cases, 300)):
        if i % 3 == 0:  # a fresh model, dropped after its one failed step
            model = _Net(model.checkpointed, model.norms)
            dropped.append(weakref.ref(model))
        _failing_step(model, failure, whole, schedule, x, y)
        del model
    assert _live(torch.Tensor) <= tensors
    assert _live(_Net) <= models
    assert [r for r in dropped if r() is not None] == []


def test_a_store_on_the_tensors_device_keeps_no_graph_alive():
    """A store given for a model elsewhere (store='cpu' for a CUDA model) keeps the tensors already on its device as
    they are: a saved output among them must not hold its own node, or a graph no backward ran stays alive."""
    from accumnorm._engine.memory.store import Store

    x = torch.randn(4, 3, requires_grad=True)
    with Store(torch.device("cpu")).hooks():
        y = torch.tanh(x * 2)  # tanh's backward keeps its output
    saved = weakref.ref(y)
    del y
    gc.collect()
    assert saved() is None


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("failure in the backward")


@pytest.mark.parametrize("schedule", ["layerwise", "recompute", "segments", "passes", "auto", "micro"])
def test_a_model_whose_step_failed_in_its_backward_is_freed_without_another_backward(schedule):
    """torch runs a CPU backward from a ready queue of the calling thread's own: the nodes that were ready when one
    raised (here the other micro-batches' branches) stay queued, holding their graph and the model, until that
    thread's next backward. The step lets go of them as it fails."""
    torch.manual_seed(0)
    model = _Net(checkpointed=False)
    x, y = torch.randn(6, 6), torch.randint(0, 4, (6,))

    def loss_fn(m, b):
        return F.cross_entropy(_FailsInBackward.apply(m(b[0])), b[1])

    how = dict(bn="micro") if schedule == "micro" else dict(schedule=schedule)
    with pytest.raises(RuntimeError, match="failure in the backward"):
        accumnorm.backward(model, (x, y), loss_fn, micro_batch_size=2, **how)
    assert all(p.grad is None for p in model.parameters())
    dropped = weakref.ref(model)
    del model
    gc.collect()
    assert dropped() is None


class _CountsCalls(nn.Module):
    """Registers a buffer at its first forward (lazy state of a library's module) and counts its calls in it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3))

    def forward(self, x):
        if "calls" not in self._buffers:
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.calls += 1
        return self.net(x)


def test_a_buffer_a_failed_step_registered_is_gone_with_it(schedule_any):
    """The step is a transaction over the model's buffers: one its forward registered goes with a step that fails,
    as the values of those that were there go back."""
    model = _CountsCalls().double()
    x, y = torch.randn(9, 4, dtype=torch.float64), torch.randint(0, 3, (9,))
    before = {k: v.clone() for k, v in model.state_dict().items()}


    with pytest.raises(RuntimeError, match="the forward fails"):
        accumnorm.backward(model, (x, y), failing_below(4), micro_batch_size=4, schedule=schedule_any)
    assert model.state_dict().keys() == before.keys() and "calls" not in model._buffers
    accumnorm.backward(model, (x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]), micro_batch_size=4,
                       schedule=schedule_any)
    assert "calls" in model.state_dict()


class _MakesLayers(nn.Module):
    """Makes a layer and a parameter at its first forward (a library's lazily built head)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh())

    def forward(self, x):
        if "head" not in self._modules:
            self.head = nn.Linear(6, 3).to(x.dtype)
            self.scale = nn.Parameter(torch.ones((), dtype=x.dtype))
        return self.head(self.net(x)) * self.scale


def test_a_layer_and_a_parameter_a_failed_step_made_are_gone_with_it(schedule_any):
    """A failed step left the model with the layer its forward made (a hostile check's BatchNorm made in the forward
    stayed, its counter at 1): the model is as before the step, and the next step makes them again, as torch's
    first forward does."""
    torch.manual_seed(0)
    model = _MakesLayers().double()
    x, y = torch.randn(9, 4, dtype=torch.float64), torch.randint(0, 3, (9,))
    modules, parameters = list(model.named_modules()), list(model.named_parameters())
    with pytest.raises(RuntimeError, match="the forward fails"):
        accumnorm.backward(model, (x, y), failing_below(4), micro_batch_size=4, schedule=schedule_any)
    assert list(model.named_modules()) == modules and list(model.named_parameters()) == parameters
    accumnorm.backward(model, (x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]), micro_batch_size=4,
                       schedule=schedule_any)
    assert "head" in model._modules and "scale" in model._parameters and model.head.weight.grad is not None
