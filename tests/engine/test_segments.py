"""The segments schedule's setting, keep_every: exact at every value, a chain's arguments let go of, bad values refused.

The whole engine suite runs under segments at its default setting (`EXACT_SCHEDULES`); these tests add the other
settings and what only the setting does."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import accumnorm
from accumnorm._engine.checkpointing import segmented
from helpers import assert_unchanged, ce_loss, compare, exact_vs_whole_batch, snapshot
from models import data, resnet, vgg


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
        keep_or_drop(self, passes, entries)
        depths.append(passes.depth)
        assert all((e.leaves[i] is None) == (passes.depth > 0) for e in entries for i in e.sources)

    monkeypatch.setattr(segmented.SegmentedRegions, "_keep_or_drop", spy)
    model = dropout_chain().double()
    accumnorm.backward(model, data((1, 8, 8), 8, torch.float64), ce_loss, micro_batch_size=2, schedule="segments",
                       keep_every=3)
    assert depths == [0, 1, 2, 0, 1, 2, 0]  # the stem's run, the five blocks and the head's run: one chain


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
