"""accumnorm.backward against the oracle, whole-batch PyTorch: one forward/backward over the whole batch.

Models here are converted to accumnorm's layers (`oracle_and_ours`); tests/engine/test_schedules.py runs unconverted
torch, torchvision and timm models, direct F.batch_norm calls and random networks through both schedules."""
from __future__ import annotations

import copy
import re
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import accumnorm
from helpers import (
    SavedBytes,
    assert_unchanged,
    ce_loss,
    compare,
    failing_below,
    oracle_and_ours,
    rel_err,
    snapshot,
    whole_batch,
)
from models import MODELS, SMOOTH_FAMILIES, Shared, data, mlp, no_bn, resnet, vgg


def run_both(build, shape, n, micro, dtype, bn="exact", schedule="auto"):
    ref, ours = oracle_and_ours(build().to(dtype))
    batch = data(shape, n, dtype)
    expected = whole_batch(ref, batch)
    loss = accumnorm.backward(ours, batch, ce_loss, micro_batch_size=micro, bn=bn, schedule=schedule)
    return ref, ours, expected, loss


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("n,micro", [(12, 4), (11, 3), (7, 1)])
def test_exact_matches_whole_batch_float64_smooth(name, n, micro, schedule):
    ref, ours, expected, loss = run_both(SMOOTH_FAMILIES[name], MODELS[name][1], n, micro, torch.float64,
                                         schedule=schedule)
    errs = compare(ref, ours, 1e-9)
    assert rel_err(loss, expected) < 1e-12, errs


@pytest.mark.parametrize("name", ["vgg", "resnet"])
def test_exact_matches_whole_batch_float64_relu_maxpool(name, schedule):
    build, shape = MODELS[name]
    ref, ours, expected, loss = run_both(build, shape, 10, 3, torch.float64, schedule=schedule)
    compare(ref, ours, 1e-6)
    assert rel_err(loss, expected) < 1e-12


@pytest.mark.parametrize("name", list(MODELS))
def test_exact_matches_whole_batch_float32(name, schedule):
    build, shape = MODELS[name]
    ref, ours, expected, loss = run_both(build, shape, 13, 4, torch.float32, schedule=schedule)
    compare(ref, ours, 1e-3)
    assert rel_err(loss, expected) < 1e-5


def test_study_net_at_micro_batch_one_matches_batch_16(schedule):
    """The study's setting: micro-batch 1 x 16, ReLU and max-pool, float32."""
    ref, ours, expected, loss = run_both(lambda: vgg(widths=(32, 64, 128, 256)), (1, 28, 28), 16, 1, torch.float32,
                                         schedule=schedule)
    compare(ref, ours, 1e-3)
    assert rel_err(loss, expected) < 1e-5


def test_micro_mode_is_plain_accumulation():
    """bn='micro' is what the study measured: per-micro-batch statistics, running stats updated K times."""
    ref, ours = oracle_and_ours(mlp().double())
    x, y = data((64,), 12, torch.float64)
    for xb, yb in zip(x.split(4), y.split(4)):
        (ce_loss(ref, (xb, yb)) / 3).backward()
    accumnorm.backward(ours, (x, y), ce_loss, micro_batch_size=4, bn="micro")
    compare(ref, ours, 1e-12)
    assert int(ours[2].num_batches_tracked) == 3


@pytest.mark.parametrize("bn", ["exact", "micro"])
def test_without_batchnorm_any_mode_matches(bn):
    ref, ours, expected, loss = run_both(no_bn, (1, 16, 16), 11, 4, torch.float64, bn=bn)
    compare(ref, ours, 1e-10)
    assert rel_err(loss, expected) < 1e-12


def test_exact_differs_from_micro_where_it_should():
    """Sanity of the oracle tests: per-micro-batch BatchNorm is far from whole-batch BatchNorm."""
    ref, ours, _, _ = run_both(lambda: vgg(nn.Tanh), (1, 16, 16), 12, 2, torch.float64, bn="micro")
    with pytest.raises(AssertionError):
        compare(ref, ours, 1e-3)


def test_invariant_to_micro_batch_size(schedule):
    model = accumnorm.convert(resnet(nn.Tanh).double())
    batch = data((1, 12, 12), 12, torch.float64)
    results = []
    for micro in (1, 2, 5, 12):
        m = copy.deepcopy(model)
        loss = accumnorm.backward(m, batch, ce_loss, micro_batch_size=micro, schedule=schedule)
        results.append((loss, [p.grad for p in m.parameters()], [b.clone() for b in m.buffers()]))
    for loss, grads, bufs in results[1:]:
        assert rel_err(loss, results[0][0]) < 1e-12
        assert all(rel_err(g, g0, 1e-8) < 1e-9 for g, g0 in zip(grads, results[0][1]))
        assert all(rel_err(b, b0, 1e-8) < 1e-12 for b, b0 in zip(bufs, results[0][2]))


def test_batch_as_dict_and_gradients_add_to_existing_grad(schedule):
    ref, ours = oracle_and_ours(mlp().double())
    x, y = data((64,), 9, torch.float64)
    for m in (ref, ours):
        for p in m.parameters():
            p.grad = torch.ones_like(p)
    whole_batch(ref, (x, y))
    loss_fn = lambda model, b: F.cross_entropy(model(b["x"]), b["y"])  # noqa: E731
    accumnorm.backward(ours, {"x": x, "y": y}, loss_fn, micro_batch_size=4, schedule=schedule)
    compare(ref, ours, 1e-9)


def test_existing_gradients_are_added_into_in_place_as_autograd_does(schedule):
    """Autograd adds into an existing .grad in place: a .grad that is a view of one flat buffer (a contiguous-gradient
    optimizer's, DDP's gradient_as_bucket_view) stays that view, the buffer holding the sum; after a failed step the
    buffer holds what it held before."""
    ref, ours = oracle_and_ours(mlp().double())
    x, y = data((64,), 9, torch.float64)
    flat = torch.ones(sum(p.numel() for p in ours.parameters()), dtype=torch.float64)
    views = list(torch.split(flat, [p.numel() for p in ours.parameters()]))
    for p, view in zip(ours.parameters(), views):
        p.grad = view.view_as(p)
    grads = [p.grad for p in ours.parameters()]
    for p in ref.parameters():
        p.grad = torch.ones_like(p)


    with pytest.raises(RuntimeError, match="the forward fails"):
        accumnorm.backward(ours, (x, y), failing_below(4), micro_batch_size=4, schedule=schedule)
    assert torch.equal(flat, torch.ones_like(flat)) and all(p.grad is g for p, g in zip(ours.parameters(), grads))
    whole_batch(ref, (x, y))
    accumnorm.backward(ours, (x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]), micro_batch_size=4,
                       schedule=schedule)
    compare(ref, ours, 1e-9)
    assert all(p.grad is g for p, g in zip(ours.parameters(), grads))
    torch.testing.assert_close(flat, torch.cat([p.grad.flatten() for p in ref.parameters()]), rtol=1e-12, atol=0)


def test_eval_mode_is_a_single_pass_with_running_stats():
    ref, ours = oracle_and_ours(vgg(nn.Tanh).double())
    ref.eval(), ours.eval()
    batch = data((1, 16, 16), 6, torch.float64)
    expected = whole_batch(ref, batch)
    calls = []
    loss_fn = lambda m, b: calls.append(1) or ce_loss(m, b)  # noqa: E731
    loss = accumnorm.backward(ours, batch, loss_fn, micro_batch_size=2)
    assert len(calls) == 3  # one forward per micro-batch: eval BatchNorm couples no samples
    compare(ref, ours, 1e-10)
    assert rel_err(loss, expected) < 1e-12


def test_a_single_micro_batch_takes_one_pass():
    ref, ours = oracle_and_ours(vgg(nn.Tanh).double())
    batch = data((1, 16, 16), 6, torch.float64)
    expected = whole_batch(ref, batch)
    calls = []
    loss_fn = lambda m, b: calls.append(1) or ce_loss(m, b)  # noqa: E731
    loss = accumnorm.backward(ours, batch, loss_fn, micro_batch_size=8)
    assert len(calls) == 1
    compare(ref, ours, 1e-10)
    assert rel_err(loss, expected) < 1e-12


def test_layer_called_twice_per_forward_matches_whole_batch(schedule):
    ref, ours, expected, loss = run_both(Shared, (1, 8, 8), 10, 3, torch.float64, schedule=schedule)
    compare(ref, ours, 1e-9)
    assert int(ours.bn.num_batches_tracked) == 2  # once per call, as torch does


class InPlaceNet(nn.Module):
    """BatchNorm outputs changed in place (torchvision's ReLU(inplace=True), a residual added into them)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.conv2, self.bn2 = nn.Conv2d(6, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.head = nn.Linear(6, 10)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = self.bn2(self.conv2(h))
        out.add_(h).tanh_()
        return self.head(out.mean((2, 3)))


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_batchnorm_outputs_changed_in_place_match_whole_batch(schedule, memory_format):
    """The micro-batches' outputs of a met call are their own tensors: autograd refuses in-place changes to one of
    several views of a tensor, and a view would tie the micro-batches' graphs together."""
    ref = InPlaceNet().double().to(memory_format=memory_format)
    ours = copy.deepcopy(ref)
    x, y = data((3, 8, 8), 10, torch.float64)
    batch = (x.to(memory_format=memory_format), y)
    expected = whole_batch(ref, batch)
    loss = accumnorm.backward(ours, batch, ce_loss, micro_batch_size=3, schedule=schedule)
    compare(ref, ours, 1e-9)
    assert rel_err(loss, expected) < 1e-12


class DropNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 10))
        self.masks = []

    def forward(self, x):
        h = self.net[0](x)
        d = self.net[1](h)
        self.masks.append((d != 0).clone())
        return self.net[4](self.net[3](self.net[2](d)))


def test_dropout_draws_the_same_masks_in_every_pass_and_is_seeded():
    model = DropNet()
    batch = data((16,), 8, torch.float32)
    torch.manual_seed(3)
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=4, schedule="passes")
    grads = [p.grad.clone() for p in model.parameters()]
    # Every pass records one mask per micro-batch it reaches; there must be one distinct mask per
    # micro-batch (2), each seen in several passes.
    distinct = []
    for m in model.masks:
        if not any(torch.equal(m, d) for d in distinct):
            distinct.append(m)
    assert len(distinct) == 2 and len(model.masks) >= 6
    model.masks = []
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=4, schedule="passes")
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    # The layerwise schedule runs each micro-batch once, with the same per-micro-batch random numbers.
    model.masks = []
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=4, schedule="layerwise")
    assert len(model.masks) == 2 and all(torch.equal(m, d) for m, d in zip(model.masks, distinct))
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)
    # And both leave the caller's generator where it was after drawing the seeds.
    torch.manual_seed(3)
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=4, schedule="layerwise")
    after_layerwise = torch.rand(3)
    torch.manual_seed(3)
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=4, schedule="passes")
    assert torch.equal(torch.rand(3), after_layerwise)


def test_bf16_autocast_keeps_statistics_in_float32(schedule):
    model = accumnorm.convert(vgg())
    batch = data((1, 16, 16), 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule=schedule)
    assert torch.isfinite(loss)
    for m in model.modules():
        if isinstance(m, accumnorm.BatchNorm2d):
            assert m.running_mean.dtype == torch.float32 and torch.isfinite(m.running_var).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_returned_loss_is_summed_in_the_losses_dtype_under_autocast(schedule, dtype):
    """A float32 loss of about 8e4 under CPU autocast: the micro-batches' losses were summed under the caller's
    autocast, in bfloat16 (80896 for 81073) or float16 (inf, and no error). The sum is the losses' own, float32, as
    whole-batch torch's loss is."""
    def loss_fn(model, batch):
        return F.mse_loss(model(batch[0]).float(), batch[1]) * 3e4 + 7e4

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    batch = (torch.randn(8, 4), torch.randn(8, 1))
    with torch.autocast("cpu", dtype=dtype):
        want = loss_fn(copy.deepcopy(model), batch)
        loss = accumnorm.backward(model, batch, loss_fn, micro_batch_size=2, schedule=schedule)
    assert loss.dtype == want.dtype == torch.float32
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)


@pytest.mark.parametrize("whole_loss", [False, True])
@pytest.mark.parametrize("bn", ["exact", "micro"])
def test_forwards_without_grad_leave_the_autocast_cache_alone(schedule, bn, whole_loss):
    """Passes and GradCache run forwards without grad inside the caller's autocast region. torch 2.8 caches a
    weight's bfloat16 copy cast there, and the forward with grad reuses it, graph-less: every conv and linear
    weight lost its gradient. No forward may run without grad with the cache on; every parameter gets its grad."""
    seen = set()
    model = vgg()
    model[0].register_forward_pre_hook(
        lambda *_: seen.add((torch.is_grad_enabled(), torch.is_autocast_cache_enabled())))
    x, y = data((1, 16, 16), 8)
    kwargs = (dict(forward_fn=lambda m, b: m(b[0]), batch_loss_fn=lambda out, b: F.cross_entropy(out.float(), b[1]),
                   targets=(x, y)) if whole_loss else dict(loss_fn=ce_loss))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        accumnorm.backward(model, (x, y), micro_batch_size=2, schedule=schedule, bn=bn, **kwargs)
    assert (False, True) not in seen, seen
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_lazy_model_materializes_and_matches(schedule):
    torch.manual_seed(1)
    lazy = vgg(nn.Tanh, norm=lambda c: accumnorm.norm("bn")).double()
    batch = data((1, 16, 16), 9, torch.float64)
    accumnorm.backward(lazy, batch, ce_loss, micro_batch_size=4, schedule=schedule)
    torch.manual_seed(1)
    ref = vgg(nn.Tanh).double()
    whole_batch(ref, batch)
    compare(ref, lazy, 1e-9)


def test_saved_tensors_of_each_schedule():
    """passes holds one micro-batch's saved tensors; layerwise keeps the whole batch's in its store (here the
    model's device, since the model is on the CPU), no more than whole-batch torch would."""
    model = accumnorm.convert(vgg(widths=(32, 64, 128, 256)))
    batch = data((1, 28, 28), 16)
    peaks = {}
    for bn, schedule, micro in [("micro", "auto", 2), ("exact", "passes", 2), ("exact", "layerwise", 2),
                                ("micro", "auto", 16)]:
        with SavedBytes() as saved:
            accumnorm.backward(model, batch, ce_loss, micro_batch_size=micro, bn=bn, schedule=schedule)
        peaks[schedule if bn == "exact" else micro] = saved.peak
    assert peaks["passes"] <= 1.1 * peaks[2]
    assert peaks["passes"] < peaks[16] / 3  # weights are saved too, so not the full 8x
    assert peaks[16] / 2 < peaks["layerwise"] <= 1.1 * peaks[16]


# --- bad input: a clear error, and nothing changed ---------------------------------------------------

@pytest.fixture
def primed():
    """A model with existing gradients and running statistics, to check that errors leave them alone."""
    model = accumnorm.convert(vgg(nn.Tanh))
    batch = data((1, 16, 16), 8)
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=4)
    return model, batch, snapshot(model)


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"micro_batch_size": 0}, ValueError, "micro_batch_size must be >= 1, got 0"),
    ({"micro_batch_size": 2.0}, TypeError, "micro_batch_size must be an int, got float"),
    ({"micro_batch_size": True}, TypeError, "micro_batch_size must be an int, got bool"),
    ({"micro_batch_size": 2, "bn": "sync"}, ValueError, r"bn must be one of \('exact', 'micro'\), got 'sync'"),
    ({"micro_batch_size": 2, "grad_scaler": "yes"}, TypeError, r"grad_scaler must be a torch.amp.GradScaler or None, "
                                                               r"got str 'yes'"),
    ({"micro_batch_size": 2, "process_group": "world"}, TypeError, r"process_group must be a "
                                                                   r"torch.distributed.ProcessGroup or None, got str"),
])
def test_bad_arguments(primed, kwargs, exc, match):
    model, batch, snap = primed
    with pytest.raises(exc, match=match):
        accumnorm.backward(model, batch, ce_loss, **kwargs)
    assert_unchanged(model, snap)


@pytest.mark.parametrize("batch,exc,match", [
    (torch.zeros(0, 1, 16, 16), ValueError, "dimension 0 has length 0"),
    ((), ValueError, "batch is empty"),
    ((torch.zeros(4, 1, 16, 16), torch.zeros(3, dtype=torch.long)), ValueError, r"share their length .*got lengths"),
    ((torch.zeros(4, 1, 16, 16), [1, 2, 3]), ValueError, r"share their length .*'batch\[1\]': 3"),
    ((torch.zeros(4, 1, 16, 16), (1, 2, 3, 4)), TypeError, r"batch\[1\] must be a Tensor or a list of per-sample "
                                                           r"items, got tuple"),
    ("images", TypeError, "batch must be a Tensor or a tuple/list/dict of Tensors, got str"),
    (torch.tensor(3.0), ValueError, "0-dim tensor"),
])
def test_bad_batches(primed, batch, exc, match):
    model, _, snap = primed
    with pytest.raises(exc, match=match):
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=2)
    assert_unchanged(model, snap)


@pytest.mark.parametrize("bn", ["exact", "micro"])
def test_non_scalar_loss(primed, bn):
    model, batch, snap = primed
    loss_fn = lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none")  # noqa: E731
    with pytest.raises(ValueError, match=r"scalar \(0-dim\) Tensor, got shape \(2,\) for micro-batch 0"):
        accumnorm.backward(model, batch, loss_fn, micro_batch_size=2, bn=bn)
    assert_unchanged(model, snap)


@pytest.mark.parametrize("bn", ["exact", "micro"])
@pytest.mark.parametrize("make,exc,match", [
    (lambda loss: loss.detach(), ValueError, "loss for micro-batch 0 does not require grad: it is detached"),
    (lambda loss: torch.tensor(1), TypeError, "floating-point loss, got torch.int64 for micro-batch 0"),
    (lambda loss: loss * (1 + 1j), TypeError, "floating-point loss, got torch.complex64 for micro-batch 0"),
])
def test_a_loss_that_cannot_be_back_propagated(primed, bn, make, exc, match):
    model, batch, snap = primed
    with pytest.raises(exc, match=match):
        accumnorm.backward(model, batch, lambda m, b: make(ce_loss(m, b)), micro_batch_size=2, bn=bn)
    assert_unchanged(model, snap)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_backward_under_no_grad_or_inference_mode_is_refused(primed, mode):
    model, batch, snap = primed
    with mode(), pytest.raises(ValueError, match=r"accumnorm.backward computes gradients: it cannot run under"):
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=2)
    assert_unchanged(model, snap)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_teacher_without_running_statistics_runs_under_no_grad_and_its_refusal_says_so(mode):
    """A teacher in eval mode whose BatchNorm keeps no running statistics normalizes with the batch's: under no_grad
    the step meets its calls, as whole-batch torch's forward sees the whole batch; under inference_mode it cannot,
    and the refusal says to use no_grad (putting the layer in eval mode, the advice it gave, changes nothing)."""
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4, track_running_stats=False), nn.Flatten(),
                            nn.Linear(4 * 14 * 14, 10)).double().eval()
    ref = vgg(nn.Tanh).double()
    ours = copy.deepcopy(ref)
    batch = data((1, 16, 16), 8, torch.float64)

    def loss_fn(m, b):
        with mode():
            target = teacher(b[0]).softmax(1)
        return F.cross_entropy(m(b[0]), target.clone())

    if mode is torch.inference_mode:
        snap = snapshot(ours)
        with pytest.raises(ValueError, match=r"under torch.inference_mode.*Nothing was changed. Use torch.no_grad"):
            accumnorm.backward(ours, batch, loss_fn, micro_batch_size=2)
        assert_unchanged(ours, snap)
        return
    expected = whole_batch(ref, batch, loss_fn)
    loss = accumnorm.backward(ours, batch, loss_fn, micro_batch_size=2)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    compare(ref, ours, 1e-10)


@pytest.mark.parametrize("bn", ["exact", "micro"])
def test_a_failed_step_leaves_lazy_layers_lazy(schedule, bn):
    """The first forward materializes lazy layers; a step that fails afterwards gives them back unmaterialized,
    hooks and all, and the next step materializes them again."""
    model = nn.Sequential(nn.Conv2d(1, 4, 3), accumnorm.BatchNorm2d(), nn.Tanh(), nn.Flatten(), nn.LazyLinear(10))
    batch = data((1, 8, 8), 6)

    def failing(m, b):
        ce_loss(m, b)
        raise RuntimeError("after the forward")

    with pytest.raises(RuntimeError, match="after the forward"):
        accumnorm.backward(model, batch, failing, micro_batch_size=2, bn=bn, schedule=schedule)
    assert model[1].has_uninitialized_params() and model[1].num_features is None
    assert type(model[4]) is nn.LazyLinear and model[4].has_uninitialized_params()
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, bn=bn, schedule=schedule)
    assert model[1].num_features == 4 and type(model[4]) is nn.Linear and model[4].weight.grad is not None


@pytest.mark.parametrize("bn", ["exact", "micro"])
def test_non_finite_loss_changes_nothing(primed, bn):
    model, batch, snap = primed
    def loss_fn(m, b):
        loss = ce_loss(m, b)
        return loss * float("nan") if b[0][0, 0, 0, 0] == batch[0][6, 0, 0, 0] else loss
    with pytest.raises(ValueError, match="loss is not finite .* for micro-batch 3"):
        accumnorm.backward(model, batch, loss_fn, micro_batch_size=2, bn=bn)
    assert_unchanged(model, snap)


def test_under_a_grad_scaler_an_overflow_is_left_to_the_scaler():
    """fp16 overflows now and then: the scaler, not backward, skips that step and lowers the scale."""
    model = accumnorm.convert(mlp())
    x, y = data((64,), 8)
    loss_fn = lambda m, b: ce_loss(m, b) * float("inf")  # noqa: E731
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    loss = accumnorm.backward(model, (x, y), loss_fn, micro_batch_size=4, grad_scaler=scaler)
    assert not torch.isfinite(loss)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)) and scaler.get_scale() == 2.0**7


def test_grad_scaler_scales_the_gradient(schedule):
    ref, ours = oracle_and_ours(mlp().double())
    batch = data((64,), 8, torch.float64)
    whole_batch(ref, batch)
    accumnorm.backward(ours, batch, ce_loss, micro_batch_size=3, schedule=schedule,
                       grad_scaler=torch.amp.GradScaler("cpu", init_scale=4.0))
    for q in ours.parameters():
        q.grad /= 4.0
    compare(ref, ours, 1e-9)


@pytest.mark.parametrize("bn,schedule,fail_at", [
    ("micro", "auto", 3), ("exact", "passes", 7), ("exact", "layerwise", 3),
])
@pytest.mark.realtime
def test_failure_part_way_changes_nothing(primed, bn, schedule, fail_at):
    model, batch, snap = primed
    twin, threads = copy.deepcopy(model), set(threading.enumerate())
    seen = []
    def loss_fn(m, b):
        seen.append(1)
        if len(seen) == fail_at:  # mid-way: after some gradients were accumulated, or some forwards paused
            raise RuntimeError("data pipeline broke")
        return ce_loss(m, b)
    with pytest.raises(RuntimeError, match="data pipeline broke"):
        accumnorm.backward(model, batch, loss_fn, micro_batch_size=2, bn=bn, schedule=schedule)
    assert_unchanged(model, snap)
    assert not set(threading.enumerate()) - threads  # no micro-batch's thread is left behind (another may end)
    # Nothing of the failed call is left active: the model is torch's again, forward and running stats.
    torch.testing.assert_close(model(batch[0]), twin(batch[0]), rtol=0, atol=0)
    assert all(torch.equal(b, b2) for b, b2 in zip(model.buffers(), twin.buffers()))


def test_one_value_per_channel_is_refused_like_torch():
    model = accumnorm.convert(mlp())
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        accumnorm.backward(model, data((64,), 1), ce_loss, micro_batch_size=1)


@pytest.mark.parametrize("shape", [(1, 3), (1, 3, 1), (1, 3, 2), (2, 3, 1), (3, 3, 1, 1)])
def test_values_per_channel_counted_over_samples_and_positions_like_torch(schedule, shape):
    """Batch statistics need more than one value per channel in the whole batch, samples times positions: refused
    exactly where whole-batch torch refuses, with nothing changed, and the whole batch's gradients elsewhere."""
    ref = nn.Sequential(nn.BatchNorm1d(3) if len(shape) < 4 else nn.BatchNorm2d(3)).double()
    ours, x = copy.deepcopy(ref), torch.randn(shape, dtype=torch.float64)

    def loss_fn(m, xs):
        return m(xs).square().mean()

    try:
        whole_batch(ref, x, loss_fn)
        torch_refuses = False
    except ValueError:
        torch_refuses = True
    snap = snapshot(ours)
    if torch_refuses:
        with pytest.raises(ValueError, match=r"Expected more than 1 value per channel when training, got input size "
                                             + re.escape(str(tuple(shape)))):
            accumnorm.backward(ours, x, loss_fn, micro_batch_size=1, schedule=schedule)
        assert_unchanged(ours, snap)
    else:
        accumnorm.backward(ours, x, loss_fn, micro_batch_size=1, schedule=schedule)
        compare(ref, ours, 1e-9)


class _SelectedRows(nn.Module):
    """A BatchNorm over the rows a mask selects (boxes, positives), beside a head over every sample."""

    def __init__(self) -> None:
        super().__init__()
        self.pick, self.bn, self.head = nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(x) + self.bn(self.pick(x[mask])).sum()


@pytest.mark.parametrize("selected", [0, 3], ids=["no row", "rows in one micro-batch"])
def test_a_batch_norm_over_no_row_of_the_whole_batch_does_as_torch(schedule, selected):
    """torch's BatchNorm takes an empty batch in training: an empty output, the running statistics as they were, its
    counter one up. The step refused it as one value per channel; passes, let through, would move the running
    statistics to the empty batch's 0/0. Exact under every schedule, as a micro-batch without rows already was."""
    torch.manual_seed(0)
    ref = _SelectedRows().double()
    ours = copy.deepcopy(ref)
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.arange(8) % 3
    mask = torch.arange(8) < selected

    def loss_fn(m, b):
        return F.cross_entropy(m(b[0], b[2]), b[1])

    expected = whole_batch(ref, (x, y, mask), loss_fn)
    loss = accumnorm.backward(ours, (x, y, mask), loss_fn, micro_batch_size=4, schedule=schedule)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    for (name, got), want in zip(ours.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15, msg=name)
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14)


@pytest.mark.realtime
def test_auto_falls_back_to_recompute_when_layerwise_runs_out_of_memory():
    ref = vgg(nn.Tanh).double()
    ours, batch = copy.deepcopy(ref), data((1, 16, 16), 8, torch.float64)
    whole_batch(ref, batch)
    calls = []
    def loss_fn(m, b):
        calls.append(threading.current_thread().name)
        if len(calls) == 3:  # the third micro-batch's forward under layerwise: the store is full
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return ce_loss(m, b)
    with pytest.warns(RuntimeWarning, match="running the recompute schedule.*layerwise ran out of memory"):
        accumnorm.backward(ours, batch, loss_fn, micro_batch_size=2)
    assert accumnorm.last_schedule(ours).schedule == "recompute"
    compare(ref, ours, 1e-9)
    assert len(calls) == 3 + 4  # recompute ran the whole step again after the failure
    with pytest.raises(torch.OutOfMemoryError):  # asked for by name, layerwise does not fall back
        calls.clear()
        accumnorm.backward(copy.deepcopy(ref), batch, loss_fn, micro_batch_size=2, schedule="layerwise")


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_scripted_batchnorm_is_refused_in_exact_mode():
    """A scripted module's BatchNorm runs in C++, out of the step's sight: refused rather than silently inexact."""
    model = nn.Sequential(nn.Linear(4, 4), torch.jit.script(nn.BatchNorm1d(4)), nn.Linear(4, 10))
    with pytest.raises(ValueError, match=r"cannot see the BatchNorm of the TorchScript module 1 \(BatchNorm1d\)"):
        accumnorm.backward(model, data((4,), 6), ce_loss, micro_batch_size=2)
    assert all(p.grad is None for p in model.parameters())
    accumnorm.backward(model, data((4,), 6), ce_loss, micro_batch_size=2, bn="micro")  # plain accumulation is fine


def test_layerwise_gives_the_caller_its_thread_count_back():
    """The lockstep forwards run on one intra-op thread each; the caller's setting comes back, error or not."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model, batch = vgg(), data((1, 16, 16), 6)
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="layerwise")
        assert torch.get_num_threads() == 2
        def broken(m, b):
            raise RuntimeError("data pipeline broke")
        with pytest.raises(RuntimeError, match="data pipeline broke"):
            accumnorm.backward(model, batch, broken, micro_batch_size=2, schedule="layerwise")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
