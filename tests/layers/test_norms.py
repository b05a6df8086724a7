"""The per-sample norms: torch's layers with channels first and lazy shape inference."""
import pytest
import torch
import torch.nn as nn

from accumnorm import GroupNorm, InstanceNorm1d, InstanceNorm2d, InstanceNorm3d, LayerNorm


@pytest.mark.parametrize("lazy", [False, True])
def test_groupnorm_is_torchs_with_channels_first(lazy):
    ours, ref = GroupNorm(None if lazy else 8, num_groups=4), nn.GroupNorm(4, 8)
    x = torch.randn(3, 8, 5, 5)
    assert torch.allclose(ours(x), ref(x), atol=1e-6)
    assert ours.num_channels == 8 and "8, num_groups=4" in repr(ours)


def test_groupnorm_needs_divisible_channels():
    with pytest.raises(ValueError, match=r"num_channels \(6\) must be divisible by num_groups \(4\)"):
        GroupNorm(6, 4)
    with pytest.raises(ValueError, match="GroupNorm with 4 groups needs channels divisible by it, got 6"):
        GroupNorm(num_groups=4)(torch.randn(2, 6, 3))


@pytest.mark.parametrize("ours_cls,ref_cls,shape", [
    (InstanceNorm1d, nn.InstanceNorm1d, (2, 4, 9)),
    (InstanceNorm2d, nn.InstanceNorm2d, (2, 4, 5, 5)),
    (InstanceNorm3d, nn.InstanceNorm3d, (2, 4, 3, 3, 3)),
    (InstanceNorm2d, nn.InstanceNorm2d, (4, 5, 5)),  # unbatched
])
@pytest.mark.parametrize("lazy", [False, True])
def test_instancenorm_is_torchs(ours_cls, ref_cls, shape, lazy):
    ours, ref = ours_cls(None if lazy else 4, affine=True), ref_cls(4, affine=True)
    x = torch.randn(shape)
    assert torch.allclose(ours(x), ref(x), atol=1e-6)
    assert ours.num_features == 4 and ours.weight.shape == (4,)


@pytest.mark.parametrize("lazy", [False, True])
def test_layernorm_normalizes_the_channel_dim(lazy):
    ours, ref = LayerNorm(None if lazy else 6), nn.LayerNorm(6)
    x = torch.randn(2, 6, 4, 3)
    assert torch.allclose(ours(x), ref(x.movedim(1, -1)).movedim(-1, 1), atol=1e-6)
    flat = torch.randn(5, 6)
    assert torch.allclose(ours(flat), ref(flat), atol=1e-6)
    with pytest.raises(ValueError, match="expected 6 channels at dim 1"):
        ours(torch.randn(2, 5, 3))
