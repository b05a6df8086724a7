"""The segments schedule's setting, keep_every: exact at every value, a chain's arguments let go of, bad values refused;
and segments as "auto"'s choice between recompute and passes, at the fewest kept arguments that fit the budget.

The whole engine suite runs under segments at its default setting (`EXACT_SCHEDULES`); these tests add the other
settings and what only the setting does."""
from __future__ import annotations

import copy
import tracemalloc
import warnings

import pytest
import torch
import torch.nn as nn

import accumnorm
from accumnorm._engine.checkpointing import segmented
from accumnorm._engine.checkpointing.regions import Run, choose_regions
from accumnorm._engine.memory import budget as budget_module
from accumnorm._engine.schedules import segments as segments_module
from accumnorm._engine.schedules.registry import SCHEDULES
from helpers import (
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
from models import data, resnet, vgg, wide_first, wide_inside


class DropBlock(nn.Module):
    """A residual block with dropout inside: its recomputation must draw the forward's mask again."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv, self.bn, self.drop = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.Dropout(0.3)

    def forward(self, x):
        return x + self.drop(torch.tanh(self.bn(self.conv(x))))


def dropout_chain() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Tanh(),
                         *[DropBlock(8) for _ in range(5)], nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


@pytest.mark.parametrize("keep_every", [1, 2, 3, 8])
@pytest.mark.parametrize("build", [resnet, vgg, lambda: dropout_chain().apply(_no_dropout)],
                         ids=["resnet", "vgg", "chain"])
def test_every_setting_is_exact_against_whole_batch_torch(build, keep_every):
    torch.manual_seed(0)
    ref = build().double()
    ours = copy.deepcopy(ref)
    exact_vs_whole_batch(ref, ours, data((1, 12, 12), 11, torch.float64), 3, 1e-9, schedule="segments",
                         keep_every=keep_every)


def _no_dropout(m: nn.Module) -> None:
    if isinstance(m, nn.Dropout):
        m.p = 0.0


def test_a_chain_lets_go_of_the_arguments_between_kept_ones(monkeypatch):
    """Of the regions of a chain, each one's output the next one's argument, one in keep_every keeps its
    arguments; the others are recomputed from it (`depth`: regions since the last kept one)."""
    depths: list[int] = []
    keep_or_drop = segmented.SegmentedRegions._keep_or_drop

    def spy(self, passes, entries):
        dropped = keep_or_drop(self, passes, entries)
        depths.append(passes.depth)
        assert all((e.leaves[i] is None) == (passes.depth > 0) for e in entries for i in e.sources)
        assert (dropped > 0) == (passes.depth > 0)
        return dropped

    monkeypatch.setattr(segmented.SegmentedRegions, "_keep_or_drop", spy)
    model = dropout_chain().double()
    accumnorm.backward(model, data((1, 8, 8), 8, torch.float64), ce_loss, micro_batch_size=2, schedule="segments",
                       keep_every=3)
    assert depths == [0, 1, 2, 0, 1, 2, 0]  # the stem's run, the five blocks and the head's run: one chain


@pytest.mark.parametrize("dropout", [False, True])
def test_what_a_region_keeps_per_micro_batch_is_no_small_tensor_of_its_own(dropout, monkeypatch):
    """Small tensors that stay from a region's forward to its backward, one per micro-batch and region, scatter the
    heap between its large blocks, and the process's peak grows with them: between regions that draw no random
    number a micro-batch's random-stream state is one tensor, shared by its entries, and a region node keeps its
    micro-batches' output fingerprints in one tensor."""
    nodes = []
    init = segmented.RegionPasses.__init__

    def spy(self, step, entries, outputs):
        init(self, step, entries, outputs)
        nodes.append((self.samples, [e.rng for e in entries]))

    monkeypatch.setattr(segmented.RegionPasses, "__init__", spy)
    model = dropout_chain().double()
    if not dropout:
        model.apply(_no_dropout)
    ref = copy.deepcopy(model)
    batch = data((1, 8, 8), 8, torch.float64)
    torch.manual_seed(1)
    expected = accumnorm.backward(ref, batch, ce_loss, micro_batch_size=2, schedule="layerwise")
    torch.manual_seed(1)
    loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="segments", keep_every=1)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    compare(ref, model, 1e-9)
    assert len(nodes) == 7 and all(samples.shape[0] == 4 for samples, _ in nodes)  # one tensor for the 4
    states = [{id(rngs[k][0]) for _, rngs in nodes} for k in range(4)]  # micro-batch k's first generator's
    # the five dropout blocks draw numbers: their states differ; without dropout one state serves every region
    assert all(len(s) == (6 if dropout else 1) for s in states), states


@pytest.mark.parametrize("keep_every", [1, 4])
def test_random_numbers_in_recomputed_regions_are_the_forwards(keep_every):
    """Every schedule draws each micro-batch's numbers from its own stream, the same in every run: segments, whose
    backward recomputes regions and the arguments of regions, gives layerwise's gradients."""
    model = dropout_chain().double()
    batch = data((1, 8, 8), 8, torch.float64)
    layerwise, ours = model, copy.deepcopy(model)
    torch.manual_seed(1)
    expected = accumnorm.backward(layerwise, batch, ce_loss, micro_batch_size=2, schedule="layerwise")
    torch.manual_seed(1)
    loss = accumnorm.backward(ours, batch, ce_loss, micro_batch_size=2, schedule="segments", keep_every=keep_every)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    compare(layerwise, ours, 1e-9)


def test_last_schedule_says_the_setting():
    model = resnet().double()
    accumnorm.backward(model, data((1, 12, 12), 6, torch.float64), ce_loss, micro_batch_size=2, schedule="segments",
                       keep_every=3)
    assert accumnorm.last_schedule(model).schedule == "segments"
    assert "one region in 3" in accumnorm.last_schedule(model).reason
    assert accumnorm.last_schedule(model).settings == {"keep_every": 3}
    assert accumnorm.last_schedule(model).label == "segments(keep_every=3)"
    assert {accumnorm.last_schedule(model)}  # hashable, as a frozen dataclass's instances are
    accumnorm.backward(model, data((1, 12, 12), 6, torch.float64), ce_loss, micro_batch_size=2, schedule="layerwise")
    assert accumnorm.last_schedule(model).settings == {}
    assert accumnorm.last_schedule(model).label == "layerwise"


@pytest.mark.parametrize("value,schedule,error,match", [
    (0, "segments", ValueError, r"keep_every must be >= 1, got 0"),
    (2.0, "segments", TypeError, r"keep_every must be an int, got float 2\.0"),
    (True, "segments", TypeError, r"keep_every must be an int, got bool True"),
    (2, "auto", ValueError, r"keep_every is the segments schedule's setting, but schedule is 'auto'"),
    (2, "recompute", ValueError, r"but schedule is 'recompute'"),
])
def test_a_bad_setting_is_refused_before_anything_changes(value, schedule, error, match):
    model = resnet().double()
    accumnorm.backward(model, data((1, 12, 12), 4, torch.float64), ce_loss, micro_batch_size=2)
    snap = snapshot(model)
    with pytest.raises(error, match=match):
        accumnorm.backward(model, data((1, 12, 12), 4, torch.float64), ce_loss, micro_batch_size=2,
                           schedule=schedule, keep_every=value)
    assert_unchanged(model, snap)


# ---------------------------------------------------------------- "auto" and memory_budget


def _chain() -> nn.Module:
    return dropout_chain().apply(_no_dropout).double()


def _segments_need(model: nn.Module, batch, keep_every: int, monkeypatch, micro_batch_size: int = 2) -> int:
    """What "auto"'s meter counts for segments at `keep_every` on a copy of `model` (the figure a budget is judged
    by), with the schedules before it out of "auto"'s table."""
    with monkeypatch.context() as m:
        for name in ("layerwise", "recompute"):
            m.setattr(SCHEDULES[name], "choices", lambda: [])
        m.setattr(segments_module, "_AUTO_KEEP_EVERY", (keep_every,))
        trial = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            accumnorm.backward(trial, batch, ce_loss, micro_batch_size=micro_batch_size, memory_budget=2**40)
    choice = accumnorm.last_schedule(trial)
    assert choice.schedule == "segments", choice
    return choice.need


def test_auto_runs_segments_at_the_fewest_kept_arguments_that_fit_and_judges_the_next_step_by_its_figure(
        monkeypatch):
    """Between recompute and passes: a budget below recompute's need runs segments, exactly, at the first of its
    settings (keep_every 1, 2, 4) whose meter does not stop it; the reason names each one tried before and the setting
    that ran, and the next step goes straight to it without a second warning."""
    torch.manual_seed(0)
    model, batch = _chain(), data((1, 12, 12), 8, torch.float64)
    needs = {keep_every: _segments_need(model, batch, keep_every, monkeypatch) for keep_every in (1, 2, 4)}
    assert needs[4] < needs[2] < needs[1], needs  # fewer kept arguments, fewer bytes counted
    budget = (needs[2] + needs[4]) // 2
    ref = copy.deepcopy(model)
    expected = whole_batch(ref, batch)
    with pytest.warns(RuntimeWarning, match=r"running the segments\(keep_every=4\) schedule"):
        loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, memory_budget=budget)
    choice = accumnorm.last_schedule(model)
    assert choice.schedule == "segments" and choice.settings == {"keep_every": 4}, choice
    assert choice.need == needs[4], (choice, needs)
    for name in ("layerwise", "recompute", "segments(keep_every=1)", "segments(keep_every=2)"):
        assert f"{name} would keep more than" in choice.reason, (name, choice.reason)
    assert choice.reason.endswith("it ran, keeping the arguments of one region in 4 of a chain"), choice.reason
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)
    loss, expected = quiet_next_step(model, ref, batch, micro_batch_size=2, memory_budget=budget)
    choice = accumnorm.last_schedule(model)
    assert choice.schedule == "segments" and "measured at an earlier step" in choice.reason, choice
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)


def test_auto_counts_one_micro_batchs_recomputation_before_segments_backward(monkeypatch):
    """Segments' backward recomputes a region for one micro-batch at a time: the meter reserves that before the
    backward starts (here the first region's, whose wide tensor is most of it), not the whole batch's recomputation
    as recompute does. A budget with room for segments' forward but not for that reserve runs passes (with segments
    tried at keep_every=1 alone, whose kept arguments are what the reserve is measured beside)."""
    model, batch = wide_inside(64), data((1, 32, 32), 16, torch.float64)
    wide = 16 * 64 * 32 * 32 * 8  # the first region's wide tensor of the whole batch
    reserved = []
    with monkeypatch.context() as m:
        reserve = budget_module.Meter.reserve_bytes

        def spy(self, n):
            reserved.append((self.bytes, self.peak, n))  # what was counted before it (kept, and at most), and it
            reserve(self, n)

        m.setattr(budget_module.Meter, "reserve_bytes", spy)
        need = _segments_need(model, batch, 1, monkeypatch, micro_batch_size=4)
    (kept, forward, n), = reserved
    assert wide // 4 <= n < wide // 2, (n, wide)  # at least the wide tensor of one micro-batch of 4
    assert forward < kept + n // 2, (forward, kept, n)  # the forward's moments fit in the budget below
    ref = copy.deepcopy(model)
    expected = whole_batch(ref, batch)
    budget = max(need - n // 2, passes_need(model, batch, ce_loss, 4))  # passes fits, and segments' forward
    assert budget < need
    monkeypatch.setattr(segments_module, "_AUTO_KEEP_EVERY", (1,))
    with pytest.warns(RuntimeWarning, match="running the passes schedule"):
        loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=4, memory_budget=budget)
    choice = accumnorm.last_schedule(model)
    assert choice.schedule == "passes" and "segments(keep_every=1) would keep more than" in choice.reason, choice
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)


def test_auto_counts_the_whole_batchs_gradients_at_a_regions_exit_and_entrance_before_segments_backward(monkeypatch):
    """A region's node meets every micro-batch in the backward too: it is given the gradients of all their outputs
    and gives those of all their arguments, the whole batch's at once, beside one micro-batch's recomputation. The
    reserve before the backward counts both, and a budget without room for them runs passes, exactly."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU()) for _ in range(3)]
    model = nn.Sequential(*blocks, nn.Flatten(), nn.Linear(4 * 8 * 8, 10)).double()
    batch = data((4, 8, 8), 16, torch.float64)
    whole = 16 * 4 * 8 * 8 * 8  # one block's input, or output, of the whole batch
    reserved = []
    with monkeypatch.context() as m:
        reserve = budget_module.Meter.reserve_bytes

        def spy(self, n):
            reserved.append(n)
            reserve(self, n)

        m.setattr(budget_module.Meter, "reserve_bytes", spy)
        need = _segments_need(model, batch, 1, monkeypatch, micro_batch_size=4)
    (n,) = reserved
    assert n >= 2 * whole, (n, whole)  # a middle block's output and argument gradients, besides its recomputation
    ref = copy.deepcopy(model)
    expected = whole_batch(ref, batch)
    monkeypatch.setattr(segments_module, "_AUTO_KEEP_EVERY", (1,))
    with pytest.warns(RuntimeWarning, match="running the passes schedule"):
        loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=4, memory_budget=need - whole)
    choice = accumnorm.last_schedule(model)
    assert choice.schedule == "passes" and "segments(keep_every=1) would keep more than" in choice.reason, choice
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)


def test_auto_counts_a_met_calls_input_and_output_of_the_whole_batch(monkeypatch):
    """At a met BatchNorm call the lockstep holds every micro-batch's piece of its input and of its output at once,
    though segments keeps neither for the backward: with a wide first call, most of the step's peak. "auto"'s figure
    counts them, and a budget without room for them runs passes, exactly."""
    model = wide_first()
    batch = data((1, 32, 32), 16, torch.float64)
    wide = 16 * 32 * 32 * 32 * 8  # the first call's input of the whole batch, and its output
    trial = copy.deepcopy(model)
    accumnorm.backward(trial, batch, ce_loss, micro_batch_size=2, schedule="segments", keep_every=1)
    assert live_peak(lambda: accumnorm.backward(trial, batch, ce_loss, micro_batch_size=2, schedule="segments",
                                                keep_every=1)) >= 2 * wide  # what the count is of: the step's own
    need = _segments_need(model, batch, 1, monkeypatch)
    assert need >= 2 * wide, (need, wide)
    ref = copy.deepcopy(model)
    expected = whole_batch(ref, batch)
    monkeypatch.setattr(segments_module, "_AUTO_KEEP_EVERY", (1,))
    with pytest.warns(RuntimeWarning, match="running the passes schedule"):
        loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, memory_budget=need - wide // 2)
    choice = accumnorm.last_schedule(model)
    assert choice.schedule == "passes" and "segments(keep_every=1) would keep more than" in choice.reason, choice
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)


def _deep_tiny() -> nn.Module:
    """24 conv-BatchNorm blocks of 2 channels on 4x4 inputs: each region call's record outweighs its tensors."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Conv2d(1 if i == 0 else 2, 2, 3, padding=1, bias=False), nn.BatchNorm2d(2), nn.Tanh())
              for i in range(24)]
    return nn.Sequential(*blocks, nn.Flatten(), nn.Linear(32, 10)).double()


def _auto_need(model: nn.Module, batch, schedule: str, monkeypatch) -> tuple[int, int]:
    """"auto"'s figure for `schedule` (recompute, or segments at keep_every=4) on a copy of `model`, 16 micro-batches
    of 1, and the bytes of Python objects the step holds at the start of its backward (tracemalloc)."""
    held = []
    with monkeypatch.context() as m:
        reserve = budget_module.Meter.reserve_bytes

        def spy(self, n):  # called once, before the backward
            held.append(tracemalloc.get_traced_memory()[0])
            reserve(self, n)

        m.setattr(budget_module.Meter, "reserve_bytes", spy)
        m.setattr(SCHEDULES["layerwise"], "choices", lambda: [])
        if schedule == "segments":
            m.setattr(SCHEDULES["recompute"], "choices", lambda: [])
            m.setattr(segments_module, "_AUTO_KEEP_EVERY", (4,))
        trial = copy.deepcopy(model)
        tracemalloc.start()
        try:
            start = tracemalloc.get_traced_memory()[0]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                accumnorm.backward(trial, batch, ce_loss, micro_batch_size=1, memory_budget=2**40)
        finally:
            tracemalloc.stop()
    choice = accumnorm.last_schedule(trial)
    assert choice.schedule == schedule, choice
    (at_backward,) = held
    return choice.need, at_backward - start


@pytest.mark.parametrize("schedule", ["recompute", "segments"])
def test_auto_counts_what_each_region_call_keeps_beside_its_tensors(schedule, monkeypatch):
    """recompute and segments keep a record of every region call of every micro-batch (its arguments, random state,
    modes, the BatchNorm calls it made). On a deep net of tiny tensors those records outweigh the tensors: "auto"'s
    figure counts them (most of the Python the step holds at its backward's start), and a budget between the
    tensors alone and the figure runs passes, exactly, where a meter of tensors alone ran the schedule over it."""
    model, batch = _deep_tiny(), data((1, 4, 4), 16, torch.float64)
    with monkeypatch.context() as m:
        m.setattr(budget_module.Meter, "count_objects", lambda self, root, records: None)
        tensors, _ = _auto_need(model, batch, schedule, monkeypatch)
    need, python = _auto_need(model, batch, schedule, monkeypatch)
    assert need - tensors >= python // 2, (need, tensors, python)
    assert need > 2 * tensors, (need, tensors)
    ref = copy.deepcopy(model)
    expected = whole_batch(ref, batch)
    if schedule == "segments":
        monkeypatch.setattr(SCHEDULES["recompute"], "choices", lambda: [])
        monkeypatch.setattr(segments_module, "_AUTO_KEEP_EVERY", (4,))
    else:
        monkeypatch.setattr(SCHEDULES["segments"], "choices", lambda: [])
    monkeypatch.setattr(SCHEDULES["layerwise"], "choices", lambda: [])
    with pytest.warns(RuntimeWarning, match="running the passes schedule"):
        loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=1, memory_budget=(tensors + need) // 2)
    choice = accumnorm.last_schedule(model)
    assert choice.schedule == "passes" and "would keep more than" in choice.reason, choice
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)


def test_the_budget_check_judges_passes_by_layerwises_figure_not_by_other_schedules_records(monkeypatch):
    """Before a step, a budget below what even passes needs is refused: the gradients and one micro-batch of
    layerwise's figure. Recompute's figure counts a record per region call, which passes does not keep: a budget
    between the two is passes' to run, exactly, not refused."""
    model, batch = _deep_tiny(), data((1, 4, 4), 16, torch.float64)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    ref = copy.deepcopy(model)
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=1, memory_budget=2**40)
    accumnorm.backward(ref, batch, ce_loss, micro_batch_size=1)
    layerwise = accumnorm.last_schedule(model).need - grads
    with monkeypatch.context() as m, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m.setattr(SCHEDULES["layerwise"], "choices", lambda: [])
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=1, memory_budget=2**40)
        accumnorm.backward(ref, batch, ce_loss, micro_batch_size=1)
    assert accumnorm.last_schedule(model).schedule == "recompute"
    recompute = accumnorm.last_schedule(model).need - grads
    assert recompute > 2 * layerwise, (recompute, layerwise)  # per sample, as the check reads them
    expected = whole_batch(ref, batch)
    budget = grads + (layerwise + recompute) // 2 // 16
    loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=1, memory_budget=budget)  # warned before
    assert accumnorm.last_schedule(model).schedule == "passes"
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-9)


@pytest.mark.parametrize("build", [resnet, vgg], ids=["resnet", "vgg"])
def test_segments_keeps_every_region_after_recompute_measured_which_keep_little(build, monkeypatch):
    """Recompute runs the regions that keep little as they are once a step has measured them: its backward holds
    the largest region's recomputation for the whole batch anyway. Segments' backward holds one micro-batch's, so
    after a recompute step (as "auto" runs one before it) it still runs every region as a region."""
    torch.manual_seed(0)
    model, batch = build().double(), data((1, 12, 12), 8, torch.float64)
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="recompute")
    every = choose_regions(model, weigh=False)
    assert len(choose_regions(model)) < len(every)  # recompute now leaves some as they are
    seen = []
    init = segmented.SegmentedRegions.__init__

    def spy(self, step, regions, *args):
        seen.append(regions)
        init(self, step, regions, *args)

    monkeypatch.setattr(segmented.SegmentedRegions, "__init__", spy)
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule="segments")
    assert [list(map(_where, regions)) for regions in seen] == [list(map(_where, every))]


def _where(region) -> object:
    """A region by what it covers: a module, or a run's Sequential and children (each choice makes new runs)."""
    return (region.parent, region.start, region.stop) if isinstance(region, Run) else region


def test_a_cpu_step_hands_the_heaps_free_memory_back_at_each_regions_exit_and_after_its_backward(monkeypatch):
    """On the CPU each region node's forward (every micro-batch's, met at its exit) and its backward leave blocks the
    heap keeps resident (`memory.heap`): segments hands them back at both, and the step stays exact."""
    from accumnorm._engine.memory import heap

    events: list[str] = []
    node_backward = segmented.RegionPasses.backward
    monkeypatch.setattr(heap, "_TRIM", lambda pad: events.append("trim") or 1)
    monkeypatch.setattr(segmented.RegionPasses, "backward",
                        lambda self, grads: events.append("backward") or node_backward(self, grads))
    ref = dropout_chain().double().apply(_no_dropout)
    ours = copy.deepcopy(ref)
    batch = data((1, 8, 8), 8, torch.float64)
    expected = accumnorm.backward(ref, batch, ce_loss, micro_batch_size=2, schedule="layerwise")
    loss = accumnorm.backward(ours, batch, ce_loss, micro_batch_size=2, schedule="segments")
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    compare(ref, ours, 1e-9)
    # seven region nodes: a trim at each one's exit in the forward, then after each one's backward
    assert events == ["trim"] * 7 + ["backward", "trim"] * 7


def test_a_figure_measured_at_one_micro_batch_size_does_not_judge_another(monkeypatch):
    """Segments' need has a part of one micro-batch's size (a region's recomputation): a figure per sample measured at
    micro-batches of 1 judged a step of micro-batches of 8 under its need, and "auto" ran segments over its budget,
    unmetered. A step at another size now runs metered and chooses as a model without figures does."""
    torch.manual_seed(0)
    model, batch = _chain(), data((1, 12, 12), 16, torch.float64)
    small, large = (_segments_need(model, batch, 1, monkeypatch, micro_batch_size=b) for b in (1, 8))
    assert small < large, (small, large)
    budget = (small + large) // 2
    monkeypatch.setattr(segments_module, "_AUTO_KEEP_EVERY", (1,))

    def step(m: nn.Module, micro_batch_size: int) -> budget_module.Choice:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            accumnorm.backward(m, batch, ce_loss, micro_batch_size=micro_batch_size, memory_budget=budget)
        return accumnorm.last_schedule(m)

    fresh = step(copy.deepcopy(model), 8)
    ours = copy.deepcopy(model)
    assert step(ours, 1).schedule == "segments"
    choice = step(ours, 8)
    assert choice.schedule == fresh.schedule != "segments", (choice, fresh)
    assert choice.need is None or choice.need <= budget, choice
