"""torchvision and timm models: norm_layer=, convert/revert of timm's BatchNormAct2d, and the whole-batch oracle.

bn="exact" needs no conversion: the last test runs models whose BatchNorm layers are torch's or timm's own.
"""
from __future__ import annotations

import copy
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

import accumnorm
from helpers import assert_unchanged, ce_loss, child_env, exact_vs_whole_batch, snapshot
from models import data

timm = pytest.importorskip("timm")
torchvision = pytest.importorskip("torchvision")
timm_norm_act = pytest.importorskip("timm.layers.norm_act")
from accumnorm.integrations.timm import BatchNormAct2d  # noqa: E402  (after the importorskip of timm)

IMAGE = (3, 32, 32)


def bn_types(model: nn.Module) -> set[type]:
    return {type(m) for m in model.modules() if isinstance(m, _BatchNorm)}


def tiny_resnet(**kwargs) -> nn.Module:
    """torchvision's ResNet with one BasicBlock per stage (resnet10): its code, a third of resnet18's cost."""
    from torchvision.models.resnet import BasicBlock, ResNet

    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10, **kwargs)


def test_torchvision_resnet_takes_norm_layer_and_gives_the_whole_batch_gradient():
    ours = tiny_resnet(norm_layer=accumnorm.BatchNorm2d).double()
    assert bn_types(ours) == {accumnorm.BatchNorm2d}
    ref = accumnorm.revert(copy.deepcopy(ours))  # the oracle: the same tensors in torch's BatchNorm
    assert bn_types(ref) == {nn.BatchNorm2d}
    exact_vs_whole_batch(ref, ours, data(IMAGE, 6, torch.float64), 2, 1e-8)


@pytest.mark.slow
def test_converted_torchvision_resnet18_gives_the_whole_batch_gradient():
    ref = torchvision.models.resnet18(num_classes=10).double()
    ours = accumnorm.convert(copy.deepcopy(ref))
    assert bn_types(ours) == {accumnorm.BatchNorm2d}
    exact_vs_whole_batch(ref, ours, data(IMAGE, 6, torch.float64), 3, 1e-8)


def test_torchvision_resnet_with_a_registry_norm():
    model = tiny_resnet(norm_layer=accumnorm.norm_layer("gn8"))
    assert {type(m) for m in model.modules() if isinstance(m, nn.GroupNorm)} == {accumnorm.GroupNorm}
    assert all(m.num_groups == 8 for m in model.modules() if isinstance(m, nn.GroupNorm))
    assert model(torch.randn(2, *IMAGE)).shape == (2, 10)


def test_timm_resnet_takes_norm_layer_and_gives_the_whole_batch_gradient():
    ours = timm.create_model("test_resnet", pretrained=False, num_classes=10, norm_layer=accumnorm.BatchNorm2d).double()
    assert bn_types(ours) == {accumnorm.BatchNorm2d}
    exact_vs_whole_batch(accumnorm.revert(copy.deepcopy(ours)), ours, data(IMAGE, 6, torch.float64), 3, 1e-8)


def test_convert_keeps_timm_batchnormact_act_and_drop_and_revert_goes_back():
    model = timm.create_model("test_byobnet", pretrained=False, num_classes=10)
    before = [(n, m.act, m.drop, m.weight, m.running_mean) for n, m in model.named_modules()
              if isinstance(m, timm_norm_act.BatchNormAct2d)]
    assert before and any(not isinstance(act, nn.Identity) for _, act, *_ in before)
    ours = accumnorm.convert(model)
    assert bn_types(ours) == {BatchNormAct2d}
    for name, act, drop, weight, running_mean in before:
        layer = ours.get_submodule(name)
        assert layer.act is act and layer.drop is drop and layer.weight is weight and layer.running_mean is running_mean
        assert isinstance(layer, timm_norm_act.BatchNormAct2d)  # timm's own helpers still recognize it
    back = accumnorm.revert(ours)
    assert bn_types(back) == {timm_norm_act.BatchNormAct2d}
    assert all(back.get_submodule(name).act is act for name, act, *_ in before)


def test_converted_timm_batchnormact_model_gives_the_whole_batch_gradient():
    ref = timm.create_model("test_byobnet", pretrained=False, num_classes=10).double()
    ours = accumnorm.convert(copy.deepcopy(ref))
    assert bn_types(ours) == {BatchNormAct2d}
    exact_vs_whole_batch(ref, ours, data(IMAGE, 6, torch.float64), 2, 1e-8)


def test_batchnormact_is_timms_layer_call_for_call_outside_backward():
    ref = timm_norm_act.BatchNormAct2d(6, act_layer=nn.SiLU, drop_layer=nn.Dropout)
    ours = accumnorm.convert(nn.Sequential(copy.deepcopy(ref)))[0]
    assert isinstance(ours.act, nn.SiLU) and isinstance(ours.drop, nn.Dropout)
    x = torch.randn(4, 6, 5, 5)
    for training in (True, False):
        ref.train(training), ours.train(training)
        torch.manual_seed(1)
        expected = ref(x)
        torch.manual_seed(1)
        torch.testing.assert_close(ours(x), expected)
    torch.testing.assert_close(ours.running_var, ref.running_var)


def test_sync_batchnormact_converts_and_timm_helpers_keep_the_activation():
    model = timm_norm_act.convert_sync_batchnorm(nn.Sequential(timm_norm_act.BatchNormAct2d(4, act_layer=nn.GELU)))
    assert type(model[0]) is timm_norm_act.SyncBatchNormAct
    ours = accumnorm.convert(model)
    assert type(ours[0]) is BatchNormAct2d and isinstance(ours[0].act, nn.GELU)
    frozen = timm.layers.freeze_batch_norm_2d(copy.deepcopy(ours))
    assert type(frozen[0]) is timm_norm_act.FrozenBatchNormAct2d and isinstance(frozen[0].act, nn.GELU)


def test_batchnormact_takes_timms_constructor_arguments():
    def params(cls):
        return [(p.name, p.kind, p.default) for p in inspect.signature(cls.__init__).parameters.values()]

    assert params(BatchNormAct2d) == params(timm_norm_act.BatchNormAct2d)
    with pytest.raises(TypeError, match="BatchNormAct2d is not lazy"):
        BatchNormAct2d(None)


@pytest.mark.realtime
def test_convert_leaves_timm_out_until_timm_is_imported():
    """timm stays optional: converting a torch model neither needs nor imports it."""
    program = Path(__file__).parents[1] / "programs" / "convert_without_timm.py"
    done = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, timeout=600, env=child_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "converted BatchNorm2d; timm imported: False"


def test_the_timm_integration_without_timm_says_what_to_install(monkeypatch):
    for name in [n for n in sys.modules if n == "timm" or n.startswith("timm.")] + ["accumnorm.integrations.timm"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm now fails, as where it is not installed
    with pytest.raises(ImportError, match=r"pip install 'accumnorm\[timm\]'"):
        __import__("accumnorm.integrations.timm")


def test_timm_maps_norm_layer_to_its_own_batchnormact_which_convert_makes_exact():
    """timm's norm-act models look norm_layer up by class name: accumnorm.BatchNorm2d gives timm's layer."""
    model = timm.create_model("test_byobnet", pretrained=False, num_classes=10, norm_layer=accumnorm.BatchNorm2d)
    assert bn_types(model) == {timm_norm_act.BatchNormAct2d}
    assert bn_types(accumnorm.convert(model)) == {BatchNormAct2d}


@pytest.mark.parametrize("build", [
    tiny_resnet,
    lambda: timm.create_model("test_byobnet", pretrained=False, num_classes=10, norm_layer=accumnorm.BatchNorm2d),
], ids=["torchvision-resnet", "timm-byobnet-norm-layer"])
def test_unconverted_models_give_the_whole_batch_gradient(build):
    ref = build().double()
    ours = copy.deepcopy(ref)
    assert not any(type(m).__module__.startswith("accumnorm") for m in ours.modules())
    exact_vs_whole_batch(ref, ours, data(IMAGE, 6, torch.float64), 2, 1e-8)


@pytest.mark.parametrize("layer, message", [
    ("split", "SplitBatchNorm2d .* normalizes each of its input's num_splits blocks of rows"),
    ("evonorm", "EvoNorm2dB0 .* computes the batch variance by hand"),
])
def test_timm_layers_that_mix_the_samples_without_a_batch_norm_call_are_refused_before_the_step(layer, message):
    """timm's SplitBatchNorm2d normalizes its input's row blocks apart (each micro-batch's blocks, not the whole
    batch's: 1.7 off), EvoNorm2dB0 takes the batch variance by hand (running variance 0.22 off): no schedule sees
    either, and the step ran on. Refused by name in training, nothing changed; in eval mode they run."""
    from timm.layers import EvoNorm2dB0, convert_splitbn_model

    torch.manual_seed(0)
    if layer == "split":
        model = convert_splitbn_model(tiny_resnet(), 2)
    else:
        model = nn.Sequential(nn.Conv2d(3, 4, 3), EvoNorm2dB0(4), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                              nn.Linear(4, 10))
    batch = data(IMAGE, 8, torch.float32)
    before = snapshot(model)
    with pytest.raises(ValueError, match=message):
        accumnorm.backward(model, batch, ce_loss, micro_batch_size=4)
    assert_unchanged(model, before)
    model.eval()
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=4)
