"""accumnorm's layers meet PyTorch's tools as torch's own norms do: one test per tool, each able to fail."""
from __future__ import annotations

import copy
import inspect
import io
import pickle

import pytest
import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

import accumnorm
from accumnorm import (
    BatchNorm,
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    GroupNorm,
    InstanceNorm1d,
    InstanceNorm2d,
    InstanceNorm3d,
    LayerNorm,
)
from helpers import exact_vs_whole_batch
from models import data, resnet

# Each accumnorm layer against torch's layer of the same name (BatchNorm: SyncBatchNorm, what convert maps).
SAME_NAME = [(BatchNorm, nn.SyncBatchNorm), (BatchNorm1d, nn.BatchNorm1d), (BatchNorm2d, nn.BatchNorm2d),
             (BatchNorm3d, nn.BatchNorm3d), (GroupNorm, nn.GroupNorm), (InstanceNorm1d, nn.InstanceNorm1d),
             (InstanceNorm2d, nn.InstanceNorm2d), (InstanceNorm3d, nn.InstanceNorm3d), (LayerNorm, nn.LayerNorm)]
# Departures, each a NOTE in the class's docstring: channels first (so GroupNorm's first two swap and the
# count defaults to None, lazy), LayerNorm over the channel dim, no process_group (backward takes it).
RENAMED = {LayerNorm: {"normalized_shape": "num_features", "elementwise_affine": "affine"}}
DROPPED = {BatchNorm: {"process_group"}}
CHANNELS = {"num_features", "num_channels"}


def _params(cls: type) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("ours,theirs", SAME_NAME, ids=lambda c: c.__name__)
def test_constructor_takes_every_argument_of_torchs_layer_of_the_same_name(ours, theirs):
    """Catches the next argument torch adds (as bias= in 2.14): same names, kinds, order and defaults."""
    mine = {p.name: p for p in _params(ours)}
    renamed, dropped = RENAMED.get(ours, {}), DROPPED.get(ours, set())
    expected = [p.replace(name=renamed.get(p.name, p.name)) for p in _params(theirs) if p.name not in dropped]
    missing = [p.name for p in expected if p.name not in mine]
    assert not missing, f"{ours.__name__} does not take torch's {missing}"
    positional = [p.name for p in expected if p.kind is p.POSITIONAL_OR_KEYWORD]
    if ours is GroupNorm:
        positional[:2] = positional[1::-1]  # (num_channels, num_groups): channels first
    assert [p.name for p in _params(ours) if p.kind is p.POSITIONAL_OR_KEYWORD] == positional
    for p in expected:
        assert mine[p.name].kind == p.kind, p.name
        if p.name in CHANNELS:
            assert mine[p.name].default is None  # lazy
        elif p.default is not p.empty:
            assert mine[p.name].default == p.default, p.name


def test_bias_false_is_torchs_weight_without_bias_eager_lazy_and_converted():
    for ours_cls, ref, shape in [(BatchNorm2d, nn.BatchNorm2d(3, bias=False), (4, 3, 5, 5)),
                                 (InstanceNorm1d, nn.InstanceNorm1d(3, affine=True, bias=False), (4, 3, 7)),
                                 (GroupNorm, nn.GroupNorm(1, 3, bias=False), (4, 3, 5))]:
        kwargs = {"affine": True} if ours_cls is InstanceNorm1d else {"num_groups": 1} if ours_cls is GroupNorm else {}
        x = torch.randn(shape)
        for ours in (ours_cls(3, bias=False, **kwargs), ours_cls(None, bias=False, **kwargs)):
            out = ours(x)
            assert ours.bias is None and ours.weight.shape == (3,)
            torch.testing.assert_close(out, ref(x))
            assert list(ours.state_dict()) == list(ref.state_dict())
    ln = LayerNorm(3, bias=False)
    assert ln.bias is None and list(ln.state_dict()) == ["weight"]
    back = accumnorm.revert(accumnorm.convert(nn.Sequential(nn.BatchNorm2d(3, bias=False))))
    assert type(back[0]) is nn.BatchNorm2d and back[0].bias is None and "bias=False" in repr(back[0])


def test_exact_backward_with_a_bias_free_batchnorm_matches_the_whole_batch():
    ref = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4, bias=False), nn.Tanh(), nn.Flatten(), nn.LazyLinear(10))
    ref = ref.double()
    ref(torch.zeros(1, 1, 6, 6, dtype=torch.float64))
    exact_vs_whole_batch(ref, accumnorm.convert(copy.deepcopy(ref)), data((1, 6, 6), 6, torch.float64), 2, 1e-9)


def _every_norm() -> nn.Module:
    """One of each accumnorm layer (a lazy one materialized), in an order torch.compile's aot_eager takes."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), BatchNorm2d(8), nn.ReLU(), GroupNorm(8, num_groups=4),
                          LayerNorm(8), InstanceNorm2d(8, affine=True), BatchNorm2d(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), BatchNorm1d(8), nn.Linear(8, 10))
    model(torch.randn(4, 3, 6, 6))
    return model


def test_data_parallel_replicates_eager_materialized_and_converted_layers():
    """DataParallel's replicate calls each module's _replicate_for_data_parallel (CUDA-only otherwise)."""
    model = nn.Sequential(accumnorm.convert(resnet()), _every_norm())
    lazy = BatchNorm2d()
    with pytest.raises(RuntimeError, match="uninitialized parameters"):
        lazy._replicate_for_data_parallel()  # still refused: its shape is unknown
    x = torch.randn(3, 8, 4, 4)
    for layer in [BatchNorm2d(32), *model.modules()]:
        replica = layer._replicate_for_data_parallel()
        assert type(replica) is type(layer) and replica._is_replica
    layer = model[1][1].eval()
    replica = layer._replicate_for_data_parallel()
    replica._parameters.update(layer._parameters)  # replicate gives each replica its device's copies
    torch.testing.assert_close(replica(x), layer(x))


@pytest.mark.cuda  # torch.nn.parallel.replicate needs CUDA devices
def test_data_parallel_replicate_on_cuda():
    model = _every_norm().cuda().eval()
    replica = torch.nn.parallel.replicate(model, [0])[0]
    x = torch.randn(4, 3, 6, 6, device="cuda")
    torch.testing.assert_close(replica(x), model(x))


def test_fx_traces_a_converted_model_to_the_torch_models_graph():
    torchvision = pytest.importorskip("torchvision")
    ref = torchvision.models.resnet18(num_classes=10)
    ours = accumnorm.convert(copy.deepcopy(ref))
    graph, ref_graph = torch.fx.symbolic_trace(ours), torch.fx.symbolic_trace(ref)
    assert [(n.op, n.name, n.target) for n in graph.graph.nodes] == [
        (n.op, n.name, n.target) for n in ref_graph.graph.nodes]
    assert type(graph.get_submodule("layer1.0.bn1")) is BatchNorm2d
    x = torch.randn(2, 3, 32, 32)
    for training in (True, False):  # a leaf keeps the train/eval switch of the layer
        ours.train(training), graph.train(training)
        torch.testing.assert_close(graph(x), ours(x))


def test_fx_records_every_layer_kind_as_a_leaf_that_keeps_its_checks():
    model = _every_norm()
    graph = torch.fx.symbolic_trace(model)
    norms = [n.target for n in graph.graph.nodes if n.op == "call_module" and "Norm" in type(model.get_submodule(
        n.target)).__name__]
    assert norms == ["1", "3", "4", "5", "6", "9"]
    x = torch.randn(4, 3, 6, 6)
    torch.testing.assert_close(graph(x), model(x))
    with pytest.raises(ValueError, match="expected 8 channels at dim 1"):
        graph.get_submodule("3")(torch.randn(2, 6, 3, 3))


def test_create_feature_extractor_returns_a_batchnorm_output():
    feature_extraction = pytest.importorskip("torchvision.models.feature_extraction")
    torchvision = pytest.importorskip("torchvision")
    model = accumnorm.convert(torchvision.models.resnet18(num_classes=10)).eval()
    seen = {}
    model.layer1[0].bn1.register_forward_hook(lambda m, i, out: seen.setdefault("bn", out))
    x = torch.randn(2, 3, 32, 32)
    model(x)
    features = feature_extraction.create_feature_extractor(model, {"layer1.0.bn1": "bn", "layer2": "l2"})(x)
    torch.testing.assert_close(features["bn"], seen["bn"])
    assert features["l2"].shape == (2, 128, 4, 4)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_jit_script_compiles_every_layer_and_matches_it_in_train_and_eval():
    model = _every_norm()
    twin = copy.deepcopy(model)
    scripted = torch.jit.script(twin)
    assert type(twin[1]) is BatchNorm2d  # scripting did not swap the layers of the model it was given
    x = torch.randn(4, 3, 6, 6)
    torch.testing.assert_close(scripted(x), model(x))  # training: batch statistics, running stats updated
    torch.testing.assert_close(twin[1].running_mean, model[1].running_mean)
    scripted.eval(), model.eval()
    torch.testing.assert_close(scripted(x), model(x))
    with pytest.raises(RuntimeError, match="uninitialized parameters"):
        torch.jit.script(BatchNorm2d())  # a lazy layer before its first forward has no shape to compile


def test_deepcopy_pickle_and_torch_save_keep_layers_and_laziness():
    model = nn.Sequential(accumnorm.convert(resnet()), BatchNorm2d())  # the last one still lazy
    x = torch.randn(3, 1, 12, 12)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = [copy.deepcopy(model), pickle.loads(pickle.dumps(model)), torch.load(buffer, weights_only=False)]
    out = model[0].eval()(x)
    for twin in copies:
        assert type(twin[0][1]) is BatchNorm2d and twin[1].has_uninitialized_params()
        torch.testing.assert_close(twin[0].eval()(x), out)
        assert twin[1](out[:, :, None, None]).shape == (3, 10, 1, 1) and twin[1].num_features == 10


def test_state_dict_round_trips_through_torch_save_weights_only():
    model = accumnorm.convert(resnet())
    model(torch.randn(4, 1, 12, 12))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    fresh = accumnorm.convert(resnet())
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bias", [True, False])
def test_fuse_conv_bn_eval(bias):
    conv, bn = nn.Conv2d(3, 4, 3), BatchNorm2d(4, bias=bias)
    for _ in range(3):
        bn(conv(torch.randn(5, 3, 6, 6)) * 2 + 1)  # running statistics away from 0 and 1
    conv.eval(), bn.eval()
    fused = torch.nn.utils.fusion.fuse_conv_bn_eval(conv, bn)
    x = torch.randn(2, 3, 6, 6)
    torch.testing.assert_close(fused(x), bn(conv(x)))


def test_functional_call_uses_the_given_tensors_and_updates_the_given_buffers():
    ours, ref = BatchNorm2d(3), nn.BatchNorm2d(3)
    x = torch.randn(4, 3, 5, 5)
    states = [{"weight": torch.full((3,), 2.0), "bias": torch.ones(3), "running_mean": torch.zeros(3),
               "running_var": torch.ones(3), "num_batches_tracked": torch.tensor(0)} for _ in range(2)]
    out = torch.func.functional_call(ours, states[0], (x,))
    torch.testing.assert_close(out, torch.func.functional_call(ref, states[1], (x,)))
    for key in states[0]:
        torch.testing.assert_close(states[0][key], states[1][key])
    assert int(states[0]["num_batches_tracked"]) == 1 and int(ours.num_batches_tracked) == 0


def test_torch_compile_in_train_and_eval_matches_eager():
    """backend="aot_eager": dynamo and AOTAutograd, without inductor's minute of C++ compilation on a CPU."""
    eager = _every_norm()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # fullgraph: no graph break in our code
    x = torch.randn(4, 3, 6, 6)
    out, ref = compiled(x), eager(x)
    torch.testing.assert_close(out, ref)
    out.square().sum().backward(), ref.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    for (name, b), c in zip(model.named_buffers(), eager.buffers()):
        torch.testing.assert_close(b, c, msg=name)
    model.eval(), eager.eval()
    torch.testing.assert_close(compiled(x), eager(x))


def test_torch_export_in_eval():
    model = _every_norm().eval()
    x = torch.randn(4, 3, 6, 6)
    program = torch.export.export(model, (x,))
    torch.testing.assert_close(program.module()(x), model(x))


def test_channels_last_inputs_under_exact_backward():
    ref = resnet(nn.Tanh).double().to(memory_format=torch.channels_last)
    ours = accumnorm.convert(copy.deepcopy(ref))
    assert ours[0].weight.is_contiguous(memory_format=torch.channels_last)
    x, y = data((1, 12, 12), 6, torch.float64)
    x = x.to(memory_format=torch.channels_last)
    assert all(type(m).__module__.startswith("accumnorm") for m in ours.modules() if isinstance(m, _BatchNorm))
    exact_vs_whole_batch(ref, ours, (x, y), 2, 1e-9)
