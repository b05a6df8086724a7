"""accumnorm's BatchNorm layers behave as torch's outside accumnorm.backward, and are lazy when asked."""
import copy

import pytest
import torch
import torch.nn as nn

from accumnorm import BatchNorm, BatchNorm1d, BatchNorm2d, BatchNorm3d
from helpers import rel_err

CASES = [(BatchNorm1d, nn.BatchNorm1d, (6, 5)), (BatchNorm1d, nn.BatchNorm1d, (6, 5, 7)),
         (BatchNorm2d, nn.BatchNorm2d, (6, 5, 4, 3)), (BatchNorm3d, nn.BatchNorm3d, (6, 5, 2, 3, 2))]


@pytest.mark.parametrize("ours_cls,torch_cls,shape", CASES)
@pytest.mark.parametrize("lazy", [False, True])
def test_same_outputs_and_buffers_as_torch_in_train_and_eval(ours_cls, torch_cls, shape, lazy):
    ref = torch_cls(5, momentum=0.3)
    ours = ours_cls(None if lazy else 5, momentum=0.3)
    for _ in range(3):
        x = torch.randn(shape) * 2 + 1
        assert torch.allclose(ours(x), ref(x), atol=1e-6)
    assert torch.allclose(ours.running_mean, ref.running_mean) and torch.allclose(ours.running_var, ref.running_var)
    assert ours.num_batches_tracked == ref.num_batches_tracked == 3
    ref.eval(), ours.eval()
    x = torch.randn(shape)
    assert torch.allclose(ours(x), ref(x), atol=1e-6)


def test_is_a_torch_batchnorm_and_state_dict_interchanges():
    ours = BatchNorm2d(4)
    assert isinstance(ours, nn.BatchNorm2d) and isinstance(ours, nn.modules.batchnorm._BatchNorm)
    ref = nn.BatchNorm2d(4)
    ref(torch.randn(3, 4, 2, 2))
    ours.load_state_dict(ref.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), ref.state_dict().values()))
    back = nn.BatchNorm2d(4)
    back.load_state_dict(ours.state_dict())
    assert list(ours.state_dict()) == list(ref.state_dict())


def test_lazy_layer_infers_channels_and_loads_a_state_dict_before_first_use():
    lazy = BatchNorm2d()
    assert lazy.num_features is None and lazy.has_uninitialized_params()
    assert "None" in repr(lazy)
    lazy(torch.randn(2, 7, 3, 3))
    assert lazy.num_features == 7 and lazy.weight.shape == (7,) and lazy.running_var.shape == (7,)
    ref = nn.BatchNorm2d(7)
    ref.weight.data.fill_(2.0)
    fresh = BatchNorm2d()
    fresh.load_state_dict(ref.state_dict())
    assert torch.equal(fresh.weight, ref.weight)
    with pytest.raises(ValueError, match="expected 7 channels at dim 1, got input of shape"):
        fresh(torch.randn(2, 8, 3, 3))


def test_the_popular_article_mistake_cannot_happen():
    """nn.LazyBatchNorm2d(32) means eps=32; accumnorm's first argument is the channel count."""
    assert nn.LazyBatchNorm2d(32).eps == 32
    assert BatchNorm2d(32).num_features == 32 and BatchNorm2d(32).eps == 1e-5


def test_generic_batchnorm_takes_any_rank_like_syncbatchnorm():
    m = BatchNorm(3)
    for shape in [(4, 3), (4, 3, 5), (4, 3, 2, 2, 2, 2)]:
        assert m(torch.randn(shape)).shape == shape
    with pytest.raises(ValueError, match="expected at least 2D input"):
        m(torch.randn(3))


@pytest.mark.parametrize("bad,exc", [(3.0, TypeError), ("8", TypeError), (True, TypeError), (0, ValueError)])
def test_bad_num_features(bad, exc):
    with pytest.raises(exc, match="num_features must be a positive int or None"):
        BatchNorm2d(bad)


def test_an_integer_of_another_type_is_a_channel_count_as_for_torchs_layers():
    """torch's BatchNorm2d takes numpy's int64 (a channel count read from an array, a config): it was refused."""
    import numpy as np

    m = BatchNorm2d(np.int64(8))
    assert type(m.num_features) is int and m.num_features == 8 == torch.nn.BatchNorm2d(np.int64(8)).num_features
    assert m(torch.randn(2, 8, 3, 3)).shape == (2, 8, 3, 3)


def test_wrong_rank_and_channels_give_clear_errors():
    m = BatchNorm2d(4)
    with pytest.raises(ValueError, match=r"expected 4D input \(got 3D input\)"):
        m(torch.randn(2, 4, 3))
    expected = r"BatchNorm2d expected 4 channels at dim 1, got input of shape \(2, 5, 3, 3\)"
    with pytest.raises(ValueError, match=expected):
        m(torch.randn(2, 5, 3, 3))


def test_device_and_dtype_factory_kwargs_and_deepcopy():
    m = BatchNorm1d(3, dtype=torch.float64, device="cpu")
    assert m.weight.dtype == torch.float64 and m.running_mean.dtype == torch.float64
    lazy = BatchNorm1d(dtype=torch.float64)
    lazy(torch.randn(4, 3, dtype=torch.float64))
    assert lazy.weight.dtype == torch.float64
    c = copy.deepcopy(m)
    assert rel_err(c(torch.ones(2, 3, dtype=torch.float64)), m(torch.ones(2, 3, dtype=torch.float64))) == 0


def test_lazy_layer_keeps_a_state_dict_loaded_before_its_first_forward():
    """As torch's lazy norms: loading materializes the shapes and the values, and the first forward keeps both."""
    eager = BatchNorm2d(3)
    with torch.no_grad():
        values = [(eager.weight, 2.0), (eager.bias, 0.5), (eager.running_mean, 1.0), (eager.running_var, 4.0)]
        for tensor, value in values:
            tensor.fill_(value)
    lazy = BatchNorm2d()
    lazy.load_state_dict(eager.state_dict())
    lazy.eval()
    x = torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(lazy(x), eager.eval()(x))
    assert float(lazy.weight[0]) == 2.0 and float(lazy.running_var[0]) == 4.0 and lazy.num_features == 3


def test_lazy_layer_given_only_its_running_statistics_keeps_them_at_its_first_forward():
    """A state_dict with the running statistics alone (strict=False): the first forward materialized the weight and
    bias, and reset every tensor, the loaded statistics among them (zeroed, silently). The weight and bias get their
    initial values; the statistics stay as loaded."""
    lazy = BatchNorm2d()
    stats = {"running_mean": torch.full((3,), 5.0), "running_var": torch.full((3,), 9.0),
             "num_batches_tracked": torch.tensor(100)}
    lazy.load_state_dict(stats, strict=False)
    lazy.eval()
    x = torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(lazy(x), (x - 5.0) / (9.0 + lazy.eps) ** 0.5)
    assert int(lazy.num_batches_tracked) == 100 and float(lazy.weight[0]) == 1.0 and float(lazy.bias[0]) == 0.0
