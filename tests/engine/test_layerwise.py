"""The layerwise schedule's driver: every micro-batch's loss_fn runs once, as written, on the caller's thread, in
its own state; nothing is replayed, so nothing goes stale; errors name their micro-batch and leave nothing alive."""
from __future__ import annotations

import contextvars
import copy
import gc
import threading
import weakref

import greenlet
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.overrides import TorchFunctionMode

import accumnorm
from helpers import EXACT_SCHEDULES, assert_unchanged, ce_loss, compare, rel_err, snapshot, whole_batch
from models import data, resnet


@pytest.mark.realtime
def test_loss_fn_runs_once_per_micro_batch_on_the_callers_thread():
    model = resnet(nn.Tanh).double()
    batch = data((1, 8, 8), 10, torch.float64)
    seen = []

    def loss_fn(m, b):
        seen.append((threading.get_ident(), torch.get_num_threads(), len(b[0])))
        return ce_loss(m, b)

    accumnorm.backward(model, batch, loss_fn, micro_batch_size=3, schedule="layerwise")
    assert seen == [(threading.get_ident(), torch.get_num_threads(), n) for n in (3, 3, 3, 1)]


def padded(bn: bool) -> nn.Sequential:
    """torch's and torchvision's modules only, with a tuple (ZeroPad2d.padding) and a list (Permute.dims) that their
    forwards read, and a head that sees where each value went: what a replayed graph would bake in."""
    return nn.Sequential(nn.ZeroPad2d((1, 1, 1, 1)), nn.Conv2d(2, 4, 3), torchvision.ops.misc.Permute([0, 1, 2, 3]),
                         nn.BatchNorm2d(4) if bn else nn.Identity(), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))


@pytest.mark.parametrize("bn", [True, False], ids=["batchnorm", "no-batchnorm"])
def test_attributes_changed_between_steps_take_effect(schedule, bn):
    """Tuples and lists set between steps (torchvision's Permute.dims, a padding) are what the next step runs, with
    or without BatchNorm: every step equals whole-batch torch with the same attributes."""
    model = padded(bn).double()
    ref = copy.deepcopy(model)
    batch = data((2, 6, 6), 8, torch.float64)
    changes = [{}, {(0, "padding"): (2, 0, 0, 2)}, {(2, "dims"): [0, 1, 3, 2]}, {(0, "padding"): (0, 2, 2, 0)}]
    for change in changes:
        for m in (model, ref):
            for (index, name), value in change.items():
                setattr(m[index], name, value)
            m.zero_grad(set_to_none=True)
        expected = whole_batch(ref, batch)
        loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=3, schedule=schedule)
        assert rel_err(loss, expected) < 1e-12, change
        compare(ref, model, 1e-9)


class Recurrent(nn.Module):
    """Python control flow fx cannot trace: a loop over .item() and a list of blocks chosen by an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Tanh()) for _ in range(3))
        self.head, self.depth = nn.Linear(6, 10), 2

    def forward(self, x):
        steps = int(x.new_tensor(self.depth).item())
        for block in self.blocks[:steps]:
            x = x + block(x)
        return self.head(x)


def test_data_dependent_python_control_flow_runs_as_written(schedule):
    model = Recurrent().double()
    ref = copy.deepcopy(model)
    batch = data((6,), 9, torch.float64)
    for depth in (2, 3):
        model.depth = ref.depth = depth
        model.zero_grad(set_to_none=True), ref.zero_grad(set_to_none=True)
        expected = whole_batch(ref, batch)
        loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule=schedule)
        assert rel_err(loss, expected) < 1e-12
        compare(ref, model, 1e-9)


class Counting(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_each_micro_batchs_state_stays_its_own():
    """loss_fn enters no_grad (a teacher in train mode), autocast, saved-tensor hooks and a TorchFunctionMode
    around BatchNorm calls: each micro-batch runs in its own, the step in the caller's, and the result is whole-
    batch torch's with the same loss_fn."""
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 10)).double()
    student = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 10)).double()
    model = nn.ModuleDict({"teacher": teacher, "student": student})
    ref = copy.deepcopy(model)
    counted = []

    def loss_fn(m, b):
        x, y = b
        with torch.no_grad():
            soft = m["teacher"](x).softmax(-1)
        assert torch.is_grad_enabled()
        with torch.autograd.graph.save_on_cpu(), Counting() as counting, torch.autocast("cpu", enabled=False):
            logits = m["student"](x)
        counted.append(counting.calls)
        return F.cross_entropy(logits, y) + F.cross_entropy(logits, soft)

    batch = data((6,), 8, torch.float64)
    expected = whole_batch(ref, batch, loss_fn)
    counted.clear()
    hooks_before = torch._C._autograd._top_saved_tensors_default_hooks(False)
    loss = accumnorm.backward(model, batch, loss_fn, micro_batch_size=2, schedule="layerwise")
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)  # the teacher's running statistics too: updated once, with the whole batch
    assert counted == [counted[0]] * 4 and counted[0] > 0  # each mode saw its own micro-batch's calls only
    assert torch.is_grad_enabled() and torch._C._len_torch_function_stack() == 0
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) == hooks_before


def test_the_callers_context_variables_reach_loss_fn():
    var = contextvars.ContextVar("run", default="unset")
    var.set("experiment 7")
    seen = []
    accumnorm.backward(resnet(nn.Tanh), data((1, 8, 8), 6), lambda m, b: seen.append(var.get()) or ce_loss(m, b),
                       micro_batch_size=2)
    assert seen == ["experiment 7"] * 3


def _live_coroutines() -> int:
    gc.collect()
    return sum(issubclass(type(o), greenlet.greenlet) and not o.dead and o is not greenlet.getcurrent()
               for o in gc.get_objects())


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_error_names_its_micro_batch_and_leaves_nothing_alive(schedule, error):
    model = resnet(nn.Tanh)
    batch = data((1, 8, 8), 8)
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule=schedule)
    snap = snapshot(model)
    x = batch[0].clone()
    alive = weakref.ref(x)
    third = x[4:6].data_ptr()

    def loss_fn(m, b):
        if b[0].data_ptr() == third:
            raise error("bad sample")
        return ce_loss(m, b)

    with pytest.raises(error, match="bad sample") as raised:
        accumnorm.backward(model, (x, batch[1]), loss_fn, micro_batch_size=2, schedule=schedule)
    if schedule == "layerwise":
        assert "micro-batch 2" in "".join(getattr(raised.value, "__notes__", []))
    assert_unchanged(model, snap)
    del raised, x
    assert _live_coroutines() == 0
    gc.collect()
    assert alive() is None  # nothing of the step holds the batch


class Shrinking(nn.Module):
    """The short last micro-batch takes every other column: its BatchNorm input has another shape."""

    def __init__(self) -> None:
        super().__init__()
        self.bn, self.head = nn.BatchNorm1d(4), nn.Linear(4, 10)

    def forward(self, x):
        x = x.unsqueeze(-1).expand(-1, -1, 6)
        x = x[..., ::2] if len(x) < 3 else x
        return self.head(self.bn(x).mean(-1))


def test_a_mismatch_names_what_differs_and_which_micro_batch(schedule):
    model = Shrinking()
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r"micro-batch 2 differs in its input's shape past the batch dimension "
                                         r"\(\(4, 3\) against \(4, 6\)\) where micro-batch 0 made BatchNorm1d bn"):
        accumnorm.backward(model, data((4,), 8), ce_loss, micro_batch_size=3, schedule=schedule)
    assert_unchanged(model, snap)


def test_hooks_and_side_effects_run_once_per_micro_batch(schedule):
    model = resnet(nn.Tanh)
    bn = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    calls = {"hook": 0, "pre": 0}
    bn.register_forward_hook(lambda *a: calls.__setitem__("hook", calls["hook"] + 1))
    bn.register_forward_pre_hook(lambda *a: calls.__setitem__("pre", calls["pre"] + 1))
    accumnorm.backward(model, data((1, 8, 8), 8), ce_loss, micro_batch_size=2, schedule=schedule)
    if schedule == "layerwise":
        assert calls == {"hook": 4, "pre": 4}
    elif schedule == "recompute":  # once per micro-batch, and once more in a checkpointed region's recomputation
        assert calls["pre"] == calls["hook"] in (4, 8)
    else:  # passes runs each micro-batch's forward more than once, some only up to this layer
        assert calls["pre"] > 4 and calls["hook"] >= 4


def test_a_model_with_a_forward_of_its_own_instance():
    model = resnet(nn.Tanh).double()
    ref = copy.deepcopy(model)
    model.forward = lambda x: type(model).forward(model, x) * 2
    batch = data((1, 8, 8), 6, torch.float64)
    expected = whole_batch(ref, batch, lambda m, b: F.cross_entropy(m(b[0]) * 2, b[1]))
    for schedule in EXACT_SCHEDULES:
        ours = copy.deepcopy(model)
        ours.forward = lambda x, ours=ours: type(ours).forward(ours, x) * 2
        loss = accumnorm.backward(ours, batch, ce_loss, micro_batch_size=2, schedule=schedule)
        assert rel_err(loss, expected) < 1e-12
