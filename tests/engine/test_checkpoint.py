"""BatchNorm inside activation checkpointing: `checkpoint(use_reentrant=False)` regions are exact under every
schedule, their recomputation updates no running statistic; `use_reentrant=True` around BatchNorm is refused.

The oracle is the same model with checkpointing off, one forward/backward of the whole batch (torch's own
checkpoint updates running statistics twice, once more in the recomputation)."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, set_checkpoint_early_stop

import accumnorm
from helpers import (
    EXACT_SCHEDULES,
    STEP_SCHEDULES,
    assert_unchanged,
    ce_loss,
    compare,
    exact_vs_whole_batch,
    rel_err,
    snapshot,
    whole_batch,
)
from models import data


class Checkpointed(nn.Module):
    """conv-BN-act-conv-BN-act in a checkpointed region (optionally a second region nested inside), a BatchNorm
    and an InstanceNorm with running statistics around it; `ckpt=None` runs it all without checkpointing."""

    def __init__(self, ckpt: str | None = "flat") -> None:
        super().__init__()
        self.ckpt = ckpt
        self.c1, self.b1 = nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.c2, self.b2 = nn.Conv2d(6, 6, 3, padding=1), nn.BatchNorm2d(6, momentum=None)
        self.inorm = nn.InstanceNorm2d(6, affine=True, track_running_stats=True)
        self.b3 = nn.BatchNorm2d(6)
        self.head = nn.Linear(6, 10)

    def inner(self, x):
        return torch.tanh(self.inorm(self.b2(self.c2(x))))

    def block(self, x):
        x = torch.tanh(self.b1(self.c1(x)))
        if self.ckpt == "nested":
            return checkpoint(self.inner, x, use_reentrant=False)
        return self.inner(x)

    def forward(self, x):
        x = self.block(x) if self.ckpt is None else checkpoint(self.block, x, use_reentrant=False)
        x = self.b3(x) + self.b1(x)  # b1 again, outside the region: a second call of a layer inside it
        return self.head(x.mean((2, 3)))


@pytest.mark.parametrize("ckpt", ["flat", "nested"])
def test_batchnorm_in_a_checkpointed_region_is_exact(schedule, ckpt):
    model = Checkpointed(ckpt).double()
    ref = copy.deepcopy(model)
    ref.ckpt = None
    batch = data((1, 8, 8), 10, torch.float64)
    expected = whole_batch(ref, batch)
    loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=3, schedule=schedule)
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)  # running statistics and num_batches_tracked: updated once per call, as the oracle's


def test_batchnorm_in_a_checkpointed_region_is_exact_without_early_stop(schedule):
    """torch's early stop off: a region's recomputation runs its function to the end. The passes schedule's
    correction pass ends a forward at a BatchNorm call inside the region; the region's recomputation then ran on past
    it, through calls that forward never made (torch's BatchNorm, on one micro-batch), and the step was refused as
    "saw 29 of the 33 training forwards"."""
    model = Checkpointed("flat").double()
    ref = copy.deepcopy(model)
    ref.ckpt = None
    batch = data((1, 8, 8), 10, torch.float64)
    expected = whole_batch(ref, batch)
    with set_checkpoint_early_stop(False):
        loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=3, schedule=schedule)
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)


class DrawsInTheBackward(nn.Module):
    """Random numbers drawn in the backward: dropout in a region recomputed without `preserve_rng_state`, and a hook
    on a BatchNorm's output gradient that draws."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Linear(4, 10)

    def block(self, x):
        return F.dropout(self.bn(self.conv(x)), 0.5)

    def forward(self, x):
        x = checkpoint(self.block, x, use_reentrant=False, preserve_rng_state=False)
        if x.requires_grad:
            x.register_hook(lambda g: g + 1e-3 * torch.rand_like(g))
        return self.head(x.mean((2, 3)))


@pytest.mark.parametrize("mode", [*STEP_SCHEDULES, "micro"])
def test_draws_in_the_backward_leave_the_callers_generator_one_draw_on(mode):
    """The caller's generator advances by one draw per step, whatever the schedule: a draw in the step's backward (a
    region recomputed without preserve_rng_state, a hook) or in batch_loss_fn comes from a stream of the step's own.
    The one backward of the lockstep schedules, and every whole-batch loss, drew from the caller's."""
    torch.manual_seed(7)
    torch.empty((), dtype=torch.int64).random_()  # the step's one draw
    expected = torch.rand(())
    model = DrawsInTheBackward()
    batch = data((1, 6, 6), 8)
    torch.manual_seed(7)
    step = dict(bn="micro") if mode == "micro" else dict(schedule=mode)
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, **step)
    assert torch.equal(torch.rand(()), expected)

    def noisy_loss(outputs, targets):  # a loss over the whole batch that draws
        return F.cross_entropy(outputs + 1e-3 * torch.rand_like(outputs), targets)

    torch.manual_seed(7)
    accumnorm.backward(model, batch[0], micro_batch_size=2, forward_fn=lambda m, x: m(x), batch_loss_fn=noisy_loss,
                       targets=batch[1], **step)
    assert torch.equal(torch.rand(()), expected)


class Selective(nn.Module):
    """conv-BN-ReLU in a region of selective activation checkpointing (torch's `context_fn`: the convolution's output
    saved, the rest recomputed), or without any checkpoint for the oracle."""

    def __init__(self, checkpointed: bool = True) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.conv, self.bn, self.head = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Linear(4, 10)

    def block(self, x):
        return F.relu(self.bn(self.conv(x)))

    def forward(self, x):
        if self.checkpointed:
            policy = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.convolution.default])
            x = checkpoint(self.block, x, use_reentrant=False, context_fn=policy)
        else:
            x = self.block(x)
        return self.head(x.mean((2, 3)))


def test_batchnorm_in_a_region_of_selective_checkpointing_is_exact(schedule):
    """Selective checkpointing's recomputation must make the calls its forward made, under its dispatch mode: the met
    call ran in the driver, without it, so its output given again in the recomputation runs without it too (it
    raised "aten.div.Tensor encountered during backward but not found in storage")."""
    ref = Selective(checkpointed=False).double()
    ours = copy.deepcopy(ref)
    ours.checkpointed = True
    exact_vs_whole_batch(ref, ours, data((1, 6, 6), 10, torch.float64), 3, 1e-9, schedule=schedule)


class InstanceNormBlocks(nn.Module):
    """A BatchNorm, then residual blocks of conv and InstanceNorm with running statistics (no BatchNorm in them), each
    run through a checkpointed region if `checkpointed`."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.checkpointed = checkpointed
        self.inp, self.bn, self.out = nn.Conv2d(1, 4, 1), nn.BatchNorm2d(4), nn.Linear(4, 10)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.InstanceNorm2d(
            4, affine=True, track_running_stats=True), nn.Tanh()) for _ in range(4))

    def forward(self, x):
        h = self.bn(self.inp(x))
        for block in self.blocks:
            h = h + (checkpoint(block, h, use_reentrant=False) if self.checkpointed else block(h))
        return self.out(h.mean((2, 3)))


@pytest.mark.parametrize("checkpointed", [True, False], ids=["the user's regions", "recompute's own regions"])
def test_instance_norm_with_running_statistics_in_a_region_is_exact(schedule, checkpointed):
    """A region with an InstanceNorm call that tracks running statistics and no BatchNorm call recomputed outside the
    step: with torch's own path (running statistics given), which saves other tensors than the step's call in the
    forward (a raw CheckpointError), and which would move the statistics a second time. Such a region recomputes
    under the step's mode now. The oracle is the same model without checkpoints: torch's own checkpoint would move
    the statistics twice."""
    ref = InstanceNormBlocks(checkpointed=False).double()
    ours = copy.deepcopy(ref)
    ours.checkpointed = checkpointed
    exact_vs_whole_batch(ref, ours, data((1, 6, 6), 12, torch.float64), 4, 1e-9, schedule=schedule)


def test_a_second_backward_through_a_call_inside_a_region_of_one_micro_batch_is_refused_and_changes_nothing():
    """One micro-batch: a backward inside loss_fn (retaining the graph) through a BatchNorm call in a checkpointed
    region, whose input the region keeps for the step's one backward, is refused before the step's own backward,
    instead of that backward failing on a piece already taken back."""
    def loss_fn(m, b):
        out = m(b[0])
        out.square().mean().backward(retain_graph=True)
        return F.cross_entropy(out, b[1])

    model = Checkpointed("flat").double()
    batch = data((1, 8, 8), 6, torch.float64)
    snap = snapshot(model)
    with pytest.raises(ValueError, match="ran a backward.*keeps its input in checkpointed regions.*Nothing was"):
        accumnorm.backward(model, batch, loss_fn, micro_batch_size=6, schedule="layerwise")
    assert_unchanged(model, snap)


def test_the_recomputation_replays_the_forwards_dropout():
    """A region with dropout: the recomputation draws the forward's masks again (torch's preserve_rng_state), so
    checkpointed and plain runs of the same seed agree, under both schedules."""
    class Dropped(Checkpointed):
        def inner(self, x):
            return F.dropout(super().inner(x), 0.3, self.training)

    model = Dropped().double()
    batch = data((1, 8, 8), 10, torch.float64)
    results = []
    for schedule in EXACT_SCHEDULES:
        for ckpt in ("flat", None):
            m = copy.deepcopy(model)
            m.ckpt = ckpt
            torch.manual_seed(3)
            results.append((m, accumnorm.backward(m, batch, ce_loss, micro_batch_size=4, schedule=schedule)))
    (first, loss), *others = results
    for m, other_loss in others:
        assert rel_err(other_loss, loss) < 1e-12
        compare(first, m, 1e-9)


class Reentrant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU())
        self.head = nn.Linear(6, 10)

    def forward(self, x):
        x = checkpoint(self.body, x, use_reentrant=True)
        return self.head(x.mean((2, 3)))


@pytest.mark.parametrize("micro_batch_size", [3, 8])
def test_reentrant_checkpoint_around_batchnorm_is_refused_saying_what_to_use(schedule, micro_batch_size):
    """Refused at any split, one micro-batch included: its recomputation would update the running statistics a
    second time, outside the step. bn='micro' is torch's own accumulation and runs it."""
    model = Reentrant()
    batch = (torch.randn(8, 1, 6, 6, requires_grad=True), torch.randint(0, 10, (8,)))
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=3, bn="micro")
    snap = snapshot(model)
    state = torch.random.get_rng_state()
    with pytest.raises(ValueError, match=r"use_reentrant=True.*Use torch.utils.checkpoint\(\.\.\., use_reentrant=F"):
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=micro_batch_size, schedule=schedule)
    assert_unchanged(model, snap)
    assert torch.equal(torch.random.get_rng_state(), state)


class ReentrantWithoutNorms(nn.Module):
    """A BatchNorm, then a reentrant checkpoint around layers without batch statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.body = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.Tanh())
        self.head = nn.Linear(4, 10)

    def forward(self, x):
        x = checkpoint(self.body, self.bn(self.stem(x)), use_reentrant=True)
        return self.head(x.mean((2, 3)))


def test_a_reentrant_checkpoint_without_batchnorm_is_exact_or_refused_under_passes(schedule):
    """A reentrant checkpoint around layers without batch statistics is exact; under passes, whose backwards of part
    of a graph (`inputs=`) torch refuses through it, a ValueError says so and what to use (it was torch's raw
    RuntimeError), with nothing changed."""
    ref = ReentrantWithoutNorms().double()
    ours = copy.deepcopy(ref)
    batch = data((1, 6, 6), 10, torch.float64)
    if schedule != "passes":
        exact_vs_whole_batch(ref, ours, batch, 3, 1e-9, schedule=schedule)
        return
    accumnorm.backward(ours, batch, ce_loss, micro_batch_size=3, bn="micro")
    snap, state = snapshot(ours), torch.random.get_rng_state()
    with pytest.raises(ValueError, match=r"passes schedule .* use_reentrant=True\)\. Nothing was changed\. Use "
                                         r"torch\.utils\.checkpoint\(\.\.\., use_reentrant=False\)"):
        accumnorm.backward(ours, batch, ce_loss, micro_batch_size=3, schedule=schedule)
    assert_unchanged(ours, snap)
    assert torch.equal(torch.random.get_rng_state(), state)


class InFunction(torch.autograd.Function):
    """A custom Function that runs a BatchNorm layer in its forward and has a backward of its own."""

    @staticmethod
    def forward(ctx, x, bn):
        ctx.bn = bn
        return bn(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def test_batchnorm_inside_a_custom_function_is_refused_naming_it(schedule):
    bn, head = nn.BatchNorm1d(4), nn.Linear(4, 10)
    model = nn.ModuleDict({"bn": bn, "head": head})
    loss_fn = lambda m, b: ce_loss(lambda x: m["head"](InFunction.apply(x, m["bn"])), b)  # noqa: E731
    batch = (torch.randn(8, 4, requires_grad=True), torch.randint(0, 10, (8,)))
    snap = snapshot(model)
    with pytest.raises(ValueError, match="custom autograd.Function InFunction"):
        accumnorm.backward(model, batch, loss_fn, micro_batch_size=4, schedule=schedule)
    assert_unchanged(model, snap)


def _densenets(**config):
    """torchvision's DenseNet with memory_efficient=True (every dense layer's BatchNorm in a checkpointed region,
    use_reentrant=False), and the same net and weights without."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.DenseNet(num_classes=10, memory_efficient=True, **config).double()
    ref = torchvision.models.DenseNet(num_classes=10, **config).double()
    ref.load_state_dict(model.state_dict())
    return model, ref


@pytest.mark.parametrize("schedule", EXACT_SCHEDULES)
def test_a_memory_efficient_densenet_is_exact(schedule):
    model, ref = _densenets(growth_rate=4, block_config=(2, 3), num_init_features=8)
    batch = (torch.randn(5, 3, 24, 24, dtype=torch.float64), torch.randint(0, 10, (5,)))
    expected = whole_batch(ref, batch)
    loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule=schedule)
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)


@pytest.mark.slow
def test_densenet121_memory_efficient_is_exact():
    """densenet121 itself, under the default schedule (passes takes 2L + 1 = 241 passes over it)."""
    model, ref = _densenets(growth_rate=32, block_config=(6, 12, 24, 16), num_init_features=64)
    batch = (torch.randn(6, 3, 32, 32, dtype=torch.float64), torch.randint(0, 10, (6,)))
    expected = whole_batch(ref, batch)
    loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=2)
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)


@pytest.mark.slow
def test_timm_grad_checkpointing_is_exact():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    ref = timm.create_model("resnet18", num_classes=10).double()
    model = copy.deepcopy(ref)
    model.set_grad_checkpointing()
    batch = (torch.randn(6, 3, 32, 32, dtype=torch.float64), torch.randint(0, 10, (6,)))
    expected = whole_batch(ref, batch)
    for schedule in EXACT_SCHEDULES:
        ours = copy.deepcopy(model)
        loss = accumnorm.backward(ours, batch, ce_loss, micro_batch_size=2, schedule=schedule)
        assert rel_err(loss, expected) < 1e-12
        compare(ref, ours, 1e-9)
