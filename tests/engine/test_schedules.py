"""Both schedules of `accumnorm.backward(bn="exact")` against the oracle, whole-batch PyTorch, on models as
people have them: unconverted torch, torchvision and timm models, SyncBatchNorm, direct F.batch_norm calls.

schedule="layerwise" runs the micro-batches in lockstep and reduces at every BatchNorm call; schedule="passes"
is the 2L+1-pass schedule. Both must leave .grad and every running statistic as one forward/backward of the
whole batch through plain PyTorch does: float64 to 1e-9 with smooth activations (ReLU's kink and max-pool's
ties let rounding switch a gradient path), float32 to 1e-3 against float64 whole-batch torch, or to 4x torch's
own float32 error where that is larger (mobilenet_v3_small's running means at batch 6: torch itself is 4e-3 off).
"""
from __future__ import annotations

import copy
import random
import re
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import accumnorm
from helpers import (
    EXACT_SCHEDULES,
    assert_ranks_ended_well,
    assert_unchanged,
    ce_loss,
    compare,
    compare_within_rounding,
    launch_ranks,
    rel_err,
    snapshot,
    whole_batch,
)
from models import (
    MODELS,
    SMOOTH_FAMILIES,
    FunctionalBN,
    Shared,
    data,
    residual_batch,
    residual_net,
    resnet,
    smooth,
    timm_model,
    torchvision_model,
    vgg,
)

LOSS_TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
IMAGE = (3, 32, 32)


def check(model: nn.Module, batch, micro: int, schedule: str, tol: float, **kwargs) -> nn.Module:
    """Whole-batch torch on `model` against accumnorm on a copy of it; returns the copy.

    The copy is not converted, and must still not be afterwards: exact mode takes the model as it is.
    In float32 the oracle is float64 whole-batch torch, and torch's own float32 error sets the scale.
    """
    ours, truth = copy.deepcopy(model), copy.deepcopy(model).double()
    types = [type(m) for m in ours.modules()]
    expected = whole_batch(model, batch)
    loss = accumnorm.backward(ours, batch, ce_loss, micro_batch_size=micro, schedule=schedule, **kwargs)
    assert [type(m) for m in ours.modules()] == types
    if batch[0].dtype == torch.float64:
        compare(model, ours, tol)
    else:
        whole_batch(truth, (batch[0].double(), *batch[1:]))
        compare_within_rounding(truth, model, ours, tol, slack=4)
    assert rel_err(loss, expected) < LOSS_TOL[batch[0].dtype]
    return ours


def no_dropout(model: nn.Module) -> nn.Module:
    """Dropout modules in eval mode: whole-batch torch cannot draw the masks the micro-batches draw."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.eval()
    return model


# --- real networks --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small"])
def test_torchvision_float64_smooth(name, schedule):
    model = no_dropout(smooth(torchvision_model(name))).double()
    check(model, data(IMAGE, 4, torch.float64), 2, schedule, 1e-9)


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small"])
def test_torchvision_float32(name, schedule):
    """As torchvision builds them: ReLU, Hardswish, max-pool, float32."""
    check(no_dropout(torchvision_model(name)), data(IMAGE, 6), 3, schedule, 1e-3)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-3)])
def test_timm_batchnormact_matches_whole_batch(schedule, dtype, tol):
    """timm's lcnet_035: 27 BatchNormAct2d layers (a BatchNorm2d subclass calling F.batch_norm, then an act)."""
    from timm.layers import BatchNormAct2d

    model = timm_model("lcnet_035")
    assert sum(isinstance(m, BatchNormAct2d) for m in model.modules()) == 27
    if dtype == torch.float64:
        smooth(model)
    check(model.to(dtype), data(IMAGE, 6, dtype), 2, schedule, tol)


# --- every kind of batch-norm call, unconverted ----------------------------------------------------

@pytest.mark.parametrize("name", list(MODELS))
def test_unconverted_torch_models_float64_smooth(name, schedule):
    check(SMOOTH_FAMILIES[name]().double(), data(MODELS[name][1], 11, torch.float64), 3, schedule, 1e-9)


@pytest.mark.parametrize("name", list(MODELS))
def test_unconverted_torch_models_float32(name, schedule):
    build, shape = MODELS[name]
    check(build(), data(shape, 13), 4, schedule, 1e-3)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_oracle_check_catches_micro_batch_statistics(dtype):
    """Sanity of `check`: plain accumulation (bn="micro") is far from whole-batch BatchNorm in either dtype."""
    with pytest.raises(AssertionError):
        check(resnet(nn.Tanh).to(dtype), data((1, 12, 12), 12, dtype), 3, "auto", 1e-3, bn="micro")


def test_sync_batchnorm_without_process_group(schedule):
    model = nn.SyncBatchNorm.convert_sync_batchnorm(resnet(nn.Tanh)).double()
    assert any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())
    check(model, data((1, 12, 12), 10, torch.float64), 3, schedule, 1e-9)


def test_direct_functional_batch_norm_calls(schedule):
    """F.batch_norm(training=True) with the module's own buffers (momentum 0.3), and with none."""
    ours = check(FunctionalBN().double(), data((1, 8, 8), 10, torch.float64), 3, schedule, 1e-9)
    assert not torch.equal(ours.running_mean, torch.zeros_like(ours.running_mean))  # the update happened


@pytest.mark.parametrize("momentum", [0.1, None])
def test_layer_called_twice_and_cumulative_average(schedule, momentum):
    """momentum=None is torch's cumulative average, 1/num_batches_tracked: two calls, two updates."""
    model = Shared(momentum).double()
    model.bn.num_batches_tracked.fill_(3)  # a cumulative average part-way through training
    ours = check(model, data((1, 8, 8), 10, torch.float64), 4, schedule, 1e-9)
    assert int(ours.bn.num_batches_tracked) == 5


class WarmupBN(nn.BatchNorm2d):
    """momentum=None, with a factor of its own: a cumulative average for 10 calls, then 0.1."""

    def forward(self, x):
        self.num_batches_tracked.add_(1)
        factor = max(0.1, 1.0 / float(self.num_batches_tracked))
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, True, factor, self.eps)


class SuperBN(nn.BatchNorm2d):
    """momentum=None through torch's own forward."""

    def forward(self, x):
        return super().forward(x) * 1.0


@pytest.mark.parametrize("layer,tracked,outcome", [(WarmupBN, 20, "refused"), (WarmupBN, 0, "exact"),
                                                   (SuperBN, 20, "exact")])
def test_a_subclass_with_momentum_none_and_a_factor_of_its_own_is_refused(schedule_any, layer, tracked, outcome):
    """The step gives momentum=None the whole batch's 1/num_batches_tracked; a forward that computes another factor
    (which would differ for the whole batch) is refused with nothing changed; one that agrees is exact. (Passes runs
    each forward 2L + 1 times, counted each time: a factor of its own that agrees with torch's only on the first
    calls may be refused there.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), layer(4, momentum=None), nn.Tanh(), nn.Flatten(),
                          nn.Linear(144, 10)).double()
    model[1].num_batches_tracked.fill_(tracked)
    batch = data((1, 8, 8), 10, torch.float64)
    refusal = r"momentum=None, but its forward moved the running statistics by 0\.1 .*Nothing was changed"
    if outcome == "exact" and (schedule_any != "passes" or layer is SuperBN):
        check(model, batch, 2, schedule_any, 1e-9)
        return
    ours = copy.deepcopy(model)
    snap = snapshot(ours)
    try:
        accumnorm.backward(ours, batch, ce_loss, micro_batch_size=2, schedule=schedule_any)
    except ValueError as e:
        assert re.search(refusal, str(e)), e
        assert_unchanged(ours, snap)
        return
    assert outcome == "exact", "not refused"
    check(model, batch, 2, schedule_any, 1e-9)


def test_accumnorm_and_torch_layers_in_one_model(schedule):
    model = resnet(nn.Tanh).double()
    model[3] = accumnorm.convert(model[3])  # one block with accumnorm's layers, the rest torch's
    assert isinstance(model[3].bn1, accumnorm.BatchNorm2d) and type(model[1]) is nn.BatchNorm2d
    check(model, data((1, 12, 12), 10, torch.float64), 3, schedule, 1e-9)


def test_fine_tuning_setups(schedule):
    """BN on the raw input (nothing below it learns), frozen BN affine parameters, a BN kept in eval mode."""
    model = nn.Sequential(nn.BatchNorm2d(1), vgg(nn.Tanh)).double()
    body = model[1]
    body[1].weight.requires_grad_(False), body[1].bias.requires_grad_(False)
    body[5].eval()  # frozen statistics: normalizes with its running stats, couples no samples
    check(model, data((1, 16, 16), 9, torch.float64), 2, schedule, 1e-9)


class _UnusedBranch(nn.Module):
    """A residual block that also runs a branch of two BatchNorm calls whose output no loss uses (a probe)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.unused = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.Tanh(),
                                    nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c))
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)

    def forward(self, x):
        h = torch.tanh(self.bn1(self.conv1(x)))
        self.unused(h)
        return x + self.bn2(self.conv2(h))


def test_a_branch_no_loss_reaches_keeps_its_gradients_none(schedule):
    """The unused branch's parameters keep .grad None, as whole-batch torch leaves them (an optimizer skips them; a
    gradient of zeros would move them under weight decay). Its BatchNorm calls, in the bottom half of the passes'
    calls or of a segments region's, get no correction pass: none of their backwards ran. Ten blocks, so that the
    blocks are recompute's and segments' regions."""
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), *[_UnusedBranch(4) for _ in range(10)],
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10)).double()
    ours = check(model, data((1, 6, 6), 8, torch.float64), 2, schedule, 1e-9)
    assert all(p.grad is None for n, p in ours.named_parameters() if ".unused." in n)


def _clamped(seen: list) -> Callable[[torch.Tensor], torch.Tensor]:
    def clamp(g: torch.Tensor) -> torch.Tensor:  # not linear: a clamp of each part of a gradient is not one of its sum
        seen.append(g)
        return g.clamp(-1e-3, 1e-3)
    return clamp


@pytest.mark.parametrize("hook", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_hook_on_a_parameters_gradient_sees_the_whole_batchs_or_the_step_is_refused(schedule_any, hook):
    """Whole-batch torch calls such a hook once, with all of the gradient. Layerwise and recompute back-propagate each
    micro-batch once and do the same; passes and segments back-propagate each several times, and are refused before
    anything changes, naming the parameter ("auto" runs layerwise here)."""
    model = vgg(nn.Tanh).double()
    batch = data((1, 12, 12), 8, torch.float64)
    ref, ours = model, copy.deepcopy(model)
    seen, seen_ref = [], []
    if hook == "register_hook":
        ours[4].weight.register_hook(_clamped(seen)), ref[4].weight.register_hook(_clamped(seen_ref))
    else:
        ours[4].weight.register_post_accumulate_grad_hook(seen.append)
        ref[4].weight.register_post_accumulate_grad_hook(seen_ref.append)
    if schedule_any in ("passes", "segments"):
        before = snapshot(ours)
        with pytest.raises(ValueError, match=f"{schedule_any} schedule back-propagates each micro-batch several "
                                             "times.*parameter 4.weight.*Nothing was changed"):
            accumnorm.backward(ours, batch, ce_loss, micro_batch_size=2, schedule=schedule_any)
        assert_unchanged(ours, before)
        assert not seen
        return
    expected = whole_batch(ref, batch)
    loss = accumnorm.backward(ours, batch, ce_loss, micro_batch_size=2, schedule=schedule_any)
    assert len(seen) == len(seen_ref) == 1
    assert rel_err(loss, expected) < 1e-12
    compare(ref, ours, 1e-9)


def test_auto_never_runs_passes_or_segments_with_a_hook_on_a_parameters_gradient():
    """A budget only passes fits: refused, saying why each schedule could not run, before anything changes."""
    model = vgg(nn.Tanh).double()
    batch = data((1, 12, 12), 8, torch.float64)
    model[4].weight.register_hook(lambda g: g.clamp(-1e-3, 1e-3))
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    before = snapshot(model)
    with pytest.raises(ValueError, match="no schedule can run this step exactly within the memory budget.*layerwise "
                                         "would keep more than.*the segments schedule back-propagates.*the passes "
                                         "schedule back-propagates.*Nothing was changed"):
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, memory_budget=grads + 1024)
    assert_unchanged(model, before)


@pytest.mark.parametrize("build", [lambda: resnet(nn.Tanh), FunctionalBN], ids=["resnet", "functional"])
def test_split_invariance_across_schedules(build):
    """Micro-batches of 1, 2, 5 and the whole batch, under both schedules: all one result, the oracle's."""
    model = build().double()
    batch = data((1, 8, 8), 10, torch.float64)
    for schedule in EXACT_SCHEDULES:
        for micro in (1, 2, 5, 10):
            check(copy.deepcopy(model), batch, micro, schedule, 1e-9)


@pytest.mark.parametrize("store", [None, "cpu", torch.device("cpu")])
def test_store_on_the_host_changes_nothing_computed(store):
    model = resnet(nn.Tanh).double()
    ref = copy.deepcopy(model)
    batch = data((1, 12, 12), 8, torch.float64)
    accumnorm.backward(ref, batch, ce_loss, micro_batch_size=3, schedule="layerwise")
    ours = check(model, batch, 3, "layerwise", 1e-9, store=store)
    for p, q in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.cuda
@pytest.mark.parametrize("store", [None, "cuda"])
def test_on_cuda_the_pinned_host_store_is_as_exact_as_the_device(store):
    """store=None on CUDA: copies to pinned host memory on a side stream, fetched back ahead in the backward."""
    model = resnet(nn.Tanh).double().cuda()
    batch = tuple(t.cuda() for t in data((1, 12, 12), 8, torch.float64))
    check(model, batch, 2, "layerwise", 1e-9, store=store)


@pytest.mark.cuda
def test_the_pinned_host_store_gives_every_saved_tensor_back_in_any_order_and_twice():
    from accumnorm._engine.memory.store import Store

    x = torch.randn(256, 256, device="cuda", dtype=torch.float64, requires_grad=True)
    with Store(torch.device("cpu")).hooks():
        ys = [(x * (i + 1)).sin() for i in range(10)]  # each sin saves its own input, on the device
    loss = sum(y.sum() for y in ys[::2]) + sum(y.sum() for y in ys[1::2])  # the backward in another order
    expected = sum((i + 1) * (x * (i + 1)).cos() for i in range(10))
    for retain in (True, False):  # a second backward over the same graph fetches every tensor again
        (grad,) = torch.autograd.grad(loss, x, retain_graph=retain)
        torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)


def test_auto_is_layerwise_on_an_ordinary_model_and_says_nothing():
    model = resnet(nn.Tanh).double()
    layerwise = copy.deepcopy(model)
    batch = data((1, 12, 12), 8, torch.float64)
    accumnorm.backward(layerwise, batch, ce_loss, micro_batch_size=3, schedule="layerwise")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auto = check(model, batch, 3, "auto", 1e-9)
    for p, q in zip(layerwise.parameters(), auto.parameters()):
        assert torch.equal(p.grad, q.grad)


class Counting(TorchFunctionMode):
    """A caller's TorchFunctionMode (a profiler, a FLOP counter) around the step: it sees every call."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.convs += func is F.conv2d
        return func(*args, **(kwargs or {}))


def test_layerwise_runs_inside_the_callers_modes_and_stays_exact():
    """The micro-batches run on the caller's thread: a TorchFunctionMode and a TorchDispatchMode around the step
    see every micro-batch's calls, and nothing falls back to passes."""
    from torch.utils.flop_counter import FlopCounterMode

    ref = resnet(nn.Tanh).double()
    ours = copy.deepcopy(ref)
    batch = data((1, 12, 12), 8, torch.float64)
    with Counting() as alone:
        expected = whole_batch(ref, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Counting() as counting, FlopCounterMode(display=False) as flops:
            loss = accumnorm.backward(ours, batch, ce_loss, micro_batch_size=3, schedule="layerwise")
    assert counting.convs == alone.convs * 3  # three micro-batches, each conv once
    assert flops.get_total_flops() > 0
    compare(ref, ours, 1e-9)
    assert rel_err(loss, expected) < 1e-12


class DropBN(nn.Module):
    """Dropout before and after BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.Dropout(0.3), nn.BatchNorm2d(8), nn.Tanh(),
                                 nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Tanh(), nn.Dropout2d(0.3),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    def forward(self, x):
        return self.net(x)


def test_dropout_schedules_draw_the_same_masks():
    """Each micro-batch has its own generator state, the same in both schedules: they agree to rounding."""
    model = DropBN().double()
    batch = data((1, 8, 8), 10, torch.float64)
    results = {}
    for schedule, seed in [("layerwise", 7), ("passes", 7), ("layerwise", 8)]:
        m = copy.deepcopy(model)
        torch.manual_seed(seed)
        loss = accumnorm.backward(m, batch, ce_loss, micro_batch_size=3, schedule=schedule)
        results[schedule, seed] = (m, loss)
    (a, loss_a), (b, loss_b), (c, _) = results.values()
    assert rel_err(loss_a, loss_b) < 1e-12
    compare(a, b, 1e-9)
    with pytest.raises(AssertionError):  # another seed draws other masks: the check above can fail
        compare(a, c, 1e-3)



def test_a_step_is_reproducible_bit_for_bit(schedule):
    """Same seed, same step: the lockstep threads take turns, so no thread timing reaches the arithmetic."""
    model = DropBN().double()
    batch = data((1, 8, 8), 10, torch.float64)
    grads = []
    for _ in range(2):
        m = copy.deepcopy(model)
        torch.manual_seed(7)
        accumnorm.backward(m, batch, ce_loss, micro_batch_size=3, schedule=schedule)
        grads.append([p.grad for p in m.parameters()] + list(m.buffers()))
    assert all(torch.equal(a, b) for a, b in zip(*grads))

# --- bad input: a clear error, and nothing changed ----------------------------------------------------

@pytest.fixture
def primed():
    """An unconverted torch model with gradients and running statistics from an earlier step."""
    model = resnet(nn.Tanh)
    batch = data((1, 12, 12), 8)
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=4)
    return model, batch, snapshot(model)


@pytest.mark.parametrize("kwargs,exc,words", [
    ({"schedule": "fast"}, ValueError, ["schedule", "'auto'", "'layerwise'", "'passes'", "'fast'"]),
    ({"schedule": None}, ValueError, ["schedule", "'layerwise'", "None"]),
    ({"schedule": "Layerwise"}, ValueError, ["schedule", "'layerwise'", "'Layerwise'"]),
    ({"store": 3}, TypeError, ["store", "int"]),
    ({"store": "disk"}, ValueError, ["store", "'disk'"]),
    ({"store": "meta"}, ValueError, ["store", "meta", "use None or 'cpu'"]),
    *([({"store": "cuda"}, ValueError, ["store", "cuda", "CUDA available: False"])]
      if not torch.cuda.is_available() else []),
])
def test_bad_schedule_or_store(primed, kwargs, exc, words):
    model, batch, snap = primed
    with pytest.raises(exc) as error:
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, **kwargs)
    assert all(w in str(error.value) for w in words), str(error.value)
    assert_unchanged(model, snap)


class Branchy(nn.Module):
    """Data-dependent control flow: the short last micro-batch skips a BatchNorm call."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.BatchNorm1d(4), nn.BatchNorm1d(4)
        self.lin = nn.Linear(4, 10)

    def forward(self, x):
        x = self.a(x)
        return self.lin(x if x.shape[0] < 3 else self.b(x))


@pytest.mark.parametrize("schedule", ["auto", "layerwise", "recompute", "passes"])
def test_micro_batches_making_different_batchnorm_calls_are_refused(schedule):
    model = Branchy()
    batch = data((4,), 8)
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=4, schedule=schedule)  # 2 x 4: fine
    snap = snapshot(model)
    with pytest.raises(ValueError, match="same BatchNorm (and InstanceNorm )?calls in the same order.*micro-batch 2"):
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=3, schedule=schedule)
    assert_unchanged(model, snap)


def test_non_finite_loss_changes_nothing(primed, schedule):
    model, batch, snap = primed
    def loss_fn(m, b):
        loss = ce_loss(m, b)
        return loss * float("nan") if torch.equal(b[0][0], batch[0][6]) else loss
    with pytest.raises(ValueError, match="not finite"):
        accumnorm.backward(model, batch, loss_fn, micro_batch_size=2, schedule=schedule)
    assert_unchanged(model, snap)


class _FailingBackward(torch.autograd.Function):
    """Identity whose backward raises on its `fail_at`-th call: a failure after some gradients arrived."""

    @staticmethod
    def forward(ctx, x, state):  # type: ignore[override]
        ctx.state = state
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        with ctx.state["lock"]:
            ctx.state["calls"] += 1
            if ctx.state["calls"] == ctx.state["fail_at"]:
                raise RuntimeError("backward broke")
        return grad, None


@pytest.mark.realtime
def test_failure_in_backward_part_way_changes_nothing(primed, schedule):
    model, batch, snap = primed
    state = {"calls": 0, "fail_at": 3, "lock": threading.Lock()}
    def loss_fn(m, b):  # between the stem's BatchNorm and the first block: below it, gradients have arrived
        x, y = b
        h = _FailingBackward.apply(m[:3](x), state)
        return F.cross_entropy(m[3:](h), y)
    with pytest.raises(RuntimeError, match="backward broke"):
        accumnorm.backward(model, batch, loss_fn, micro_batch_size=2, schedule=schedule)
    assert state["calls"] >= 3
    assert_unchanged(model, snap)


class Bomb(nn.Module):
    """Identity whose `fail_at`-th forward raises: a failure between two BatchNorm calls. Its count is changed in
    place, in a list: passes puts a module's attributes back before each run, and a reassigned count would start
    each run again."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.fail_at, self.calls, self.lock = fail_at, [0], threading.Lock()

    def forward(self, x):
        with self.lock:
            self.calls[0] += 1
            if self.calls[0] == self.fail_at:
                raise RuntimeError("bad sample")
        return x


@pytest.mark.realtime
def test_forward_failure_between_batchnorm_calls_neither_hangs_nor_changes_anything(schedule):
    """In lockstep the other micro-batches wait at the next BatchNorm call: they must be released."""
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), Bomb(), nn.Linear(8, 8),
                          nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 10))
    batch = data((4,), 8)
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule=schedule)
    model[3].calls[0], model[3].fail_at = 0, 3  # the third micro-batch's forward fails
    snap, threads = snapshot(model), set(threading.enumerate())
    errors: list[BaseException] = []

    def run() -> None:
        try:
            accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule=schedule)
        except BaseException as e:  # handed to the test's thread
            errors.append(e)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=600)
    assert not worker.is_alive(), "accumnorm.backward hangs after a micro-batch's forward failed"
    assert len(errors) == 1 and "bad sample" in str(errors[0]), errors
    assert_unchanged(model, snap)
    for thread in set(threading.enumerate()) - threads - {worker}:
        thread.join(timeout=600)  # only a guard against a hang: a thread that is ending ends, however slow the machine
    assert not set(threading.enumerate()) - threads - {worker}, "worker threads left running"


@pytest.mark.parametrize("budget", [10**9, 7_000])
def test_auto_under_a_process_group_runs_one_schedule_on_every_rank(tmp_path, budget):
    """tests/programs/auto_ranks.py: two gloo ranks with shards of 7 and 3 samples and one memory budget. Their needs
    differ, and so did their choices: rank 0 stopped layerwise over the budget and started over under recompute
    while rank 1 went on, each then waiting on a collective the other never made. Now each step's schedule is
    agreed on by the ranks before it runs: the same on both, the whole batch's gradient, no hang."""
    program = Path(__file__).parents[1] / "programs" / "auto_ranks.py"
    assert_ranks_ended_well(launch_ranks([str(program), str(tmp_path), str(budget)], tmp_path, wait_s=300))
    ref = residual_net()
    expected = whole_batch(ref, residual_batch())
    schedules = []
    for step in range(3):
        got = [torch.load(tmp_path / f"{step}-{rank}.pt") for rank in range(2)]
        assert got[0]["schedule"] == got[1]["schedule"], got
        schedules.append(got[0]["schedule"])
        for result in got:
            assert rel_err(result["loss"], expected) < 1e-12
            model = residual_net()
            model.load_state_dict(ref.state_dict())  # the buffers moved once per step: gradients only compared
            for p, g in zip(model.parameters(), result["grads"].values()):
                p.grad = g
            compare(ref, model, 1e-9)
    if budget == 10**9:
        assert schedules == ["layerwise"] * 3
    else:
        assert schedules[-1] != "layerwise", schedules


class PythonRandomScale(nn.Module):
    """conv-BN, scaled by a number from Python's random, then a second BatchNorm: a forward that draws outside torch's
    generators, and so differs each time it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.bn2 = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 10)

    def forward(self, x):
        x = self.bn(self.conv(x)) * (1 + random.random())
        return self.head(self.bn2(x).mean((2, 3)))


def test_passes_refuses_a_forward_that_differs_between_its_runs():
    """Passes runs each forward 2L + 1 times and joins what each run gave (statistics, backward sums, the gradient): a
    forward that draws from Python's random gave each run another input to the second call, and the gradient mixed
    them, silently. Each pass's input to its target call, and every call of the full pass, is now checked against
    the first run's: refused, with nothing changed."""
    torch.manual_seed(0)
    model = PythonRandomScale().double()
    batch = data((1, 6, 6), 8, torch.float64)
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="layerwise")
    snap, state = snapshot(model), torch.random.get_rng_state()
    with pytest.raises(ValueError, match=r"micro-batch \d's forward gave BatchNorm call 1 \(BatchNorm2d bn2 over 4 "
                                         r"channels\) another input in a later pass than in its first.*Nothing was "
                                         r"changed"):
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="passes")
    assert_unchanged(model, snap)
    assert torch.equal(torch.random.get_rng_state(), state)


def _loss_with_python_random(model, batch):
    """The loss scaled by a number from Python's random, after the last BatchNorm call: a loss that differs each time
    the forward runs, with every BatchNorm call's input the same."""
    return ce_loss(model, batch) * (1 + random.random())


@pytest.mark.parametrize("whole", [False, True], ids=["loss", "whole-batch-loss"])
def test_passes_refuses_a_loss_that_differs_between_its_runs(whole):
    """Passes takes the backward sums of the top BatchNorm calls from passes of their own and the gradient from its full
    pass: a loss that differs between those runs (Python's random after the last BatchNorm call, which no call's
    input shows) mixed two losses into one gradient, silently. Each complete run's loss (or outputs, with a loss of
    the whole batch) is checked against the first run's: refused, with nothing changed."""
    torch.manual_seed(0)
    model = vgg().double()
    x, y = data((1, 16, 16), 8, torch.float64)
    snap, state = snapshot(model), torch.random.get_rng_state()
    with pytest.raises(ValueError, match=r"micro-batch \d's forward gave another (loss|outputs) in a later pass than "
                                         r"in its first.*Nothing was changed"):
        if whole:
            accumnorm.backward(model, x, micro_batch_size=2, schedule="passes", targets=y,
                               forward_fn=lambda m, b: m(b) * (1 + random.random()), batch_loss_fn=F.cross_entropy)
        else:
            accumnorm.backward(model, (x, y), _loss_with_python_random, micro_batch_size=2, schedule="passes")
    assert_unchanged(model, snap)
    assert torch.equal(torch.random.get_rng_state(), state)


class _StraightThrough(nn.Module):
    """A hard one-hot forward whose gradient is a softmax's at temperature `tau`: the value is the same at any
    temperature, the gradient is not."""

    def __init__(self) -> None:
        super().__init__()
        self.tau = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        soft = F.softmax(x / self.tau, 1)
        hard = F.one_hot(soft.argmax(1), x.shape[1]).permute(0, 3, 1, 2).to(x.dtype)
        return hard + soft - soft.detach()


def _annealing_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 8, 3), _StraightThrough(), nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8), nn.Tanh(),
                         nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(8 * 4 * 4, 10)).double()


def _anneal_after_the_forward(model: nn.Module, batch) -> torch.Tensor:
    loss = ce_loss(model, batch)
    model[1].tau = 0.3  # the next step's temperature, set once this one's forward is over
    return loss


@pytest.mark.parametrize("schedule", ["passes", "recompute", "segments", "layerwise"])
def test_an_attribute_loss_fn_sets_after_the_forward_is_not_read_by_a_run_again(schedule):
    """Whole-batch torch runs the forward once, at the attributes the step found. Passes runs it again for every pass,
    and a temperature loss_fn set after the first run's forward made the later runs' gradient another one, with every
    BatchNorm input and the loss the same: silently wrong. Recompute and segments found the change and ran the step
    again under layerwise, which then read the new temperature: silently wrong after a warning that said otherwise.
    Each run again now finds the attributes as the step found them; after the step they are as the forward left them.
    Layerwise reads it in no later forward, and every micro-batch sets the one value: not a number each forward moves
    (`safety.writes`), so not refused."""
    ref, ours = _annealing_net(), _annealing_net()
    batch = data((1, 6, 6), 8, torch.float64)
    expected = _anneal_after_the_forward(ref, batch)
    expected.backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # recompute and segments say they run layerwise instead
        loss = accumnorm.backward(ours, batch, _anneal_after_the_forward, micro_batch_size=2, schedule=schedule)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=0)
    compare(ref, ours, 1e-10)
    assert ours[1].tau == 0.3


def _eval_after_the_forward(model: nn.Module, batch) -> torch.Tensor:
    loss = ce_loss(model, batch)
    model.eval()
    return loss


def test_passes_runs_every_forward_in_the_mode_the_step_found_the_model_in():
    """A loss_fn that puts the model in eval mode once its forward is over: passes' next runs made eval-mode calls,
    which it refused as calls that differ; each run now starts in the step's modes, exact, and the model is left in
    eval mode as the forward left it."""
    torch.manual_seed(0)
    ref = vgg().double()
    ours = copy.deepcopy(ref)
    batch = data((1, 16, 16), 8, torch.float64)
    expected = _eval_after_the_forward(ref, batch)
    expected.backward()
    loss = accumnorm.backward(ours, batch, _eval_after_the_forward, micro_batch_size=2, schedule="passes")
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=0)
    compare(ref, ours, 1e-10)
    assert not ours.training and not any(m.training for m in ours.modules())
