"""The norm factory and the model converters."""
import pytest
import torch
import torch.nn as nn

import accumnorm


@pytest.mark.parametrize("name,cls", [
    ("bn", accumnorm.BatchNorm2d), ("bn1d", accumnorm.BatchNorm1d), ("bn3d", accumnorm.BatchNorm3d),
    ("gn4", accumnorm.GroupNorm), ("GN16", accumnorm.GroupNorm), ("in", accumnorm.InstanceNorm2d),
    ("ln", accumnorm.LayerNorm), ("none", nn.Identity),
])
@pytest.mark.parametrize("channels", [32, None])
def test_factory_builds_each_kind_eager_or_lazy(name, cls, channels):
    layer = accumnorm.norm(name, channels)
    assert type(layer) is cls
    out = layer(torch.randn(2, 32, 4, 4) if "1d" not in name and "3d" not in name else
                torch.randn(2, 32, 4) if "1d" in name else torch.randn(2, 32, 2, 2, 2))
    assert out.shape[1] == 32
    if name.startswith(("gn", "GN")):
        assert layer.num_groups == int(name[2:])
    if name == "in":
        assert layer.affine


def test_factory_passes_kwargs_and_rejects_unknown_names():
    assert accumnorm.norm("bn", 8, momentum=0.5).momentum == 0.5
    assert accumnorm.norm("in", 8, affine=False).affine is False
    with pytest.raises(ValueError, match=r"unknown norm 'batchnorm'; valid names: bn, .*gn<G>.*none"):
        accumnorm.norm("batchnorm", 8)
    with pytest.raises(TypeError, match="norm name must be a str, got int"):
        accumnorm.norm(4, 8)


def test_convert_keeps_tensors_flags_and_optimizer_and_revert_goes_back():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.Flatten(), nn.BatchNorm1d(4 * 36)),
                          nn.SyncBatchNorm(2))
    model[1](torch.randn(5, 4, 6, 6))  # non-trivial running stats
    model[2].eval()
    weight, running_mean = model[1].weight, model[1].running_mean
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    conv = accumnorm.convert(model)
    assert conv is model
    assert type(conv[1]) is accumnorm.BatchNorm2d and type(conv[2][1]) is accumnorm.BatchNorm1d
    assert type(conv[3]) is accumnorm.BatchNorm
    assert conv[1].weight is weight and conv[1].running_mean is running_mean
    assert int(conv[1].num_batches_tracked) == 1
    assert conv[1].training and not conv[2][1].training
    conv[1].weight.grad = torch.ones(4)
    opt.step()  # the optimizer built before conversion updates the converted layer
    assert torch.allclose(conv[1].weight, torch.full((4,), 0.9))
    back = accumnorm.revert(conv)
    assert type(back[1]) is nn.BatchNorm2d and type(back[2][1]) is nn.BatchNorm1d and type(back[3]) is nn.SyncBatchNorm
    assert back[1].weight is weight and not back[2][1].training


def test_convert_of_a_bare_layer_returns_a_new_layer():
    bn = nn.BatchNorm1d(3, affine=False, track_running_stats=False)
    out = accumnorm.convert(bn)
    assert type(out) is accumnorm.BatchNorm1d and out.weight is None and out.running_mean is None


def test_revert_refuses_a_lazy_layer_before_its_first_forward():
    with pytest.raises(ValueError, match="before its lazy shape is known"):
        accumnorm.revert(accumnorm.BatchNorm2d())


def test_norm_layer_returns_a_builder_from_the_same_registry_as_norm():
    assert accumnorm.norm_layer("bn") is accumnorm.BatchNorm2d and accumnorm.norm_layer("none") is nn.Identity
    for name in [n.replace("<G>", "4") for n in accumnorm.NORM_NAMES]:
        builder = accumnorm.norm_layer(name)
        assert callable(builder) and not isinstance(builder, nn.Module)
        assert type(builder(32)) is type(accumnorm.norm(name, 32))  # 32: EvoNorm-S0's default groups divide it
    gn = accumnorm.norm_layer(" GN32 ")  # validated by name: no layer is built, so no channel count is needed
    assert gn(64).num_groups == 32 and gn(64).num_channels == 64 and gn(num_groups=8).num_groups == 8
    assert accumnorm.norm_layer("in")(8).affine and not accumnorm.norm_layer("in")(8, affine=False).affine


@pytest.mark.parametrize("bad", ["gn0", "gn", "gn-2", "bn4d", ""])
def test_norm_layer_refuses_bad_names_listing_the_valid_ones(bad):
    with pytest.raises(ValueError, match=rf"unknown norm '{bad}'; valid names: bn, bn1d.*gn<G>.*none"):
        accumnorm.norm_layer(bad)
    with pytest.raises(TypeError, match="norm name must be a str, got type"):
        accumnorm.norm_layer(nn.BatchNorm2d)


class MyBatchNorm(nn.BatchNorm2d):
    """A user's subclass with its own forward: convert leaves it alone unless asked."""

    def forward(self, x):
        return super().forward(x) * 2


def test_convert_leaves_subclasses_alone_unless_listed_in_types():
    model = nn.Sequential(nn.BatchNorm2d(3), MyBatchNorm(3))
    weight = model[1].weight
    assert type(accumnorm.convert(model)[1]) is MyBatchNorm
    assert type(accumnorm.convert(model, types=[MyBatchNorm])[1]) is accumnorm.BatchNorm2d
    assert model[1].weight is weight
    sync = nn.Sequential(type("MySync", (nn.SyncBatchNorm,), {})(3))
    assert type(accumnorm.convert(sync, types=type(sync[0]))[0]) is accumnorm.BatchNorm  # one class is fine too
    for bad in [nn.Conv2d, "MyBatchNorm", [MyBatchNorm, nn.GroupNorm]]:
        with pytest.raises(TypeError, match="convert\\(types=...\\) expects subclasses of BatchNorm1d, BatchNorm2d"):
            accumnorm.convert(nn.Sequential(MyBatchNorm(3)), types=bad)


def test_convert_refuses_before_changing_anything_and_keeps_shared_layers_shared():
    model = nn.Sequential(accumnorm.BatchNorm2d(3), nn.Sequential(accumnorm.BatchNorm2d()))
    with pytest.raises(ValueError, match=r"cannot revert 1.0 \(BatchNorm2d\) before its lazy shape is known"):
        accumnorm.revert(model)
    assert type(model[0]) is accumnorm.BatchNorm2d  # the layer before the lazy one was not reverted
    shared = nn.BatchNorm2d(3)
    model = accumnorm.convert(nn.Sequential(shared, nn.ReLU(), shared))
    assert model[0] is model[2] and type(model[0]) is accumnorm.BatchNorm2d


def test_a_parametrized_layer_is_refused_naming_the_parametrization_before_anything_changes():
    """torch's parametrize keeps a parametrization in the layer's class, which a conversion replaces: its output would
    change (the parametrization gone, a fresh weight beside the original), silently."""

    class Abs(nn.Module):
        def forward(self, w):
            return w.abs()

    model = nn.Sequential(nn.Conv2d(1, 3, 1), nn.BatchNorm2d(3))
    torch.nn.utils.parametrize.register_parametrization(model[1], "weight", Abs())
    parametrized = type(model[1])
    assert accumnorm.convert(model)[1] is model[1]  # a subclass: left alone unless named
    with pytest.raises(ValueError, match=r"cannot convert 1 \(ParametrizedBatchNorm2d\): its parametrization of "
                                         r"weight.*Nothing was changed.*remove_parametrizations"):
        accumnorm.convert(model, types=parametrized)
    assert type(model[1]) is parametrized and torch.nn.utils.parametrize.is_parametrized(model[1], "weight")


@pytest.mark.parametrize("call, words", [
    (lambda: accumnorm.convert(None), "convert expects an nn.Module, got NoneType"),
    (lambda: accumnorm.revert("model"), "revert expects an nn.Module, got str"),
    (lambda: accumnorm.convert(nn.Sequential(nn.BatchNorm2d(3)), types=3),
     r"convert\(types=...\) expects a class or an iterable of classes, got int"),
])
def test_convert_and_revert_name_what_they_expect_when_given_something_else(call, words):
    with pytest.raises(TypeError, match=words):
        call()


def test_convert_and_revert_keep_the_layers_hooks_and_attributes():
    """convert used to drop them silently: a hook on a BatchNorm stopped firing, `bn.tag` was gone."""
    model = nn.Sequential(nn.Conv2d(1, 3, 1), nn.BatchNorm2d(3))
    bn, calls = model[1], []
    bn.register_forward_pre_hook(lambda m, args: calls.append(("pre", type(m))))
    hook = bn.register_forward_hook(lambda m, args, out: calls.append(("forward", type(m))))
    bn.register_full_backward_hook(lambda m, grad_in, grad_out: calls.append(("backward", type(m))))
    bn.register_state_dict_post_hook(lambda m, state, prefix, local: calls.append(("state_dict", type(m))))
    bn.register_load_state_dict_pre_hook(lambda m, state, prefix, *rest: calls.append(("load", type(m))))
    bn.tag = "x"
    model(torch.randn(4, 1, 2, 2))  # running statistics that are not the initial ones
    state = model.state_dict()
    for swap, cls in [(accumnorm.convert, accumnorm.BatchNorm2d), (accumnorm.revert, nn.BatchNorm2d)]:
        calls.clear()
        swap(model)
        layer = model[1]
        assert type(layer) is cls and isinstance(layer, nn.BatchNorm2d) and layer.tag == "x"
        now = model.state_dict()
        assert now.keys() == state.keys() and all(torch.equal(now[k], v) for k, v in state.items())
        model.load_state_dict(now)
        model.train()(torch.randn(4, 1, 2, 2, requires_grad=True)).sum().backward()
        assert calls == [("state_dict", cls), ("load", cls), ("pre", cls), ("forward", cls), ("backward", cls)]
        state = model.state_dict()
    hook.remove()  # a handle taken before convert and revert still removes its hook
    calls.clear()
    model(torch.randn(4, 1, 2, 2))
    assert ("forward", nn.BatchNorm2d) not in calls and ("pre", nn.BatchNorm2d) in calls


def test_convert_rebinds_a_method_the_layer_holds_to_the_new_layer():
    bn = nn.BatchNorm1d(2)
    bn.original_forward = bn.forward  # e.g. a wrapper keeping the forward it wraps
    out = accumnorm.convert(bn)
    assert out.original_forward.__self__ is out


def test_a_layer_a_state_dict_made_before_its_first_forward_reverts_to_a_working_torch_layer():
    """accumnorm's lazy BatchNorm2d given its tensors by a state_dict keeps its lazy hooks (and num_features None)
    until its first forward: revert carried both over to torch's BatchNorm2d, whose forward then failed
    (AttributeError: no initialize_parameters) and which said num_features=None."""
    torch.manual_seed(0)
    eager = nn.BatchNorm2d(3)
    with torch.no_grad():
        eager.running_mean.fill_(1.0)
        eager.weight.fill_(2.0)
    lazy = nn.Sequential(nn.Conv2d(1, 3, 1), accumnorm.BatchNorm2d())
    lazy.load_state_dict(nn.Sequential(nn.Conv2d(1, 3, 1), eager).state_dict())
    out = accumnorm.revert(lazy)
    assert type(out[1]) is nn.BatchNorm2d and out[1].num_features == 3 and not out[1]._forward_pre_hooks
    x = torch.randn(2, 1, 4, 4)
    torch.testing.assert_close(out[1].eval()(x.expand(2, 3, 4, 4)), eager.eval()(x.expand(2, 3, 4, 4)))
