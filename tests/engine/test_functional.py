"""The functional core against torch: moments that merge exactly, and BatchNorm's backward formula."""
import pytest
import torch
import torch.nn.functional as F

from accumnorm._engine.bn.normalize import GradSums, normalize
from accumnorm.functional import Moments, combine_moments, moments
from helpers import rel_err


def test_moments_of_parts_combine_to_moments_of_the_whole():
    x = torch.randn(11, 5, 4, 3, dtype=torch.float64) * 3 + 7
    parts = [moments(p) for p in x.split([1, 4, 6])]
    whole = combine_moments(Moments(torch.stack([p.count for p in parts]), torch.stack([p.mean for p in parts]),
                                    torch.stack([p.m2 for p in parts])))
    var, mean = torch.var_mean(x, dim=(0, 2, 3), correction=0)
    assert whole.count.item() == 11 * 4 * 3
    assert rel_err(whole.mean, mean) < 1e-12 and rel_err(whole.var, var) < 1e-12


def test_moments_stay_accurate_in_float32_with_a_large_mean():
    # sum-of-squares would cancel catastrophically here; (count, mean, m2) merging does not
    x = torch.randn(64, 3, 8, dtype=torch.float64) * 0.01 + 1000.0
    parts = [moments(p) for p in x.float().split(8)]
    whole = combine_moments(Moments(*(torch.stack([getattr(p, f) for p in parts]) for f in ("count", "mean", "m2"))))
    var = torch.var(x, dim=(0, 2), correction=0)
    assert rel_err(whole.var.double(), var) < 1e-3


def test_moments_are_float32_for_bf16_input_and_pack_roundtrip():
    m = moments(torch.randn(4, 6, 5).bfloat16())
    assert m.mean.dtype == torch.float32 and m.m2.dtype == torch.float32
    back = Moments.unpack(m.pack())
    assert torch.equal(back.mean, m.mean) and torch.equal(back.m2, m.m2) and back.count == m.count


def test_normalize_with_complete_sums_is_whole_batch_batchnorm_forward_and_backward():
    x = torch.randn(10, 4, 3, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(10, 4, 3, 3, dtype=torch.float64)
    ref = F.batch_norm(x, None, None, w, b, True, 0.0, 1e-5)
    gx, gw, gb = torch.autograd.grad(ref, (x, w, b), dy)

    var, mean = torch.var_mean(x.detach(), dim=(0, 2, 3), correction=0)
    sums = GradSums(4, torch.tensor(90.0, dtype=torch.float64))
    # First pass over two "micro-batches": uncorrected backward, sums collected.
    for xs, dys in zip(x.detach().split(5), dy.split(5)):
        y = normalize(xs.requires_grad_(), mean, var, w, b, 1e-5, sums)
        y.backward(dys)
    sums.collect = False
    w.grad = b.grad = None
    outs, dxs = [], []
    for xs, dys in zip(x.detach().split(5), dy.split(5)):
        xs.requires_grad_()
        y = normalize(xs, mean, var, w, b, 1e-5, sums)
        y.backward(dys)
        outs.append(y.detach())
        dxs.append(xs.grad)
    assert rel_err(torch.cat(outs), ref.detach()) < 1e-12
    assert rel_err(torch.cat(dxs), gx) < 1e-10
    assert rel_err(w.grad, gw) < 1e-12 and rel_err(b.grad, gb) < 1e-12


def test_one_set_of_moments_not_stacked_is_its_own_union():
    """`moments(x)` as it comes (a 0-dim count): it was read as K sets of one channel each, and merged into a scalar."""
    x = torch.randn(8, 3, 2, 2, dtype=torch.float64)
    one = combine_moments(moments(x))
    var, mean = torch.var_mean(x, dim=(0, 2, 3), correction=0)
    assert one.mean.shape == (3,) and rel_err(one.mean, mean) < 1e-12 and rel_err(one.var, var) < 1e-12


def test_the_union_of_empty_pieces_has_no_moments_as_one_empty_piece():
    """moments of an empty piece (a mask that selects nothing) are zeros; their union was 0/0, NaN mean and m2."""
    empty = moments(torch.randn(0, 3, dtype=torch.float64))
    union = combine_moments([empty, empty])
    assert float(union.count) == 0
    torch.testing.assert_close(union.mean, empty.mean)
    torch.testing.assert_close(union.m2, empty.m2)
    some = moments(torch.randn(4, 3, dtype=torch.float64))
    torch.testing.assert_close(combine_moments([empty, some]).mean, some.mean)


def test_moments_of_a_tensor_without_a_channel_dimension_is_a_clear_error():
    with pytest.raises(ValueError, match=r"moments expects an input of shape \(N, C, \*\), got one of shape \(5,\)"):
        moments(torch.randn(5))
