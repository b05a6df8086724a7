"""The recompute schedule's own checkpoint (`checkpointing.recomputation`) on its own, against torch's checkpoint and
against no checkpoint at all: the same gradients, what it keeps, and a second backward."""
from __future__ import annotations

import copy
import weakref

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.checkpoint import checkpoint

from accumnorm._engine.checkpointing.checkpointed import checkpointed
from accumnorm._engine.checkpointing.handoff import Handoffs


def region(width: int, p: float) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Dropout(p), nn.Linear(width, width), nn.GELU())


def gradients(model: nn.Module, x: torch.Tensor, how: str, seed: int) -> list[torch.Tensor]:
    """The input's and parameters' gradients of a sum over the model's output, its first child run `how`."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    torch.manual_seed(seed)
    if how == "frame":
        with checkpointed([model[0]], lambda frame, r: None, Handoffs()):
            out = model(x * 1)
    elif how == "torch":
        out = model[1:](checkpoint(model[0], x * 1, use_reentrant=False))
    else:
        out = model(x * 1)
    (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return [x.grad] + [p.grad for p in model.parameters()]


@settings(max_examples=25, deadline=None)
@given(width=st.integers(1, 6), rows=st.integers(1, 5), p=st.sampled_from([0.0, 0.5]), seed=st.integers(0, 2**16))
def test_a_region_in_its_frame_gives_the_gradients_of_torchs_checkpoint_and_of_no_checkpoint(width, rows, p, seed):
    """Dropout in the region: the recomputation draws the forward's mask again (the random state it began with)."""
    torch.manual_seed(seed)
    model = nn.Sequential(region(width, p), nn.Linear(width, 3)).double()
    x = torch.randn(rows, width, dtype=torch.float64)
    expected = gradients(model, x, "none", seed)
    for how in ("frame", "torch"):
        for got, want in zip(gradients(model, x, how, seed), expected):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_region_runs_again_in_the_autocast_its_forward_ran_in():
    model = nn.Sequential(region(8, 0.0), nn.Linear(8, 3))
    x = torch.randn(4, 8)

    def grads(how: str) -> list[torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return gradients(model, x, how, 0)

    for got, want in zip(grads("frame"), grads("none")):
        torch.testing.assert_close(got, want)


def test_a_regions_frame_holds_its_input_only_through_the_hooks_below_it():
    """With a hook below that packs a copy (as the host store does), the frame keeps the copy: the input itself goes
    once nothing else holds it, and the backward is the same."""
    model = nn.Sequential(region(4, 0.0), nn.Linear(4, 3)).double()
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    expected = gradients(copy.deepcopy(model), x, "none", 0)
    with checkpointed([model[0]], lambda frame, r: None, Handoffs()), \
            torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        h = x * 1
        held = weakref.ref(h)
        out = model(h)
    del h
    assert held() is None
    (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    for got, want in zip([x.grad] + [p.grad for p in model.parameters()], expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_second_backward_through_a_region_recomputes_it_again():
    model = nn.Sequential(region(4, 0.0), nn.Linear(4, 3)).double()
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    with checkpointed([model[0]], lambda frame, r: None, Handoffs()):
        out = model(x).square().sum()
    first = torch.autograd.grad(out, x, retain_graph=True)[0]
    second = torch.autograd.grad(out, x)[0]
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    torch.testing.assert_close(first, torch.autograd.grad(model(x).square().sum(), x)[0], rtol=1e-12, atol=1e-12)


def test_an_input_changed_in_place_after_the_region_is_refused_at_the_backward():
    model = nn.Sequential(region(4, 0.0), nn.Linear(4, 3)).double()
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    with checkpointed([model[0]], lambda frame, r: None, Handoffs()):
        h = x * 1
        out = model(h).sum()
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation: an input"):
        out.backward()


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(0, 5), min_size=0, max_size=4), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float64, torch.float32, torch.int64]))
def test_a_fingerprint_holds_the_sums_and_tells_the_same_values_elsewhere(shape, seed, dtype):
    """A fingerprint's plain sum is torch's; the same values in other places (a flip of any dimension, a roll)
    are told apart by its weighted sums, unless the rearrangement leaves the tensor as it was. (Of integers, not
    always: rows swapped whose sums are equal, which random floats never are, weigh the same.) A channels-last output
    is read where it lies, not copied."""
    from accumnorm._engine.checkpointing.again import _table, fingerprint, same_outputs

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 10).to(dtype)
    [[(total, _), _]] = fingerprint([x]).tolist()
    torch.testing.assert_close(total, x.double().sum().item(), rtol=1e-5, atol=1e-5)
    assert same_outputs([x.clone()], fingerprint([x]))
    if x.dim() == 4 and x.is_floating_point():
        lying = x.contiguous(memory_format=torch.channels_last)
        assert _table(lying).data_ptr() == lying.data_ptr()
        assert same_outputs([lying.clone(memory_format=torch.channels_last)], fingerprint([lying]))
    if not x.is_floating_point():
        return
    for moved in [x.flip(d) for d in range(x.dim())] + [x.roll(1, d) for d in range(x.dim())]:
        assert same_outputs([moved], fingerprint([x])) == torch.equal(moved, x), moved


def test_the_fingerprints_weights_are_kept_for_a_bounded_number_of_shapes():
    """The weights of short outputs are kept, per shape: a model whose outputs take ever new shapes (a sequence of
    each length) keeps at most _MOST_KEPT of them, not one per shape for the life of the process."""
    from accumnorm._engine.checkpointing import again

    for length in range(1, 2 * again._MOST_KEPT):
        again.fingerprint([torch.ones(2, length)])
    assert len(again._KEPT) <= again._MOST_KEPT


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_fingerprint_tells_one_value_changed_or_two_swapped_in_a_large_output(dtype):
    """Of a float32 output of half a million values, one value raised by 1 (its values' spread) and its largest and
    smallest values swapped passed as the same: the tolerance was 1e-4 of the sum of magnitudes, some 800 float32
    epsilons per value. It is now 8 (4 of the dtype's and 4 of the fingerprint's sums); the forward's own values
    pass, and so does a rounding of each value, up or down at random or all one way (a reduced precision under
    autocast rounded so in a timm EfficientNet-B0's recomputation on the CPU, and a tolerance for random errors
    only sent its steps to layerwise)."""
    from accumnorm._engine.checkpointing.again import fingerprint, same_outputs

    x = torch.randn(8, 64, 32, 32, generator=torch.Generator().manual_seed(0), dtype=dtype)
    first = fingerprint([x])
    raised, swapped = x.clone(), x.clone()
    raised.view(-1)[12345] += 1
    ends = [int(x.argmax()), int(x.argmin())]
    swapped.view(-1)[ends] = swapped.view(-1)[ends[::-1]]
    signs = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=dtype).sign()
    rounded = x * (1 + torch.finfo(dtype).eps * signs)  # each value a rounding off, up or down
    assert not same_outputs([raised], first) and not same_outputs([swapped], first)
    leaning = x + torch.finfo(dtype).eps * x.abs()  # each value a rounding up
    assert same_outputs([x.clone()], first) and same_outputs([rounded], first) and same_outputs([leaning], first)


def test_an_expanded_output_is_read_once_not_copied():
    """An output expanded from a few values (a position embedding over the batch) was read as a table of all its
    places, which copied it whole: 128 MiB for this one. Its values are read once, where they lie, and another base
    expanded the same way is told apart."""
    from accumnorm._engine.checkpointing.again import _table, fingerprint, same_outputs

    x = torch.randn(1, 1, 512).expand(64, 1024, 512)
    table = _table(x)
    assert table.numel() == 512 and table.data_ptr() == x.data_ptr()
    assert same_outputs([x], fingerprint([x]))
    assert not same_outputs([torch.randn(1, 1, 512).expand(64, 1024, 512)], fingerprint([x]))
