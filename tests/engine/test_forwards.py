"""The forwards torch's own layers get for a step (`_engine/intercept/forwards.py`): the BatchNorm one follows
torch's `_BatchNorm.forward` line for line, so torch changing its own must not pass unseen."""
import copy
import functools
import hashlib
import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

import accumnorm
from accumnorm._engine.intercept.forwards import TORCH_FORWARD_SHA256
from helpers import EXACT_SCHEDULES, assert_unchanged, ce_loss, exact_vs_whole_batch, snapshot


def test_torchs_batchnorm_forward_is_the_one_the_step_forward_follows():
    source = inspect.getsource(_BatchNorm.forward)
    assert hashlib.sha256(source.encode()).hexdigest() == TORCH_FORWARD_SHA256, (
        "torch's _BatchNorm.forward changed: read it against _batch_norm_in_step in "
        "src/accumnorm/_engine/intercept/forwards.py, bring the copy in line, then record the new hash")


def test_a_step_leaves_torchs_layers_their_class_forward():
    """The step forwards live on the layers for the length of a step only."""
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(3))
    model(torch.randn(2, 1, 6, 6))
    batch = (torch.randn(8, 1, 6, 6), torch.randint(0, 3, (8,)))
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=2)
    assert all("forward" not in vars(m) for m in model.modules())


def _digits_net(bn: nn.BatchNorm2d) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), bn, nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)).double()


def test_a_batchnorm_layer_without_the_buffers_it_does_not_track_trains_like_whole_batch_torch():
    """The step reads a layer's tensors from its tables; one whose untracked buffers were deleted is read as torch's
    forward reads it (not at all)."""
    bn = nn.BatchNorm2d(4, track_running_stats=False)
    del bn.num_batches_tracked
    ref = _digits_net(bn)
    ours = copy.deepcopy(ref)
    batch = (torch.randn(12, 1, 6, 6, dtype=torch.float64), torch.randint(0, 3, (12,)))
    exact_vs_whole_batch(ref, ours, batch, micro_batch_size=4, tol=1e-10, schedule="layerwise")


def test_a_batchnorm_layer_missing_a_buffer_it_tracks_fails_as_in_torch_and_changes_nothing():
    bn = nn.BatchNorm2d(4)
    del bn.num_batches_tracked
    model = _digits_net(bn)
    batch = (torch.randn(12, 1, 6, 6, dtype=torch.float64), torch.randint(0, 3, (12,)))
    with pytest.raises(AttributeError, match="num_batches_tracked"):
        ce_loss(copy.deepcopy(model), batch)
    before = snapshot(model)
    with pytest.raises(AttributeError, match="num_batches_tracked"):
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=4, schedule="layerwise")
    assert_unchanged(model, before)


def test_torchs_own_layers_and_norm_functions_are_known_as_torchs():
    """The step's own forwards (and exact steps at all) depend on telling torch's code from a patch: every layer class
    the step stands in for, and the norm functions its mode meets at, must be known as torch's."""
    from accumnorm._engine.intercept.forwards import _BATCH_NORM_LAYERS, _PLAIN_LAYERS
    from accumnorm._engine.intercept.torchs import torchs_code

    assert all(torchs_code(cls.forward) for cls in (*_PLAIN_LAYERS, *_BATCH_NORM_LAYERS))
    assert torchs_code(F.batch_norm) and torchs_code(F.instance_norm)
    assert not torchs_code(_clamped(F.batch_norm))


def _clamped(function):
    """A function as a library patches it in: its output, clamped; `functools.wraps` keeps torch's name and module."""
    @functools.wraps(function)
    def patched(*args, **kwargs):
        return function(*args, **kwargs).clamp(-0.5, 0.5)
    return patched


@pytest.mark.parametrize("schedule", EXACT_SCHEDULES)
@pytest.mark.parametrize("patched", ["BatchNorm2d", "_BatchNorm", "Conv2d"])
def test_a_layer_class_whose_forward_was_patched_runs_the_patch(monkeypatch, patched, schedule):
    """The step gives torch's layers forwards of its own that stand in for torch's code. A class whose forward a
    library patched (a wrapper of torch's, set on the class) is not torch's code: the step ran its own BatchNorm
    forward instead, without the patch, and the loss and gradients were silently another model's. Such a layer runs
    its class's forward, under the step's mode, as a subclass's does."""
    owner = {"BatchNorm2d": nn.BatchNorm2d, "_BatchNorm": _BatchNorm, "Conv2d": nn.Conv2d}[patched]
    monkeypatch.setattr(owner, "forward", _clamped(owner.forward))
    ref = _digits_net(nn.BatchNorm2d(4))
    ours = copy.deepcopy(ref)
    batch = (torch.randn(12, 1, 6, 6, dtype=torch.float64), torch.randint(0, 3, (12,)))
    exact_vs_whole_batch(ref, ours, batch, micro_batch_size=4, tol=1e-10, schedule=schedule)


@pytest.mark.parametrize("schedule", ["auto", *EXACT_SCHEDULES])
@pytest.mark.parametrize("name, norm", [("batch_norm", nn.BatchNorm2d), ("instance_norm", nn.InstanceNorm2d)])
def test_a_replaced_norm_function_of_torchs_is_refused_before_anything_changes(monkeypatch, name, norm, schedule):
    """A library that replaces F.batch_norm (a wrapper clamping its output, here) made the step's BatchNorm forward
    skip the wrapper, and the step's own normalization run through it: silently another model's gradients. torch
    hands a TorchFunctionMode the replacement itself, so no step can tell which part of it to make of the whole
    batch: refused, naming the function and where the replacement comes from, with nothing changed. So is a
    replaced F.instance_norm, for an InstanceNorm layer that keeps running statistics."""
    monkeypatch.setattr(F, name, _clamped(getattr(F, name)))
    model = _digits_net(norm(4, affine=True, track_running_stats=True))
    batch = (torch.randn(12, 1, 6, 6, dtype=torch.float64), torch.randint(0, 3, (12,)))
    before = snapshot(model)
    with pytest.raises(ValueError, match=rf"torch.nn.functional.{name} is not torch's own function but a "
                                         rf"replacement \(from .*test_forwards.py, line \d+\).*Nothing was changed"):
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=4, schedule=schedule)
    assert_unchanged(model, before)
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=4, schedule=schedule, bn="micro")


def test_a_replaced_norm_function_the_model_does_not_call_changes_nothing(monkeypatch):
    """A replaced F.instance_norm in a model of BatchNorm layers alone: the step meets no call of it, and is exact."""
    monkeypatch.setattr(F, "instance_norm", _clamped(F.instance_norm))
    ref = _digits_net(nn.BatchNorm2d(4))
    ours = copy.deepcopy(ref)
    batch = (torch.randn(12, 1, 6, 6, dtype=torch.float64), torch.randint(0, 3, (12,)))
    exact_vs_whole_batch(ref, ours, batch, micro_batch_size=4, tol=1e-10, schedule="layerwise")


class _FunctionalBatchNorm(nn.Module):
    """Batch statistics through a direct F.batch_norm call of a module's own (not a BatchNorm layer)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.rand(channels) + 0.5), nn.Parameter(torch.randn(channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, True, 0.1, 1e-5)


def _replacing(name: str, after_forward: bool):
    """ce_loss, but setting a clamping replacement of F.<name> before the model's forward (as a library that patches
    on first use) or once the forward is over."""
    def loss_fn(model, batch):
        if not after_forward:
            setattr(F, name, _clamped(_TORCHS[name]))
        loss = ce_loss(model, batch)
        if after_forward:
            setattr(F, name, _clamped(_TORCHS[name]))
        return loss
    return loss_fn


_TORCHS = {"batch_norm": F.batch_norm, "instance_norm": F.instance_norm}


@pytest.mark.parametrize("schedule", ["auto", *EXACT_SCHEDULES])
@pytest.mark.parametrize("name, norm", [("batch_norm", nn.BatchNorm2d), ("instance_norm", nn.InstanceNorm2d),
                                        ("batch_norm", _FunctionalBatchNorm)])
def test_a_norm_function_replaced_during_the_step_is_refused_and_changes_nothing(monkeypatch, name, norm, schedule):
    """A replacement set by loss_fn itself, after the check before the step (a library patching on first use): whole
    batch torch runs it, but the step's BatchNorm forwards and met calls did not, and its normalization in the
    backward did: every schedule was silently another model's. Refused at the first norm call after it, from a
    layer or a direct call, with nothing changed."""
    for function in _TORCHS:
        monkeypatch.setattr(F, function, _TORCHS[function])  # put back after the test, whatever the step set
    layer = norm(4) if norm is _FunctionalBatchNorm else norm(4, affine=True, track_running_stats=True)
    model = _digits_net(layer)
    batch = (torch.randn(12, 1, 6, 6, dtype=torch.float64), torch.randint(0, 3, (12,)))
    before = snapshot(model)
    with pytest.raises(ValueError, match=rf"torch.nn.functional.{name} is not torch's own function but a "
                                         rf"replacement \(from .*test_forwards.py, line \d+\).*Nothing was changed"):
        accumnorm.backward(model, batch, _replacing(name, after_forward=False), micro_batch_size=4,
                           schedule=schedule)
    assert_unchanged(model, before)


@pytest.mark.parametrize("schedule", EXACT_SCHEDULES)
def test_a_batch_norm_replaced_after_the_forward_is_never_run_by_the_step(monkeypatch, schedule):
    """A replacement set once the forward's norm calls are over changes nothing in whole-batch torch, nor in the
    layerwise step. A schedule that runs the norm calls again (passes' next run of loss_fn, recompute's and segments'
    regions in the backward) meets the replacement there: refused, with nothing changed."""
    monkeypatch.setattr(F, "batch_norm", _TORCHS["batch_norm"])
    ref = _digits_net(nn.BatchNorm2d(4))
    ours = copy.deepcopy(ref)
    batch = (torch.randn(12, 1, 6, 6, dtype=torch.float64), torch.randint(0, 3, (12,)))
    expected = _replacing("batch_norm", after_forward=True)(ref, batch)
    expected.backward()
    F.batch_norm = _TORCHS["batch_norm"]
    loss_fn = _replacing("batch_norm", after_forward=True)
    if schedule != "layerwise":
        before = snapshot(ours)
        with pytest.raises(ValueError, match=r"torch.nn.functional.batch_norm is not torch's own function"):
            accumnorm.backward(ours, batch, loss_fn, micro_batch_size=4, schedule=schedule)
        assert_unchanged(ours, before)
        return
    loss = accumnorm.backward(ours, batch, loss_fn, micro_batch_size=4, schedule=schedule)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-10, atol=0)
    for p, q in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-12)
