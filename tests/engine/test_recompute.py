"""The recompute schedule and "auto"'s choice by memory, against whole-batch torch (the oracle suites run recompute
too, through the `schedule` fixture): what it keeps for the backward, its refusals, the budget and its errors."""
from __future__ import annotations

import copy
import random
import re
import warnings
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_map

import accumnorm
from accumnorm._engine.bn.pieces import normalize_pieces
from accumnorm._engine.checkpointing import kept, recomputation
from accumnorm._engine.checkpointing import regions as regions_module
from accumnorm._engine.checkpointing.regions import Run, choose_regions
from accumnorm._engine.schedules import decide
from helpers import (
    SavedBytes,
    assert_unchanged,
    ce_loss,
    compare,
    exact_vs_whole_batch,
    live_peak,
    passes_need,
    quiet_next_step,
    rel_err,
    snapshot,
    whole_batch,
)
from models import data, wide_first, wide_inside


class Block(nn.Module):
    """A residual block: conv-BN-tanh-conv-BN, added to its input (`mid` channels between the convolutions)."""

    def __init__(self, c: int = 8, p: float = 0.0, mid: int | None = None) -> None:
        super().__init__()
        mid = c if mid is None else mid
        self.c1, self.b1, self.c2, self.b2 = nn.Conv2d(c, mid, 3, padding=1), nn.BatchNorm2d(mid), \
            nn.Conv2d(mid, c, 3, padding=1), nn.BatchNorm2d(c)
        self.p = p

    def forward(self, x):
        h = F.dropout(torch.tanh(self.b1(self.c1(x))), self.p, self.training)
        return x + self.b2(self.c2(h))


def net(block=Block, **kwargs) -> nn.Sequential:
    """A stem and six blocks: the recompute schedule checkpoints the blocks (all but the last)."""
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Tanh(),
                         *[block(**kwargs) for _ in range(6)], nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 10)).double()


def saved_peak(model: nn.Module, batch, schedule: str) -> int:
    """The peak bytes the step keeps for its backward outside checkpointed regions."""
    with SavedBytes(model.parameters()) as saved:
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule=schedule)
    return saved.peak


def test_recompute_is_exact_and_keeps_a_fraction_of_what_layerwise_keeps():
    """Only the blocks' inputs and the stem stay for the backward: the BatchNorm inputs inside the blocks are not
    kept in the driver either (they are saved in their regions' place)."""
    model, batch = net(), data((1, 12, 12), 8, torch.float64)
    ref = copy.deepcopy(model)
    expected = whole_batch(ref, batch)
    layerwise = saved_peak(copy.deepcopy(model), batch, "layerwise")
    with SavedBytes(model.parameters()) as saved:
        loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="recompute")
    assert accumnorm.last_schedule(model).schedule == "recompute"
    assert saved.peak < 0.5 * layerwise, (saved.peak, layerwise)
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)


def test_recompute_draws_the_dropout_masks_layerwise_draws():
    """Dropout inside the regions: the recomputation replays the forward's draws, from each micro-batch's stream."""
    model, batch = net(p=0.3), data((1, 8, 8), 8, torch.float64)
    results = []
    for schedule in ("layerwise", "recompute", "layerwise"):
        m = copy.deepcopy(model)
        torch.manual_seed(3 if len(results) < 2 else 4)
        results.append((m, accumnorm.backward(m, batch, ce_loss, micro_batch_size=2, schedule=schedule)))
    (a, loss_a), (b, loss_b), (c, _) = results
    assert rel_err(loss_b, loss_a) < 1e-12
    compare(a, b, 1e-9)
    with pytest.raises(AssertionError):  # another seed, other masks: the comparison above can fail
        compare(a, c, 1e-3)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_a_micro_batchs_regions_keep_one_random_state_until_it_draws(p, monkeypatch):
    """Each region call keeps the CPU generator's state for its recomputation (5 KB): a micro-batch's calls between
    which nothing random ran keep one tensor for it, not one each; with dropout in every block, each its own."""
    states = []
    init = recomputation.RegionFrame.__init__

    def recording(self, *args):
        init(self, *args)
        states.append(self.recompute_fn.args[1][0])  # (fn, random state, modes, device): the CPU generator's

    monkeypatch.setattr(recomputation.RegionFrame, "__init__", recording)
    model, batch = net(p=p), data((1, 8, 8), 8, torch.float64)
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="recompute")
    assert len(states) == 4 * 8  # 4 micro-batches, 8 region calls each
    values = {tuple(t.tolist()) for t in states}
    assert len({id(t) for t in states}) == len(values)  # one tensor for each state, shared only where equal
    assert len(values) == (4 if p == 0 else 4 * 7)  # with dropout, every call after a block has a state of its own


def test_the_frames_of_a_step_share_one_metadata_tuple_per_kind_of_saved_tensor(monkeypatch):
    """Each region call notes the shape, dtype and device of every tensor it saves, for its recomputation's check:
    the same note is one tuple for the whole step, not one per region call and micro-batch."""
    metadata = []
    init = recomputation.RegionFrame.__init__

    def recording(self, *args):
        init(self, *args)
        metadata.append(self.metadata)  # filled in as the forward saves

    monkeypatch.setattr(recomputation.RegionFrame, "__init__", recording)
    model, batch = net(), data((1, 8, 8), 8, torch.float64)
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="recompute")
    notes = [m for frame in metadata for m in frame]
    assert len(notes) > 4 * 8  # 4 micro-batches, 8 region calls each, several saved tensors each
    assert len({id(m) for m in notes}) == len(set(notes))


def test_hooks_inside_a_region_run_again_in_its_recomputation():
    """As the docstring's warning says: a region's modules run in the forward and again in the backward."""
    model, batch = net(), data((1, 8, 8), 8, torch.float64)
    calls = {"first": 0, "last": 0, "head": 0}
    model[3].b1.register_forward_hook(lambda *a: calls.__setitem__("first", calls["first"] + 1))
    model[8].b1.register_forward_hook(lambda *a: calls.__setitem__("last", calls["last"] + 1))
    model[11].register_forward_pre_hook(lambda *a: calls.__setitem__("head", calls["head"] + 1))
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="recompute")
    assert calls == {"first": 8, "last": 8, "head": 8}  # the head (pool, flatten, linear) is a run, too
    # Measured, the head saves little against a block: from the next step on it runs as it is.
    calls.update(first=0, last=0, head=0)
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="recompute")
    assert calls == {"first": 8, "last": 8, "head": 4}


def wide(block=Block) -> nn.Sequential:
    """A stem and four blocks of 32 channels: each block's first 3x3 convolution sums 288 products per output value,
    into 4 channels (an output a small share of its region's saved bytes; its second sums 36)."""
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.Tanh(),
                         *[block(c=32, mid=4) for _ in range(4)], nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(32, 10)).double()


def count_convolutions(conv: nn.Conv2d) -> list[int]:
    """How often `conv` computes its output (its `_conv_forward`), whoever calls it."""
    runs = [0]
    compute = conv._conv_forward

    def counted(*args):
        runs[0] += 1
        return compute(*args)
    conv._conv_forward = counted
    return runs


class InPlace(Block):
    """A block whose first convolution's output is changed in place before its BatchNorm."""

    def forward(self, x):
        h = torch.tanh(self.b1(F.relu(self.c1(x), inplace=True)))
        return x + self.b2(self.c2(h))


class ThroughData(Block):
    """A block that changes its first convolution's output through `.data`, which no version counter sees."""

    def forward(self, x):
        h = self.c1(x)
        h.data.mul_(2)
        return x + self.b2(self.c2(torch.tanh(self.b1(h))))


@pytest.mark.parametrize("block", [Block, InPlace, ThroughData])
def test_a_region_keeps_its_costly_convolutions_outputs_whatever_the_forward_does_to_them(block):
    """A convolution of 32 channels at 3x3 (288 products per output value) keeps its output for its region's
    recomputation, from the step after the one that measured it (the first block's first one: of equal reductions,
    the first in the model's order fits in the allowance): it then runs once per micro-batch, as in plain
    accumulation, where one of 8 channels runs twice (its region recomputes it). The region keeps a copy: an
    output the forward changes in place afterwards (ReLU(inplace=True), or through .data, which no version
    counter sees) is changed again by the recomputation, from the convolution's own output. Exact every time."""
    model, batch = wide(block), data((1, 6, 6), 8, torch.float64)
    assert model[3] in choose_regions(model)
    ref = copy.deepcopy(model)
    for step in range(2):
        for m in (model, ref):
            m.zero_grad()
        expected = whole_batch(ref, batch)
        conv = count_convolutions(model[3].c1)
        loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="recompute")
        assert accumnorm.last_schedule(model).schedule == "recompute"
        assert conv == [8 if step == 0 else 4]
        assert rel_err(loss, expected) < 1e-12
        compare(ref, model, 1e-9)
    narrow = net()
    for _ in range(2):
        narrow_runs = count_convolutions(narrow[3].c1)
        accumnorm.backward(narrow, data((1, 6, 6), 8, torch.float64), ce_loss, micro_batch_size=2,
                           schedule="recompute")
    assert narrow_runs == [8]


def test_under_autocast_a_convolution_saves_a_copy_and_runs_again():
    """Autocast saves the convolution's arguments as bfloat16 copies, which the recomputation cannot pack again
    without running it: the convolution runs twice, as in any checkpointed region. The blocks stay regions once
    measured: a region's saved bytes leave out its weights' bfloat16 copies, not their float32 size (which left
    nothing, and every region ran as it is)."""
    model, batch = wide().float(), data((1, 6, 6), 8, torch.float32)
    for _ in range(2):
        runs = count_convolutions(model[3].c1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="recompute")
        assert accumnorm.last_schedule(model).schedule == "recompute"
        assert all(model[i] in choose_regions(model) for i in range(3, 7))
        assert runs == [8]
        assert torch.isfinite(loss)


def test_the_kept_outputs_fit_in_a_tenth_of_the_largest_regions_saved_bytes():
    """Of the candidates (every block's first convolution), those of the largest reductions keep their outputs, as
    many as fit in the allowance: a tenth of what the largest region saves, per sample."""
    model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.Tanh(),
                          nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.Tanh(),
                          *[Block(c=32, mid=4) for _ in range(5)], nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(32, 10)).double()
    batch = data((1, 6, 6), 8, torch.float64)
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="recompute")
    regions = choose_regions(model)
    allowance = regions_module.keep_allowance(regions)
    candidates = [m for m in model.modules() if kept.keeps(m)]
    sizes = [kept.output_bytes(m) for m in candidates if kept.output_bytes(m) is not None]
    assert allowance > 0 and len(sizes) == 5
    chosen = kept.choose(candidates, allowance)
    assert 0 < len(chosen) < len(sizes)  # some fit, not all
    assert sum(kept.output_bytes(m) for m in chosen) <= allowance
    assert allowance == 0.1 * max(regions_module.measured_saved(regions))


class Counting(Block):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


class Tracking(Block):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen += x.shape[0]
        return super().forward(x)


class Noting(Block):
    """A block that notes its input's shape on itself: the same note from every micro-batch, so exact under layerwise,
    but an attribute a recomputation would set again."""

    def forward(self, x):
        self.shape_seen = tuple(x.shape[1:])
        return super().forward(x)


@pytest.mark.parametrize("block, what, micro_batch_size", [(Counting, "set its attribute 'calls'", 8),
                                                           (Tracking, "changed its buffer 'seen'", 8),
                                                           (Noting, "set its attribute 'shape_seen'", 2)])
def test_a_region_that_changes_its_state_runs_under_layerwise_with_a_warning(block, what, micro_batch_size):
    """Recompute would run the region's forward again in the backward: it falls back to layerwise, saying why. A
    count or a buffer that every forward moves is refused by layerwise with several micro-batches (test_side_effects):
    those run at one micro-batch, the whole batch's forward, counted once as in torch."""
    model, batch = net(block), data((1, 8, 8), 8, torch.float64)
    ref = copy.deepcopy(model)
    expected = whole_batch(ref, batch)
    with pytest.warns(RuntimeWarning, match=f"{what}.*recomputation would not be exact.*using the layerwise"):
        loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=micro_batch_size, schedule="recompute")
    assert accumnorm.last_schedule(model).schedule == "layerwise"
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)
    if block is Counting:  # the layerwise run found the attributes as the step did: the first attempt left no count
        assert {m.calls for m in model.modules() if isinstance(m, Counting)} == {1}
    elif block is Tracking:
        assert {m.seen.item() for m in model.modules() if isinstance(m, Tracking)} == {8}


def test_the_fallback_warning_points_at_the_line_that_called_the_trainer():
    """Reached through the Trainer, one call deeper than through accumnorm.backward, the warning still names the
    user's line, not accumnorm's."""
    model, batch = net(Noting), data((1, 8, 8), 8, torch.float64)
    trainer = accumnorm.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), ce_loss, micro_batch_size=2,
                                schedule="recompute")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.step(batch)
    fallback = [w for w in caught if "using the layerwise schedule" in str(w.message)]
    assert len(fallback) == 1 and fallback[0].filename == __file__, [(w.filename, w.lineno) for w in caught]


def test_autos_warning_points_at_the_callers_line_and_gives_a_small_budget_in_a_unit_that_shows_it():
    model, batch = net(), data((1, 12, 12), 8, torch.float64)
    budget = passes_need(model, batch, ce_loss, 2)  # what one micro-batch's pass keeps, less than the others: passes
    assert 1 << 10 <= budget < 1 << 20
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, memory_budget=budget)
    told = [w for w in caught if "accumnorm.backward(schedule='auto')" in str(w.message)]
    assert len(told) == 1 and told[0].filename == __file__, [(w.filename, w.lineno) for w in caught]
    assert accumnorm.last_schedule(model).schedule == "passes"
    assert f"running the passes schedule within the memory budget of {budget / 1024:.0f} KiB" in str(told[0].message)


class Flips(Block):
    """A block whose forward depends on `training` and on `flipped`, and saves nothing more for them."""

    def forward(self, x):
        h = torch.tanh(self.b1(self.c1(x)))
        return x + self.b2(self.c2(h.flip(-1) if self.training != self.flipped else h))


class Toggles(nn.Module):
    """Runs its second block with `training` off for the call and back on after, as a parent may for one part."""

    def __init__(self, attribute: str) -> None:
        super().__init__()
        self.attribute = attribute
        self.stem = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Tanh())
        self.blocks = nn.ModuleList(Flips() for _ in range(3))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    def forward(self, x):
        x = self.stem(x)
        for i, b in enumerate(self.blocks):
            if i == 1:
                during = self.attribute == "flipped"  # training off, or flipped on, for this call alone
                setattr(b, self.attribute, during)
                x = b(x)
                setattr(b, self.attribute, not during)
            else:
                x = b(x)
        return self.head(x)


@pytest.mark.parametrize("attribute", ["training", "flipped"])
def test_a_region_called_with_its_state_switched_and_switched_back_runs_under_layerwise(attribute):
    """The state a region's forward ran with must be the one its recomputation runs with, at the forward's end: a
    flag switched around one call and back would make the recomputation another function (a gradient 0.67 off)."""
    model = Toggles(attribute).double()
    for b in model.blocks:
        b.flipped = False
    batch = data((1, 8, 8), 8, torch.float64)
    assert model.blocks[1] in choose_regions(model)
    ref = copy.deepcopy(model)
    expected = whole_batch(ref, batch)
    with pytest.warns(RuntimeWarning, match=f"called with its attribute '{attribute}' set otherwise.*using the "
                                            "layerwise"):
        loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="recompute")
    assert accumnorm.last_schedule(model).schedule == "layerwise"
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)


def test_a_region_whose_recomputation_makes_more_batchnorm_calls_is_refused_and_changes_nothing():
    calls: dict[int, int] = {}

    class Unsteady(Block):
        """Normalizes its input first from its fifth call on: in its recomputation, not in the step's 4 forwards."""

        def forward(self, x):
            calls[id(self)] = calls.get(id(self), 0) + 1
            return super().forward(self.b1(x) if calls[id(self)] > 4 else x)

    model, batch = net(Unsteady), data((1, 8, 8), 8, torch.float64)
    snap = snapshot(model)
    # The recomputation runs to its end, where the extra call finds no recorded output left.
    with pytest.raises(ValueError, match="recomputation made more BatchNorm calls than its forward"):
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="recompute")
    assert_unchanged(model, snap)


@pytest.mark.parametrize("change", ["count", "shape"])
def test_a_region_whose_recomputation_saves_other_tensors_is_refused_as_torchs_checkpoint_refuses_it(change):
    """The schedule's own regions check what their recomputation saves as torch's checkpoint does: as many tensors,
    of the same shapes, dtypes and devices, or torch's `CheckpointError`, with nothing changed."""
    from torch.utils.checkpoint import CheckpointError

    calls: dict[int, int] = {}

    class Unsteady(Block):
        """From its fifth call on (its recomputation, after the step's 4 forwards), saves one tensor more, or runs
        on its input twice over and saves tensors of another shape, for the same output."""

        def forward(self, x):
            calls[id(self)] = calls.get(id(self), 0) + 1
            if calls[id(self)] <= 4:
                return super().forward(x)
            if change == "count":
                return super().forward(x + torch.tanh(x) * 0)
            return super().forward(torch.cat([x, x]))[:len(x)]

    model, batch = net(Unsteady), data((1, 8, 8), 8, torch.float64)
    snap = snapshot(model)
    with pytest.raises(CheckpointError, match="different number" if change == "count" else "different metadata"):
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="recompute")
    assert_unchanged(model, snap)


class ChangesBlockInput(nn.Module):
    """net()'s blocks, each block's input halved in place after the block's call saved it."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8))
        self.blocks = nn.ModuleList(Block() for _ in range(6))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    def forward(self, x):
        h = self.stem(x) + 0
        for block in self.blocks:
            y = block(h)
            h.mul_(0.5)
            h = y + 0
        return self.head(h)


def test_an_input_of_a_region_changed_in_place_after_its_call_is_refused_as_torch_refuses_it():
    """A region keeps its input for its recomputation; changed in place after the call, it would be recomputed from
    the changed tensor. Whole-batch torch refuses at the backward; so does the region's recomputation."""
    model, batch = ChangesBlockInput().double(), data((1, 8, 8), 8, torch.float64)
    assert model.blocks[0] in choose_regions(model)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        whole_batch(copy.deepcopy(model), batch)
    snap = snapshot(model)
    with pytest.raises(RuntimeError, match="modified by an inplace operation: an input .* recompute schedule"):
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="recompute")
    assert_unchanged(model, snap)


class ChangesSaved(Block):
    """Changes tanh's output in place after tanh saved it for its backward, which autograd refuses."""

    def forward(self, x):
        h = torch.tanh(self.b1(self.c1(x)))
        h.mul_(2)
        return x + self.b2(self.c2(h))


def test_a_saved_tensor_changed_in_place_in_a_region_is_refused_as_torch_refuses_it():
    """Whole-batch torch raises "modified by an inplace operation" at the backward. A checkpointed region saves
    placeholders, which autograd cannot check, and its recomputation changes the tensor again: the backward would
    read the changed one (a gradient 27x off). The region's recomputation notes each saved tensor's version, and the
    backward refuses as torch's does, with nothing changed."""
    model, batch = net(ChangesSaved), data((1, 8, 8), 8, torch.float64)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        whole_batch(copy.deepcopy(model), batch)
    snap = snapshot(model)
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*recompute schedule.*Nothing was changed"):
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="recompute")
    assert_unchanged(model, snap)


# ---------------------------------------------------------------- runs of an nn.Sequential's children


def stack(cls=nn.Sequential, affine: bool = True) -> nn.Sequential:
    """A VGG-like stack of single layers (no block to checkpoint whole): conv-BN-tanh-pool four times, a head."""
    layers: list[nn.Module] = []
    c0 = 1
    for c in (4, 6, 8, 8):
        layers += [nn.Conv2d(c0, c, 3, padding=1), nn.BatchNorm2d(c, affine=affine), nn.Tanh(),
                   nn.AvgPool2d(2, ceil_mode=True)]
        c0 = c
    return cls(*layers, nn.Flatten(), nn.Linear(c0, 10)).double()


@pytest.mark.parametrize("affine", [True, False])
def test_a_stack_of_single_layers_is_checkpointed_in_runs_of_its_children_exactly(affine):
    """The Sequential's children are gathered into runs, each one checkpointed region: the step keeps a fraction of
    what layerwise keeps, exactly, and every child's hooks run as torch runs them, twice in a checkpointed run."""
    model, batch = stack(affine=affine), data((1, 16, 16), 8, torch.float64)
    runs = [r for r in choose_regions(model) if isinstance(r, Run)]
    assert runs and all(r.parent is model and r.stop - r.start >= 2 for r in runs), runs
    ref = copy.deepcopy(model)
    expected = whole_batch(ref, batch)
    layerwise = saved_peak(copy.deepcopy(model), batch, "layerwise")
    calls = {"first": 0, "pre": 0, "head": 0}
    model[1].register_forward_hook(lambda *a: calls.__setitem__("first", calls["first"] + 1))
    model[2].register_forward_pre_hook(lambda *a: calls.__setitem__("pre", calls["pre"] + 1))
    model[17].register_forward_pre_hook(lambda *a: calls.__setitem__("head", calls["head"] + 1))
    with SavedBytes(model.parameters()) as saved:
        loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="recompute")
    assert saved.peak < 0.5 * layerwise, (saved.peak, layerwise)
    assert calls == {"first": 8, "pre": 8, "head": 8}
    assert "forward" not in vars(model)  # the Sequential's own forward again after the step
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)


class TwoPaths(nn.Module):
    """`body` under two names, the forward calling it through the second."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body, self.alias = body, body

    def forward(self, x):
        return self.alias(x)


@pytest.mark.slow
def test_a_sequential_reached_by_two_paths_is_cut_into_each_run_once():
    """A module reached twice in the walk (here under two names, as torch.compile's wrapper holds its module) gives
    its runs once: a run given twice ran its children twice over, into a shape error."""
    model, batch = TwoPaths(stack()), data((1, 16, 16), 8, torch.float64)
    runs = [(r.start, r.stop) for r in choose_regions(model) if isinstance(r, Run)]
    assert runs and len(runs) == len(set(runs)), runs
    ref = copy.deepcopy(model)
    expected = whole_batch(ref, batch)
    loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="recompute")
    assert accumnorm.last_schedule(model).schedule == "recompute"
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)


class OwnForward(nn.Sequential):
    """A Sequential with a forward of its own: the step cannot run its children in runs."""

    def forward(self, x):
        return super().forward(x) * 2


def test_a_sequential_with_a_forward_of_its_own_is_not_cut_into_runs():
    model, batch = stack(OwnForward), data((1, 16, 16), 8, torch.float64)
    assert not any(isinstance(r, Run) for r in choose_regions(model))
    ref = copy.deepcopy(model)
    expected = whole_batch(ref, batch)
    loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="recompute")
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)


class Stash(nn.Module):
    """Keeps its input as an attribute: a change to the module's state in the forward."""

    def forward(self, x):
        self.last = x
        return x


def test_a_run_whose_child_changes_its_state_runs_under_layerwise_with_a_warning():
    model = stack()
    model.insert(1, Stash())  # inside the first run
    batch = data((1, 16, 16), 8, torch.float64)
    assert any(isinstance(r, Run) and r.start <= 1 < r.stop for r in choose_regions(model))
    ref = copy.deepcopy(model)
    expected = whole_batch(ref, batch)
    with pytest.warns(RuntimeWarning, match="Stash.*set its attribute 'last'.*using the layerwise"):
        loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="recompute")
    assert accumnorm.last_schedule(model).schedule == "layerwise"
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)


class ConvBN(nn.Module):
    def __init__(self, c: int = 6) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.tanh(self.bn(self.conv(x)))


class Looped(nn.Module):
    """Calls its Sequential's children itself, as ultralytics' detectors do: the Sequential's forward never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 6, 3, padding=1)
        self.layers = nn.Sequential(*[ConvBN() for _ in range(12)])
        self.head = nn.Linear(6, 10)

    def forward(self, x):
        x = self.stem(x)
        for m in self.layers:
            x = m(x)
        return self.head(x.mean((2, 3)))


def test_a_sequentials_children_of_several_layers_stay_regions_of_their_own():
    """Small blocks of two layers are regions alone, not runs, which only a call of the Sequential's forward would
    checkpoint: here the model loops over the children itself, and recompute still keeps a fraction of layerwise."""
    model, batch = Looped().double(), data((1, 12, 12), 8, torch.float64)
    assert not any(isinstance(r, Run) for r in choose_regions(model))
    ref = copy.deepcopy(model)
    expected = whole_batch(ref, batch)
    layerwise = saved_peak(copy.deepcopy(model), batch, "layerwise")
    with SavedBytes(model.parameters()) as saved:
        loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="recompute")
    assert saved.peak < 0.5 * layerwise, (saved.peak, layerwise)
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)


class Stage(nn.Module):
    """A stage that iterates its blocks itself, as ultralytics' C2f does: its ModuleList is never called."""

    def __init__(self, c: int = 6) -> None:
        super().__init__()
        self.first, self.blocks = ConvBN(c), nn.ModuleList([ConvBN(c), ConvBN(c)])

    def forward(self, x):
        x = self.first(x)
        for block in self.blocks:
            x = block(x)
        return x


class Detector(nn.Module):
    """Loops over its Sequential's children, pooling between stages; two parameter-free children sit side by side,
    a run that the Sequential's forward would checkpoint, but it is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 6, 3, padding=1)
        self.layers = nn.Sequential(Stage(), nn.Identity(), nn.Identity(), Stage(), Stage(), Stage())
        self.head = nn.Linear(6, 10)

    def forward(self, x):
        x = self.stem(x)
        for i, m in enumerate(self.layers):
            x = F.avg_pool2d(m(x), 2) if i in (0, 3) else m(x)
        return self.head(x.mean((2, 3)))


def test_a_region_that_never_runs_leaves_the_measured_ones_weighed():
    """A ModuleList is no region (its blocks are), and a run that never runs is not measured. Once a step has
    measured the rest, the least-saving regions run as they are and the kept outputs get their allowance: one
    unmeasured region used to leave every region checkpointed and the allowance at nothing."""
    model, batch = Detector().double(), data((1, 16, 16), 8, torch.float64)
    before = choose_regions(model)
    assert not any(isinstance(r, nn.ModuleList) for r in before)
    assert model.layers[0].blocks[0] in before and any(isinstance(r, Run) for r in before)
    ref = copy.deepcopy(model)
    for _ in range(2):
        expected = whole_batch(ref, batch)
        loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="recompute")
        assert rel_err(loss, expected) < 1e-12
        compare(ref, model, 1e-9)
    after = choose_regions(model)
    assert len(after) < len(before) and model.layers[0].blocks[0] in after
    assert regions_module.keep_allowance(after) > 0


def test_a_met_call_in_regions_holds_no_more_than_its_input_and_one_more_tensor_of_the_whole_batch():
    """A wide first BatchNorm (everything else small): a met call inside regions makes no concatenated copy of its
    input, the driver lets go of each micro-batch's piece as it resumes it, and the backward lets go of each piece
    once its gradient is made; so the step's peak stays near two whole-batch tensors of that size (the input and
    the output in the forward; the input and its gradient in the backward), not three or more."""
    model = wide_first()
    batch = data((1, 32, 32), 16, torch.float64)
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="recompute")  # first calls' caches
    model.zero_grad(set_to_none=True)
    wide = 16 * 32 * 32 * 32 * 8  # the first BatchNorm's input (and output) of the whole batch
    peak = live_peak(lambda: accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="recompute"))
    assert peak < 2.5 * wide, (peak / wide)


class _StatisticsKernels(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts torch's BatchNorm statistics kernel calls under it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.aten.batch_norm_update_stats.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("k", [2, 8])
def test_a_met_call_in_regions_takes_its_statistics_in_one_kernel_call_whatever_the_micro_batches(k):
    """A met call inside regions takes the whole batch's statistics with one call of torch's statistics kernel, on
    its pieces concatenated, not one per micro-batch and a merge: on a net of small layers the merge's ops were
    most of the call's cost. Each of `net`'s BatchNorm layers is called once, inside a region."""
    model, batch = net(), data((1, 8, 8), 16, torch.float64)
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=16 // k, schedule="recompute")
    model.zero_grad(set_to_none=True)
    with _StatisticsKernels() as kernels:
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=16 // k, schedule="recompute")
    assert accumnorm.last_schedule(model).schedule == "recompute"
    assert kernels.calls == sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 13


def test_a_half_precision_met_call_takes_its_float32_statistics_from_one_copy():
    """bfloat16 pieces without running statistics: their float32 statistics read one float32 copy of the whole
    batch, made by the concatenation itself (two bfloat16 inputs' worth), not a bfloat16 concatenation and a float32
    copy of it besides; and the copy goes before the outputs are made."""
    pieces = [torch.randn(8, 16, 32, 32).bfloat16() for _ in range(4)]
    args = SimpleNamespace(weight=torch.ones(16), bias=torch.zeros(16), running_mean=None, running_var=None, eps=1e-5)
    whole = sum(p.numel() * p.element_size() for p in pieces)
    with torch.no_grad():
        peak = live_peak(lambda: normalize_pieces(args, pieces, [()] * 4, 0.1))
    assert 2 * whole <= peak < 2.5 * whole, peak / whole


# ---------------------------------------------------------------- "auto" and memory_budget


def figures(model: nn.Module, batch) -> tuple[int, int, int]:
    """Gradient bytes, and what layerwise and recompute keep for the backward, measured on copies of `model`."""
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    return grads, saved_peak(copy.deepcopy(model), batch, "layerwise"), saved_peak(copy.deepcopy(model), batch,
                                                                                  "recompute")


def test_auto_runs_recompute_where_layerwise_would_pass_the_budget_exactly_and_says_so():
    model, batch = net(), data((1, 12, 12), 8, torch.float64)
    grads, layerwise, recompute = figures(model, batch)
    budget = grads + (layerwise + recompute) // 2
    ref = copy.deepcopy(model)
    expected = whole_batch(ref, batch)
    with pytest.warns(RuntimeWarning, match="running the recompute schedule within the memory budget.*layerwise"):
        loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, memory_budget=budget)
    choice = accumnorm.last_schedule(model)
    assert choice.schedule == "recompute" and choice.budget == budget and "layerwise" in choice.reason
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)
    # The next step knows the figures: straight to recompute, exact again, and no second warning. Layerwise's is
    # what its meter counted before it stopped the step: what layerwise keeps at least.
    loss, expected = quiet_next_step(model, ref, batch, micro_batch_size=2, memory_budget=budget)
    assert accumnorm.last_schedule(model).schedule == "recompute"
    assert "layerwise would keep at least" in accumnorm.last_schedule(model).reason
    assert "measured at an earlier step" in accumnorm.last_schedule(model).reason
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)


def test_auto_runs_passes_where_every_other_schedule_would_pass_the_budget():
    """A budget with room for the gradients and one micro-batch's pass alone: every metered schedule, segments at
    each of its settings, stops at its meter, and passes runs, exactly, within it, saying why."""
    model, batch = net(), data((1, 12, 12), 8, torch.float64)
    budget = passes_need(model, batch, ce_loss, 2)
    ref = copy.deepcopy(model)
    expected = whole_batch(ref, batch)
    with pytest.warns(RuntimeWarning, match="running the passes schedule"):
        loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, memory_budget=budget)
    choice = accumnorm.last_schedule(model)
    assert choice.schedule == "passes" and choice.need == budget, choice
    for name in ("layerwise", "recompute", "segments(keep_every=1)", "segments(keep_every=2)",
                 "segments(keep_every=4)"):
        assert f"{name} would keep more than" in choice.reason, (name, choice.reason)
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)


def test_auto_counts_recomputes_backward_before_it_runs_and_runs_segments_where_only_the_forward_fits():
    """The backward recomputes the first region for every micro-batch at once (the BatchNorm call after it waits for
    all of them): its wide tensor of the whole batch. A budget with room for recompute's forward but not for that
    runs segments, which recomputes one micro-batch at a time, exactly, and says why; the recomputation is counted
    before the backward makes it."""
    model, batch = wide_inside(), data((1, 32, 32), 16, torch.float64)
    grads, _, forward = figures(model, batch)
    wide = 16 * 32 * 32 * 32 * 8  # the first region's wide tensor of the whole batch
    budget = grads + forward + wide // 2
    ref = copy.deepcopy(model)
    expected = whole_batch(ref, batch)
    with pytest.warns(RuntimeWarning, match=r"running the segments\(keep_every=1\) schedule"):
        loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, memory_budget=budget)
    choice = accumnorm.last_schedule(model)
    assert choice.schedule == "segments" and "recompute would keep more than" in choice.reason, choice
    assert choice.reason.endswith("it ran, keeping the arguments of one region in 1 of a chain"), choice
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)


def test_a_figure_its_meter_stopped_is_a_floor_and_a_larger_budget_meters_the_schedule_again():
    """A meter that stops a schedule has counted only what it kept until then. A later step whose budget that floor
    fits runs the schedule metered again, not on the floor's word: where it still does not fit, the meter stops it
    again and the step runs the next schedule, exactly, saying why."""
    model, batch = net(), data((1, 12, 12), 8, torch.float64)
    grads, layerwise, recompute = figures(model, batch)
    assert recompute < layerwise
    ref = copy.deepcopy(model)
    whole_batch(ref, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the first step leaves layerwise: a warning, once
        budget = passes_need(model, batch, ce_loss, 2)
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, memory_budget=budget)
    assert "layerwise would keep more than" in accumnorm.last_schedule(model).reason
    loss, expected = quiet_next_step(model, ref, batch, micro_batch_size=2,
                                     memory_budget=grads + (layerwise + recompute) // 2)
    choice = accumnorm.last_schedule(model)
    assert choice.schedule == "recompute" and "layerwise would keep more than" in choice.reason, choice
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)


def test_auto_meters_every_recompute_step_and_judges_the_next_by_the_last_ones_figure():
    """Recompute's regions and kept convolution outputs follow what the last step measured, so a step keeps what the
    first one did not: each of its steps runs metered, and the next step is judged by the last one's figure. A budget
    below the first step's need but with room for the second's runs recompute, exactly."""
    model, batch = wide(), data((1, 6, 6), 8, torch.float64)
    grads, layerwise, _ = figures(model, batch)
    needs = []
    for step in range(2):
        with pytest.warns(RuntimeWarning, match="running the recompute schedule") if step == 0 else nullcontext():
            accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, memory_budget=grads + layerwise - 1)
        choice = accumnorm.last_schedule(model)
        assert choice.schedule == "recompute", choice
        needs.append(choice.need)
    assert needs[1] != needs[0]  # the second step was measured anew
    budget = (needs[0] + needs[1]) // 2
    assert needs[1] <= budget < needs[0], needs
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m.zero_grad()
    expected = whole_batch(ref, batch)
    loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, memory_budget=budget)
    assert accumnorm.last_schedule(model).schedule == "recompute"
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)


def test_auto_with_room_runs_layerwise():
    model, batch = net(), data((1, 12, 12), 8, torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, memory_budget=2**40)
    assert accumnorm.last_schedule(model).schedule == "layerwise"


def test_autos_figure_leaves_out_the_views_of_parameters_a_step_saves():
    """A Linear's matmul saves its weight transposed: a view of the parameter, no memory the step makes. The figure
    "auto" judges by is the saved activations and the gradients, not the weights again."""
    model = nn.Sequential(nn.Linear(64, 512), nn.BatchNorm1d(512), nn.Tanh(), nn.Linear(512, 2048),
                          nn.BatchNorm1d(2048), nn.Tanh(), nn.Linear(2048, 10)).double()
    batch = data((64,), 16, torch.float64)
    grads, saved, _ = figures(model, batch)
    weights = 2048 * (512 + 10) * 8  # those whose input requires grad: their matmuls save them
    assert saved < weights // 4, (saved, weights)
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, memory_budget=2**40)
    choice = accumnorm.last_schedule(model)
    assert choice.schedule == "layerwise", choice
    assert grads + saved <= choice.need < grads + 2 * saved, (choice.need, grads, saved)


@pytest.mark.parametrize("budget, exc, words", [
    ("1GB", TypeError, ["memory_budget", "int", "str"]),
    (1.5e9, TypeError, ["memory_budget", "float"]),
    (True, TypeError, ["memory_budget", "bool"]),
    (0, ValueError, ["memory_budget", "positive", "0"]),
    (-5, ValueError, ["memory_budget", "positive", "-5"]),
    (1000, ValueError, ["memory_budget is 1000 bytes", "gradients alone take"]),
])
def test_a_bad_memory_budget_is_refused_before_anything_runs(budget, exc, words):
    model, batch = net(), data((1, 8, 8), 8, torch.float64)
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=2)
    snap, state = snapshot(model), torch.random.get_rng_state()
    with pytest.raises(exc) as error:
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, memory_budget=budget)
    assert all(w in str(error.value) for w in words), str(error.value)
    assert_unchanged(model, snap)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_a_budget_below_the_gradients_says_no_micro_batch_size_helps():
    """Below the gradients alone, the refusal says that no schedule or micro-batch size can keep less (it advised a
    smaller micro_batch_size, and named the passes schedule, whatever the step asked for); above them, below one
    micro-batch's pass more, it names what passes needs and the smaller micro-batch: passes' meter at the first
    step, its figure before the next."""
    model, batch = net(), data((1, 8, 8), 8, torch.float64)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    for step in (dict(), dict(schedule="layerwise"), dict(bn="micro")):
        with pytest.raises(ValueError) as error:
            accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, memory_budget=grads - 1, **step)
        message = str(error.value)
        assert f"the step's gradients alone take {grads} bytes" in message and "passes" not in message, message
        assert all(p.grad is None for p in model.parameters())
    for where in ("as far as its meter counted before it stopped the step", "measured at an earlier step"):
        with pytest.raises(ValueError, match=r"even the passes schedule, which keeps least, needs at least \d+ bytes.? "
                                             rf"\(?the step's gradients, {grads}, .*{where}.*smaller micro_batch_size"):
            accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, memory_budget=grads + 1)


def test_a_budget_below_what_passes_keeps_is_refused_at_the_first_step_as_at_every_later_one():
    """"auto" meters its last resort too: at a model's first step, with no figure yet, a budget above the gradients but
    below what one micro-batch's pass keeps is refused, naming both, with nothing changed (passes ran over it). The
    next step's check refuses it before anything runs, by the figure the meter left, as it does after a layerwise
    step; a budget of what passes needs runs it within that."""
    model, batch = net(), data((1, 12, 12), 8, torch.float64)
    grads, need = sum(p.numel() * p.element_size() for p in model.parameters()), passes_need(model, batch, ce_loss, 2)
    budget = (grads + need) // 2
    for _ in range(2):
        snap, state = snapshot(model), torch.random.get_rng_state()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing ran that "auto" would tell of
            with pytest.raises(ValueError) as error:
                accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, memory_budget=budget)
        message = str(error.value)
        assert f"memory_budget is {budget} bytes, but even the passes schedule" in message, message
        figure = int(re.search(r"needs (?:more than|at least) (\d+) bytes", message).group(1))
        assert budget < figure <= need, (budget, figure, need)
        assert_unchanged(model, snap)
        assert torch.equal(torch.random.get_rng_state(), state)
        assert accumnorm.last_schedule(model) is None
    ref = copy.deepcopy(model)
    expected = whole_batch(ref, batch)
    with pytest.warns(RuntimeWarning, match="running the passes schedule"):
        loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, memory_budget=need)
    assert accumnorm.last_schedule(model).need == need
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)


def test_passes_figure_counts_a_whole_batch_losss_outputs_and_their_gradients_held_through_its_passes():
    """With a whole-batch loss, passes holds every micro-batch's outputs and their gradients from the loss's pass to
    the step's end: its meter counts them beside what the full pass of one micro-batch keeps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 256)).double()
    x = torch.randn(32, 4, dtype=torch.float64)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    held = 2 * 32 * 256 * 8  # the outputs of the whole batch, and their gradients
    need = passes_need(model, x, None, 4, forward_fn=lambda m, b: m(b),
                       batch_loss_fn=lambda out, b: out.square().mean())
    assert grads + held < need < grads + held + 32 * 256 * 8, (need, grads, held)


@pytest.mark.parametrize("last_resort", [False, True], ids=["layerwise", "passes"])
def test_a_figure_leaves_out_the_batch_which_was_there_before_the_step(last_resort, monkeypatch):
    """Each micro-batch is a view of the batch, and the first layer saves it: the meter counted the whole batch's
    storage in a schedule's figure (in passes', whose pass holds one micro-batch, K times that micro-batch), memory
    the step does not add. The budget is what it adds."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()
    batch = (torch.randn(64, 512, dtype=torch.float64), torch.randint(0, 2, (64,)))
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    if last_resort:
        monkeypatch.setattr(decide, "_by_memory", lambda: [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=8, memory_budget=2**40)
    choice = accumnorm.last_schedule(model)
    assert choice.schedule == ("passes" if last_resort else "layerwise"), choice
    assert 0 < choice.need - grads < batch[0].nbytes // 8, (choice.need, grads, batch[0].nbytes)


def test_only_passes_own_figure_refuses_a_budget_before_a_step_and_only_an_auto_step():
    """The check before a step refused a budget below passes' need as layerwise's figure estimated it, more than
    passes keeps (layerwise holds every micro-batch's piece of a met call at once): after one layerwise step, a budget
    of passes' own need was refused at every step. A schedule asked for by name, or bn='micro', keeps what it keeps
    whatever the budget, which must hold the gradients: passes' figure refused those too. Now passes' own figure, of
    a step of as many samples, refuses an "auto" step alone; exactly (a budget one byte below it), before it runs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5)).double()
    batch = (torch.randn(10, 3, 12, 12, dtype=torch.float64), torch.randint(0, 5, (10,)))
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    need = passes_need(model, batch, ce_loss, 4)
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=4)  # layerwise, measured
    with pytest.warns(RuntimeWarning, match="running the passes schedule"):
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=4, memory_budget=need)
    assert accumnorm.last_schedule(model).schedule == "passes"
    for options in (dict(schedule="layerwise"), dict(schedule="passes"), dict(bn="micro")):
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=4, memory_budget=grads + 8, **options)
    snap = snapshot(model)
    with pytest.raises(ValueError, match=rf"needs about {need} bytes .*measured at an earlier step"):
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=4, memory_budget=need - 1)
    assert_unchanged(model, snap)


def test_a_figure_keeps_the_bytes_it_measured_exactly():
    """A figure was bytes per sample, a float: read back at the samples measured, it came out a byte low for some sizes
    (here 7 samples), so that a budget one byte below layerwise's need ran layerwise, unmetered, past it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 75), nn.BatchNorm1d(75), nn.ReLU(), nn.Linear(75, 3)).double()
    batch = (torch.randn(7, 5, dtype=torch.float64), torch.randint(0, 3, (7,)))
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=3, memory_budget=2**40)
    choice = accumnorm.last_schedule(model)
    assert choice.schedule == "layerwise", choice
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "auto" leaves layerwise: a warning
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=3, memory_budget=choice.need - 1)
    assert accumnorm.last_schedule(model).schedule != "layerwise"
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=3, memory_budget=choice.need)
    assert accumnorm.last_schedule(model).schedule == "layerwise"


def test_auto_tries_a_schedule_that_cannot_run_a_model_exactly_at_one_setting_only():
    """A region whose forward changes its state: recompute and segments refuse it (found after the forward, each
    try a forward of the whole batch), so "auto" below layerwise's need runs passes, exactly, having tried segments
    at its first setting only, and says each refusal once."""
    model, batch = net(Noting), data((1, 8, 8), 8, torch.float64)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    _, layerwise, _ = figures(net(), batch)
    ref = copy.deepcopy(model)
    expected = whole_batch(ref, batch)
    with pytest.warns(RuntimeWarning, match="running the passes schedule"):
        loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, memory_budget=grads + layerwise // 2)
    reason = accumnorm.last_schedule(model).reason
    assert reason.count("the recompute schedule runs a region's forward again") == 1, reason
    assert reason.count("the segments schedule runs a region's forward again") == 1, reason
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)


def test_a_stack_of_conv_batchnorm_and_in_place_relu_is_recomputed():
    """A VGG-like Sequential of conv, BatchNorm and ReLU(inplace=True): its runs were cut at any child, an in-place
    ReLU first among them, whose change to the run's argument made recompute fall back to layerwise at every step,
    with a warning. A run now starts after such a child; recompute runs, exactly, and says nothing."""
    torch.manual_seed(0)
    blocks = [[nn.Conv2d(3 if i == 0 else 6, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(inplace=True)]
              for i in range(6)]
    ref = nn.Sequential(*[m for block in blocks for m in block], nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(6, 10)).double()
    ours = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exact_vs_whole_batch(ref, ours, data((3, 8, 8), 8, torch.float64), 2, 1e-9, schedule="recompute")
    assert accumnorm.last_schedule(ours).schedule == "recompute"


class RandomScaleBlock(nn.Module):
    """conv-BN scaled by a number from Python's random: a region whose every run differs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        return x + torch.tanh(self.bn(self.conv(x))) * (1 + random.random())


def test_a_region_whose_recomputation_differs_from_its_forward_runs_under_layerwise():
    """A region's recomputation that draws from Python's random gave other outputs than its forward, and recompute
    back-propagated through them, silently. Each region's outputs are now fingerprinted in the forward and checked in
    the recomputation: the step starts over under layerwise, with a warning saying why."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), *[RandomScaleBlock() for _ in range(3)],
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10)).double()
    batch = data((1, 6, 6), 8, torch.float64)
    random.seed(0)
    with pytest.warns(RuntimeWarning, match="its recomputation gave other outputs than its forward"):
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="recompute")
    choice = accumnorm.last_schedule(model)
    assert choice.schedule == "layerwise" and "recomputation gave other outputs" in choice.reason, choice


REARRANGED = {  # the same values elsewhere: a sum and a sum of magnitudes do not change
    "flipped": lambda h: h.flip(3),
    "rolled": lambda h: h.roll(1, 2),
    "channels shuffled": lambda h: h[:, random.sample(range(h.shape[1]), h.shape[1])],
    "rows swapped": lambda h: h.flip(0),
}


class RandomlyRearranged(nn.Module):
    """conv, its features rearranged half the time by a draw from Python's random (an augmentation in the model), BN."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.conv, self.bn, self.how = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), how

    def forward(self, x):
        h = self.conv(x)
        return torch.tanh(self.bn(REARRANGED[self.how](h) if random.random() < 0.5 else h))


@pytest.mark.parametrize("schedule", ["recompute", "segments"])
@pytest.mark.parametrize("how", REARRANGED)
def test_a_recomputation_that_rearranges_the_forwards_values_runs_under_layerwise(how, schedule):
    """A recomputation that draws otherwise from Python's random and flips, rolls or shuffles its features where the
    forward did not: the fingerprint of sums saw the same values and passed it, and the gradient mixed the two runs
    (0.8-25 off). The fingerprint weighs each value by its place too: the step runs under layerwise, with a
    warning."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), *[RandomlyRearranged(how) for _ in range(3)],
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10)).double()
    batch = data((1, 6, 6), 8, torch.float64)
    random.seed(0)
    with pytest.warns(RuntimeWarning, match="gave (other outputs|another output) than its forward"):
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule=schedule)
    assert accumnorm.last_schedule(model).schedule == "layerwise"


class OnePixelBumped(nn.Module):
    """conv-BN where one value, at a place drawn from Python's random, is raised by 1 before the BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x):
        h = self.conv(x)
        bump = torch.zeros_like(h)
        bump.view(-1)[random.randrange(h.numel())] = 1.0
        return x + torch.tanh(self.bn(h + bump))


@pytest.mark.parametrize("schedule", ["recompute", "segments"])
def test_a_recomputation_that_differs_in_one_value_of_a_large_output_runs_under_layerwise(schedule):
    """One value in 65,536 of a float32 region output drawn elsewhere in the recomputation than in the forward passed
    the check, silently: its tolerance was a rounding of the sum of magnitudes, which grows with the output where a
    change drawn at random grows as its square root. The tolerance is now the spread of rounding errors (an epsilon
    of the norm): the step runs under layerwise, with a warning."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), *[OnePixelBumped() for _ in range(3)],
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    batch = data((1, 64, 64), 8, torch.float32)
    random.seed(0)
    with pytest.warns(RuntimeWarning, match="gave (other outputs|another output) than its forward"):
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule=schedule)
    assert accumnorm.last_schedule(model).schedule == "layerwise"


class Residual(nn.Module):
    """x + lin2(tanh(bn(lin(x)))): a region, whose output `then(h)` changes."""

    def __init__(self, width: int, then=lambda h: h) -> None:
        super().__init__()
        self.lin, self.bn, self.lin2 = nn.Linear(width, width), nn.BatchNorm1d(width), nn.Linear(width, width)
        self.then = then

    def forward(self, x):
        return self.then(x + self.lin2(torch.tanh(self.bn(self.lin(x)))))


def residual_net(then, head: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), Residual(8), Residual(8, then), head).double()


class FromComplex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 10)

    def forward(self, z):
        return self.lin(torch.cat([z.real, z.imag], 1))


def masked_column(h):
    return h.masked_fill(torch.arange(h.shape[1]) == 0, float("-inf"))


def imaginary_part_drawn(h):
    z = torch.fft.fft(h, dim=1)
    return torch.complex(z.real, z.imag * (1 + random.random()))


@pytest.mark.parametrize("schedule", ["recompute", "segments"])
def test_a_region_output_holding_an_inf_runs_under_layerwise(schedule):
    """A region whose output held an inf (scores masked with -inf) passed its recomputation's check whatever its other
    values were: its sums were inf either way, and the tolerance, relative to the sum of magnitudes, was infinite.
    Its recomputation cannot be checked, so the step runs under layerwise, with a warning saying why."""
    head = nn.Sequential(nn.Softmax(dim=1), nn.Linear(8, 10))
    ref = residual_net(masked_column, head)
    ours = copy.deepcopy(ref)
    batch = data((6,), 12, torch.float64)
    with pytest.warns(RuntimeWarning, match="an output holding an inf or a NaN"):
        accumnorm.backward(ours, batch, ce_loss, micro_batch_size=3, schedule=schedule)
    assert accumnorm.last_schedule(ours).schedule == "layerwise"
    whole_batch(ref, batch)
    compare(ref, ours, 1e-9)


@pytest.mark.parametrize("schedule", ["recompute", "segments"])
def test_a_complex_region_output_is_checked_in_both_parts(schedule):
    """A region that returns a complex tensor (an FFT) was fingerprinted as its real part, torch warning that the
    imaginary part was discarded: one drawn from Python's random went unseen, and the gradient mixed two runs. Both
    parts are checked now: a deterministic region runs as asked, without a warning; the drawn one under layerwise."""
    ref = residual_net(lambda h: torch.fft.fft(h, dim=1), FromComplex())
    ours = copy.deepcopy(ref)
    batch = data((6,), 12, torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accumnorm.backward(ours, batch, ce_loss, micro_batch_size=3, schedule=schedule)
    assert accumnorm.last_schedule(ours).schedule == schedule
    whole_batch(ref, batch)
    compare(ref, ours, 1e-9)
    drawn = residual_net(imaginary_part_drawn, FromComplex())
    random.seed(0)
    with pytest.warns(RuntimeWarning, match="other outputs than its forward|another output than its forward"):
        accumnorm.backward(drawn, batch, ce_loss, micro_batch_size=3, schedule=schedule)
    assert accumnorm.last_schedule(drawn).schedule == "layerwise"


class Wrapped(torch.Tensor):
    """A tensor subclass whose ops run in Python (`__torch_dispatch__`), wrapping a plain tensor: torch's pattern."""

    @staticmethod
    def __new__(cls, elem):
        wrapper = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device,
                                                      strides=elem.stride(), requires_grad=elem.requires_grad)
        wrapper.elem = elem
        return wrapper

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.elem if isinstance(t, Wrapped) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda t: Wrapped(t) if isinstance(t, torch.Tensor) else t, out)


def wrapped_loss(m, b):
    return F.cross_entropy(m(Wrapped(b[0])), b[1])


@pytest.mark.parametrize("schedule", ["recompute", "segments", "auto"])
def test_a_tensor_subclass_of_python_ops_runs_under_layerwise(schedule):
    """An input wrapped in a `__torch_dispatch__` subclass, which whole-batch torch and layerwise run: the other
    schedules failed with torch's internal errors ("Attempted to access the data pointer on an invalid python
    storage" in "auto"'s meter, ".tolist() is not supported for tensor subclasses" at the fingerprint). The meter
    counts such a tensor by its shape; a region's output of one cannot be fingerprinted, so the step runs under
    layerwise."""
    ref = residual_net(lambda h: h, nn.Linear(8, 10))
    ours = copy.deepcopy(ref)
    batch = data((6,), 12, torch.float64)
    with pytest.warns(RuntimeWarning, match="a tensor subclass whose ops run in Python") if schedule != "auto" \
            else nullcontext():
        accumnorm.backward(ours, batch, wrapped_loss, micro_batch_size=3, schedule=schedule)
    assert accumnorm.last_schedule(ours).schedule == "layerwise"
    whole_batch(ref, batch, wrapped_loss)
    compare(ref, ours, 1e-9)


def test_passes_refuses_a_tensor_subclass_of_python_ops_it_cannot_check():
    model = residual_net(lambda h: h, nn.Linear(8, 10))
    snap = snapshot(model)
    with pytest.raises(ValueError, match="passes schedule .* cannot be checked: a forward gave a Wrapped.*Nothing was "
                                         "changed. Use schedule='layerwise'"):
        accumnorm.backward(model, data((6,), 12, torch.float64), wrapped_loss, micro_batch_size=3, schedule="passes")
    assert_unchanged(model, snap)
