"""torch's lazy BatchNorm: `nn.LazyBatchNorm2d(32)` means eps=32. accumnorm.backward warns of it once per layer, and
convert turns torch's lazy layers into accumnorm's, still lazy or with the tensors a state_dict gave them."""
import copy
import re
import warnings

import pytest
import torch
import torch.nn as nn

import accumnorm
from helpers import ce_loss, compare, whole_batch


def _digits(n=8, channels=1):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, channels, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def _net(norm):
    return nn.Sequential(nn.Conv2d(1, 4, 3), norm, nn.Flatten(), nn.Linear(4 * 16, 3)).double()


@pytest.mark.parametrize("bn", ["exact", "micro"])
def test_backward_warns_once_per_layer_of_an_eps_of_one_or_more(bn):
    """nn.LazyBatchNorm2d(4) ran without a word: eps=4, then (after its first forward) a BatchNorm2d with eps=4."""
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.LazyBatchNorm2d(4), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4, eps=1e-3),
                          nn.BatchNorm2d(4, eps=2.5), nn.Flatten(), nn.Linear(4 * 16, 3)).double()
    batch = _digits()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            accumnorm.backward(model, batch, ce_loss, micro_batch_size=4, bn=bn)
    messages = [str(w.message) for w in caught if "eps=" in str(w.message)]
    assert messages == [
        "accumnorm.backward: LazyBatchNorm2d '1' has eps=4, 1 or more: did you mean LazyBatchNorm2d() with 4 channels? "
        "torch reads the first argument as eps. accumnorm.BatchNorm2d(4) takes the channel count first "
        "(accumnorm.BatchNorm2d() is lazy)",
        "accumnorm.backward: BatchNorm2d '4' has eps=2.5, 1 or more: did you mean LazyBatchNorm2d() with 2.5 channels? "
        "torch reads the first argument as eps. accumnorm.BatchNorm2d(2.5) takes the channel count first "
        "(accumnorm.BatchNorm2d() is lazy)"]
    assert all(w.filename == __file__ for w in caught if "eps=" in str(w.message))  # at the caller's line


def test_the_warning_comes_for_a_converted_lazy_layer_and_as_an_error_before_anything_changes():
    model = accumnorm.convert(_net(nn.LazyBatchNorm2d(4)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match=re.escape("BatchNorm2d '1' has eps=4, 1 or more")):
            accumnorm.backward(model, _digits(), ce_loss, micro_batch_size=4)
    assert model[1].has_uninitialized_params() and all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("lazy, shape, cls", [
    (nn.LazyBatchNorm1d, (8, 5), accumnorm.BatchNorm1d), (nn.LazyBatchNorm2d, (8, 5, 3, 3), accumnorm.BatchNorm2d),
    (nn.LazyBatchNorm3d, (8, 5, 2, 2, 2), accumnorm.BatchNorm3d),
])
@pytest.mark.parametrize("affine, track", [(True, True), (False, False)])
def test_convert_makes_torchs_lazy_layer_accumnorms_lazy_one(lazy, shape, cls, affine, track):
    """convert skipped torch's lazy layers: left as they were, with no word."""
    torch.manual_seed(0)
    ref = lazy(eps=1e-3, momentum=0.3, affine=affine, track_running_stats=track).double()
    ours = accumnorm.convert(lazy(eps=1e-3, momentum=0.3, affine=affine, track_running_stats=track).double())
    assert type(ours) is cls and ours.has_uninitialized_params() == (affine or track) and ours.num_features is None
    assert (ours.eps, ours.momentum, ours.affine, ours.track_running_stats) == (1e-3, 0.3, affine, track)
    copy.deepcopy(ours)  # unlike torch's lazy layer
    x = torch.randn(*shape, dtype=torch.float64)
    torch.testing.assert_close(ours(x), ref(x))
    assert ours.num_features == 5 and not hasattr(ours, "_initialize_hook")
    torch.testing.assert_close(ours.state_dict(), ref.state_dict())


def test_a_converted_lazy_layer_takes_a_state_dict_as_torchs_does():
    state = nn.BatchNorm2d(5).state_dict()
    state["running_mean"] += 1.5
    for layer in (nn.LazyBatchNorm2d(), accumnorm.convert(nn.LazyBatchNorm2d())):
        layer.load_state_dict(state)
        torch.testing.assert_close(layer.state_dict(), state)


def test_convert_keeps_the_tensors_a_state_dict_gave_a_lazy_layer_and_matches_the_whole_batch():
    """Loaded, torch's lazy layer has its tensors but is still a LazyBatchNorm2d of num_features 0 until a forward."""
    trained = _net(nn.BatchNorm2d(4))
    trained(_digits()[0])
    model = _net(nn.LazyBatchNorm2d())
    model.load_state_dict(trained.state_dict())
    weight = model[1].weight
    model = accumnorm.convert(model)
    assert type(model[1]) is accumnorm.BatchNorm2d and model[1].num_features == 4 and model[1].weight is weight
    assert not hasattr(model[1], "_initialize_hook") and not model[1]._forward_pre_hooks
    torch.testing.assert_close(model.state_dict(), trained.state_dict())
    batch = _digits()
    loss = accumnorm.backward(model, batch, ce_loss, micro_batch_size=2)
    torch.testing.assert_close(loss, whole_batch(trained, batch), rtol=1e-12, atol=0)
    compare(trained, model, 1e-10)


def test_revert_still_refuses_a_layer_still_lazy():
    model = accumnorm.convert(nn.Sequential(nn.LazyBatchNorm2d()))
    with pytest.raises(ValueError, match=r"cannot revert 0 \(BatchNorm2d\) before its lazy shape is known: "
                                         "BatchNorm2d is never lazy; run one forward first"):
        accumnorm.revert(model)
    model(torch.randn(2, 3, 2, 2))
    assert type(accumnorm.revert(model)[0]) is nn.BatchNorm2d


def test_a_lazy_layer_converted_then_trained_by_backward_matches_torchs_whole_batch():
    torch.manual_seed(1)
    ref = _net(nn.LazyBatchNorm2d(eps=1e-4, momentum=0.5))
    torch.manual_seed(1)
    ours = accumnorm.convert(_net(nn.LazyBatchNorm2d(eps=1e-4, momentum=0.5)))
    batch = _digits()
    loss = accumnorm.backward(ours, batch, ce_loss, micro_batch_size=2)
    torch.testing.assert_close(loss, whole_batch(ref, batch), rtol=1e-12, atol=0)
    compare(ref, ours, 1e-10)
