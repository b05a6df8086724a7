"""The layerwise schedule's torch.fx path: a model that traces runs on the caller's thread from its graph; one
whose Python a graph would not replay (its own unmarked modules, a custom autograd.Function, a grad-mode switch,
side effects, hooks, data-dependent branches) runs in the worker threads. Either way: whole-batch torch's result.

Where a model ran is seen from a forward hook on a leaf module (a leaf runs as itself in the graph too).
"""
from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

import accumnorm
from helpers import EXACT_SCHEDULES, ce_loss, compare, schedule_named, whole_batch
from models import data, timm_model, torchvision_model


def ran_on(model: nn.Module, leaf: nn.Module, batch, micro: int = 2, loss_fn=ce_loss) -> set[str]:
    """accumnorm.backward(schedule="layerwise") on model; the names of the threads `leaf` ran on."""
    threads: set[str] = set()
    handle = leaf.register_forward_hook(lambda *_: threads.add(threading.current_thread().name))
    try:
        accumnorm.backward(model, batch, loss_fn, micro_batch_size=micro, schedule="layerwise")
    finally:
        handle.remove()
    return threads


def exact_on(build, batch, micro: int = 2, loss_fn=ce_loss, leaf=lambda m: m.head) -> set[str]:
    """Whole-batch torch against layerwise on a copy, float64 to 1e-9; where the copy's `leaf` ran."""
    model = build().double()
    ours = copy.deepcopy(model)
    whole_batch(model, batch, loss_fn)
    threads = ran_on(ours, leaf(ours), batch, micro, loss_fn)
    compare(model, ours, 1e-9)
    return threads


CALLER = {threading.current_thread().name}


@pytest.mark.parametrize("build", [
    lambda: torchvision_model("resnet18"),
    lambda: torchvision_model("mobilenet_v3_small"),
    lambda: timm_model("lcnet_035"),
    lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.LazyLinear(10)),
], ids=["resnet18", "mobilenet_v3_small", "timm-lcnet_035", "sequential"])
def test_library_models_run_from_their_graph_on_the_callers_thread(build):
    model = build()
    conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    assert ran_on(model, conv, data((3, 32, 32), 6)) == CALLER


@accumnorm.trace_safe
class Marked(nn.Module):
    """A user's module declared trace_safe; `body` decides what its forward does."""

    def __init__(self, body=lambda self, h: h) -> None:
        super().__init__()
        self.stem, self.bn, self.head = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 10)
        self.body = body

    def forward(self, x):
        return self.head(torch.tanh(self.body(self, self.bn(self.stem(x)))))


class Unmarked(Marked):
    """The same forward, not declared trace_safe (and not from a library accumnorm trusts)."""


def test_a_module_declared_trace_safe_runs_from_its_graph_and_an_unmarked_one_in_threads():
    batch = data((6,), 8, torch.float64)
    assert exact_on(Marked, batch) == CALLER
    threads = exact_on(Unmarked, batch)
    assert len(threads) == 4 and CALLER.isdisjoint(threads)  # one worker per micro-batch


class Reverse(torch.autograd.Function):
    """Gradient reversal: a backward of its own, which a graph of the forward's tensor operations would lose."""

    @staticmethod
    def forward(ctx, h):  # type: ignore[override]
        return h.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return -grad


def _no_grad_scale(self, h):
    with torch.no_grad():  # per sample: a scale that couples no samples and carries no gradient
        s = h.abs().mean(1, keepdim=True)
    return h / (1 + s)


def _tensor_dependent(self, h):
    return h * 2 if self.stem.weight.sum() > 0 else h - 1  # a branch on a tensor's value


@pytest.mark.parametrize("body", [
    lambda self, h: Reverse.apply(h),
    _no_grad_scale,
    _tensor_dependent,
], ids=["autograd.Function", "no_grad-inside", "tensor-dependent-branch"])
def test_what_a_graph_would_not_replay_runs_in_threads_and_stays_exact(body):
    threads = exact_on(lambda: Marked(body), data((6,), 8, torch.float64))
    assert len(threads) == 4 and CALLER.isdisjoint(threads)


def test_python_side_effects_and_hooks_run_once_per_micro_batch():
    calls = []

    def counting(self, h):
        self.calls = getattr(self, "calls", 0) + 1  # a side effect on the module: found while tracing
        return h

    model = Marked(counting)
    threads = ran_on(model, model.head, data((6,), 8))
    assert len(threads) == 4 and model.calls == 4  # as plain accumulation: once per micro-batch, none when tracing

    model = nn.Sequential(nn.Linear(6, 8), nn.Sequential(nn.BatchNorm1d(8), nn.Tanh()), nn.Linear(8, 10))
    model[1].register_forward_hook(lambda *_: calls.append(1))  # a graph would go through model[1], not call it
    threads = ran_on(model, model[2], data((6,), 8))
    assert len(threads) == 4 and len(calls) == 4


def test_a_changed_attribute_or_argument_is_traced_again():
    """A trace bakes in plain attributes and non-tensor arguments: each step must see the current ones."""

    @accumnorm.trace_safe
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.bn, self.scale = nn.Linear(6, 10), nn.BatchNorm1d(10), 2.0

        def forward(self, x, shift: float = 0.0):
            return self.bn(self.lin(x)) * self.scale + shift

    model = Scaled().double()
    ours = copy.deepcopy(model)
    batch = data((6,), 8, torch.float64)
    for scale, shift in [(2.0, 0.0), (3.0, 0.0), (3.0, 1.0), (2.0, 0.0)]:
        model.scale = ours.scale = scale

        def loss_fn(m, b, shift=shift):
            return F.cross_entropy(m(b[0], shift=shift), b[1]) + m(b[0], shift).square().mean()

        model.zero_grad()
        ours.zero_grad()
        whole_batch(model, batch, loss_fn)
        assert ran_on(ours, ours.lin, batch, loss_fn=loss_fn) == CALLER
        compare(model, ours, 1e-9)


def _hidden_batch_norm(h):
    return F.batch_norm(h, None, None, None, None, True)


torch.fx.wrap("_hidden_batch_norm")  # one graph node that makes a BatchNorm call the graph cannot see


def test_a_batchnorm_call_hidden_in_a_graph_node_restarts_the_step_in_threads():
    model = Marked(lambda self, h: _hidden_batch_norm(h)).double()
    ours = copy.deepcopy(model)
    batch = data((6,), 8, torch.float64)
    for _ in range(2):  # the second step knows at once
        model.zero_grad()
        ours.zero_grad()
        whole_batch(model, batch)
        threads = ran_on(ours, ours.head, batch)
        assert CALLER.isdisjoint(threads) and len(threads) == 4
        compare(model, ours, 1e-9)


def grads_in_every_schedule(model: nn.Module, batch, loss_fn=ce_loss, micro: int = 3, seed: int = 5,
                            rtol: float = 1e-10, atol: float = 1e-12):
    """One step of `model` under each of EXACT_SCHEDULES from the same seed: the layerwise ones' gradients are
    checked equal to passes' (the same random numbers); returns the threads each layerwise one's first layer
    ran on."""
    grads, threads = {}, {}
    for name in EXACT_SCHEDULES:
        ours = copy.deepcopy(model)
        torch.manual_seed(seed)
        with schedule_named(name) as schedule:
            if schedule == "layerwise":
                threads[name] = ran_on(ours, ours[0], batch, micro, loss_fn)
            else:
                accumnorm.backward(ours, batch, loss_fn, micro_batch_size=micro, schedule=schedule)
        grads[name] = [p.grad for p in ours.parameters()]
    for name in ("layerwise", "layerwise-threads"):
        for g, want in zip(grads[name], grads["passes"]):
            torch.testing.assert_close(g, want, rtol=rtol, atol=atol)
    return threads


def test_dropout_draws_the_same_masks_from_the_graph_as_in_threads_and_passes():
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.3),
                          nn.Linear(16, 10)).double()
    threads = grads_in_every_schedule(model, data((6,), 12, torch.float64))
    assert threads["layerwise"] == CALLER and CALLER.isdisjoint(threads["layerwise-threads"])


def test_tensor_constants_of_the_trace_stay_off_the_model():
    def plus_constant(self, h):
        return h + torch.tensor([0.5] * 8, dtype=h.dtype)

    model = Marked(plus_constant).double()
    names = set(vars(model))
    assert exact_on(lambda: model, data((6,), 8, torch.float64)) == CALLER
    assert set(vars(model)) == names


def test_loss_fn_before_the_model_call_draws_the_same_random_numbers_in_every_schedule():
    """On the traced path the part of loss_fn before the model call runs again: it must draw the same noise,
    and what comes after (the model's dropout, the loss's noise) must go on from there, as in one run."""
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.4), nn.Linear(16, 10)).double()

    def noisy(m, b):
        x = b[0] + 0.1 * torch.randn_like(b[0])  # an augmentation
        return ce_loss(m, (x, b[1])) * (1 + torch.rand((), dtype=x.dtype))  # drawn after the model's dropout

    threads = grads_in_every_schedule(model, data((6,), 12, torch.float64), noisy, seed=7)
    assert threads["layerwise"] == CALLER and CALLER.isdisjoint(threads["layerwise-threads"])


@pytest.mark.parametrize("loss_fn", [
    lambda m, b: ce_loss(m[1:], (m[0](b[0]), b[1])),  # the model's parts, not the model
    lambda m, b: F.cross_entropy(F.batch_norm(m(b[0]), None, None, training=True), b[1]),  # a BN call after it
], ids=["model-parts", "batch-norm-in-loss_fn"])
def test_a_loss_fn_the_traced_path_cannot_run_goes_to_threads_and_stays_exact(loss_fn):
    build = lambda: nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 10))  # noqa: E731
    threads = exact_on(build, data((6,), 8, torch.float64), loss_fn=loss_fn, leaf=lambda m: m[0])
    assert len(threads - CALLER) == 4  # after a start on the caller's thread, given up before the backward


def test_micro_batches_calling_the_model_a_different_number_of_times_are_refused():
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 10))
    loss_fn = lambda m, b: ce_loss(m, b) + (m(b[0]).mean() if len(b[0]) == 2 else 0)  # noqa: E731
    with pytest.raises(ValueError, match="call the model as often"):
        accumnorm.backward(model, data((6,), 8), loss_fn, micro_batch_size=3, schedule="layerwise")


def test_the_graph_runs_in_the_modes_loss_fn_calls_the_model_in():
    """A teacher pass under no_grad and a student pass under autocast, both inside loss_fn: the graph runs
    outside loss_fn, and must take each call's grad and autocast modes (no gradient through the teacher)."""
    def distill(m, b):
        with torch.no_grad():
            teacher = m(b[0])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            student = m(b[0])
        assert not teacher.requires_grad and student.dtype == torch.bfloat16
        return ce_loss(m, b) + F.mse_loss(student.float(), teacher)

    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 10))
    # bf16 rounding differs between schedules (1e-4); a gradient through the teacher would be O(1) off
    threads = grads_in_every_schedule(model, data((6,), 8), distill, micro=2, rtol=1e-2, atol=1e-4)
    assert threads["layerwise"] == CALLER and CALLER.isdisjoint(threads["layerwise-threads"])
