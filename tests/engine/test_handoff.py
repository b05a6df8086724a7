"""Region outputs handed on under the recompute schedule (`checkpointing.handoff`): a region's output that the next
region keeps as its input is compared with its recomputation, not fingerprinted; what changes between steps is
still caught, and the step stays exact."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import accumnorm
from accumnorm._engine.checkpointing import again, recomputation
from accumnorm._engine.checkpointing.regions import choose_regions
from helpers import ce_loss, compare, quiet_next_step, rel_err, whole_batch
from models import data

K = 4  # micro-batches of each step below


class Block(nn.Module):
    """linear-tanh-BN, and a switch: `noisy` adds a little to the output where the block runs inside a backward
    (its recomputation), not in its forward."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.lin, self.bn = nn.Linear(width, width), nn.BatchNorm1d(width)
        self.noisy = False

    def forward(self, x):
        out = self.bn(torch.tanh(self.lin(x)))  # BatchNorm's output, which no op saves: it may change in place
        return out + 1e-3 if self.noisy and torch._C._current_graph_task_id() != -1 else out


class MaybeInPlace(nn.Module):
    """Between two blocks, outside every region: its input as it is, or (`active`) changed in place."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False

    def forward(self, x):
        return x.mul_(2) if self.active else x


def chain(blocks: int = 5) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 6), *[Block() for _ in range(blocks)], MaybeInPlace(), Block(),
                         nn.Linear(6, 10)).double()


def batch():
    return data((1, 4, 4), 4 * K, torch.float64)


@pytest.fixture
def fingerprints(monkeypatch):
    """How many outputs the step fingerprints: in the forward, and again in the backward's check."""
    count = [0]
    original = again.fingerprint

    def counted(outputs):
        count[0] += len(outputs)
        return original(outputs)

    monkeypatch.setattr(recomputation, "fingerprint", counted)
    monkeypatch.setattr(again, "fingerprint", counted)
    return count


def step(model, ref, data_, fingerprints) -> int:
    """One recompute step against whole-batch torch, with no warning; the outputs it fingerprinted."""
    before = fingerprints[0]
    loss, expected = quiet_next_step(model, ref, data_, micro_batch_size=len(data_[0]) // K, schedule="recompute")
    assert accumnorm.last_schedule(model).schedule == "recompute"
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-10)
    return fingerprints[0] - before


def runs_under_layerwise(model, ref, data_, why: str) -> None:
    """A recompute step refused with a warning that says `why`, run under layerwise, exact."""
    model.zero_grad()
    ref.zero_grad()
    expected = whole_batch(ref, data_)
    with pytest.warns(RuntimeWarning, match=why):
        loss = accumnorm.backward(model, data_, ce_loss, micro_batch_size=4, schedule="recompute")
    assert accumnorm.last_schedule(model).schedule == "layerwise"
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-10)


def test_outputs_the_next_region_takes_are_fingerprinted_only_in_the_first_step(fingerprints):
    """The first step fingerprints a region call's output twice (its forward, its recomputation) until it has seen
    the next region take that region's output; from the next step on, only the outputs no region takes are."""
    model, data_ = chain(), batch()
    ref = copy.deepcopy(model)
    regions = choose_regions(model, weigh=False)
    assert len(regions) == 7  # the flatten and the first linear layer, gathered into a run, and each block
    first = step(model, ref, data_, fingerprints)
    # the run's first call is read at once; the other micro-batches reach it once the first took its output
    assert first == 2 * K * (len(regions) - 1) + 2
    for _ in range(2):  # the last block's output goes to the head, the one before to MaybeInPlace and on
        assert step(model, ref, data_, fingerprints) == 2 * K * 1


def test_a_handed_on_output_whose_recomputation_differs_runs_under_layerwise(monkeypatch):
    """From the second step on a block's output is compared with the next block's input: a recomputation that gives
    another output is refused with a warning, and the step is exact under layerwise."""
    model, data_ = chain(), batch()
    ref = copy.deepcopy(model)
    quiet_next_step(model, ref, data_, micro_batch_size=4, schedule="recompute")
    model[3].noisy = ref[3].noisy = True
    compared = []
    monkeypatch.setattr(recomputation, "check_kept", lambda *args: compared.append(again.check_kept(*args)))
    runs_under_layerwise(model, ref, data_, "other outputs than its forward")
    assert compared  # the blocks after the noisy one passed the comparison; the noisy one's did not


def test_an_output_changed_in_place_before_the_next_region_takes_it_is_refused_once():
    """A block's output handed on last step is changed in place before the next block takes it: it was not
    fingerprinted, so that step runs under layerwise, with a warning, exact; the next step reads it at once and
    runs recompute again."""
    model, data_ = chain(), batch()
    ref = copy.deepcopy(model)
    quiet_next_step(model, ref, data_, micro_batch_size=4, schedule="recompute")
    model[-3].active = ref[-3].active = True
    runs_under_layerwise(model, ref, data_, "changed in place after the region returned it")
    loss, expected = quiet_next_step(model, ref, data_, micro_batch_size=4, schedule="recompute")
    assert accumnorm.last_schedule(model).schedule == "recompute"
    assert rel_err(loss, expected) < 1e-12
    compare(ref, model, 1e-10)


def test_a_handed_on_output_is_let_go_once_the_backward_has_checked_it():
    """The next region's input, held for the check, goes once the backward's recomputation is compared with it: it
    is not kept until the region's own backward is over."""
    model, data_ = chain(), batch()
    quiet_next_step(model, copy.deepcopy(model), data_, micro_batch_size=4, schedule="recompute")
    held = []
    original = recomputation._check_handed_on

    def check(frame, out):
        original(frame, out)
        held.append(frame.handed_on)

    recomputation._check_handed_on = check
    try:
        accumnorm.backward(model, data_, ce_loss, micro_batch_size=4, schedule="recompute")
    finally:
        recomputation._check_handed_on = original
    assert len(held) == K * (len(choose_regions(model, weigh=False)) - 1) and all(h is None for h in held)
