"""The regions' flatten: torch's leaves and spec, and no garbage cycle left for the collector, which is off during a
step."""
from __future__ import annotations

import collections
import gc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._pytree import tree_flatten, tree_unflatten

import accumnorm
from accumnorm._engine.safety.flatten import flatten
from helpers import ce_loss
from models import data, resnet

_Pair = collections.namedtuple("_Pair", "a b")

_leaves = st.sampled_from([torch.zeros(1), torch.ones(2, 2), None, 0, 2.5, True, "x"])
_trees = st.recursive(_leaves, lambda children: st.one_of(
    st.lists(children, max_size=3), st.lists(children, max_size=3).map(tuple),
    st.dictionaries(st.sampled_from(["a", "b", "c"]), children, max_size=3),
    st.tuples(children, children).map(lambda t: _Pair(*t))), max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(_trees)
def test_flatten_gives_torchs_leaves_and_spec(tree):
    leaves, spec = flatten(tree)
    expected_leaves, expected_spec = tree_flatten(tree)
    assert spec == expected_spec
    assert len(leaves) == len(expected_leaves) and all(a is b for a, b in zip(leaves, expected_leaves))
    assert tree_flatten(tree_unflatten(leaves, spec))[1] == expected_spec


def test_a_tree_of_tensors_leaves_no_cycle_for_the_collector_once_its_shape_was_seen():
    x = torch.zeros(2)
    trees = [((x, None, 3), {"scale": x}), [x, (x, x)]]
    for tree in trees:  # each shape's first spec is torch's
        flatten(tree)
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(10):
            for tree in trees:
                flatten(tree)
        assert gc.collect() == 0
    finally:
        if enabled:
            gc.enable()


@pytest.mark.parametrize("schedule", ["layerwise", "recompute", "segments", "passes"])
def test_a_step_leaves_nothing_for_the_collector(schedule):
    """The collector is off while a step runs: whatever the step leaves in cycles stays until its end. Segments
    flattened each region call's arguments and outputs with torch's `tree_flatten`, which leaves a cycle each time:
    4,600 on a deep net of tiny tensors at 32 micro-batches. Recompute's regions were torch's checkpoints, whose
    device inference leaves one at each region call."""
    torch.manual_seed(0)
    model, batch = resnet().double(), data((1, 12, 12), 8, torch.float64)
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule=schedule)
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=2, schedule=schedule)
        assert gc.collect() == 0
    finally:
        if enabled:
            gc.enable()
