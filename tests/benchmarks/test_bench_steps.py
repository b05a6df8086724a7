"""benchmarks/_steps.py's floors, which bench_backward.py times beside the schedules: the lockstep floor beside
layerwise (its interleaved forwards and whole-batch BatchNorm, nothing else), the checkpointed floor beside
recompute (plain accumulation with the regions recompute would choose each in torch's checkpoint), and beside
segments the same with all of segments' regions."""
import copy
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close
from torch.utils.checkpoint import checkpoint

from accumnorm._engine.schedules.segments import Segments

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import _methods  # noqa: E402
import _steps  # noqa: E402
from _models import MODELS  # noqa: E402


def _saved_bytes(step, model, batch) -> int:
    """The bytes autograd saves in the step at the outermost level (a checkpointed region saves its inputs there)."""
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(model, batch, 4, MODELS["study"])
    return saved[0]


def test_the_checkpointed_floor_is_plain_accumulation_with_its_regions_recomputed():
    model, batch = _steps.prepare("study", 16, 8, torch.device("cpu"))
    plain, checkpointed = copy.deepcopy(model), copy.deepcopy(model)
    plain_saved = _saved_bytes(_steps.plain_step, plain, batch)
    checkpointed_saved = _saved_bytes(_steps.checkpointed_step, checkpointed, batch)
    for a, b in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        assert_close(b.grad, a.grad)
    assert checkpointed_saved < plain_saved / 2  # the regions kept their inputs, not what they compute


@pytest.mark.parametrize("name", ["study", "tiny_deep"])
def test_the_segments_floor_is_plain_accumulation_with_every_region_segments_uses_recomputed(name):
    model, batch = _steps.prepare(name, 16, 8, torch.device("cpu"))
    plain, floor = copy.deepcopy(model), copy.deepcopy(model)
    plain_saved = _saved_bytes(_steps.plain_step, plain, batch)
    floor_saved = _saved_bytes(_steps.segments_floor(keep_every=1), floor, batch)
    for a, b in zip(plain.parameters(), floor.parameters(), strict=True):
        assert_close(b.grad, a.grad)
    assert floor_saved < plain_saved / 2
    assert all("forward" not in vars(m) for m in floor.modules())  # the regions' own forwards are back


@pytest.mark.parametrize("keep_every", [None, 2, 4])  # None: the schedule's default
def test_the_segments_floor_is_none_above_keep_every_1_and_the_step_changes_nothing(keep_every):
    model, batch = _steps.prepare("study", 16, 8, torch.device("cpu"))
    step = _steps.segments_floor() if keep_every is None else _steps.segments_floor(keep_every=keep_every)
    setting = Segments().keep_every if keep_every is None else keep_every
    with pytest.raises(_steps.NoFloor, match=f"keep_every={setting} recomputes a region's arguments"):
        step(model, batch, 4, MODELS["study"])
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("name", ["study", "simclr", "tiny_deep"])  # per micro-batch; whole batch; host-bound
def test_the_lockstep_floor_makes_the_whole_batch_gradient_and_running_statistics(name):
    # float64: in float32, 48 layers of rounding differ between the CPU's kernels by more than any fixed tolerance
    model, batch = _steps.prepare(name, 16, 8, torch.device("cpu"))
    model = model.double()
    batch = tuple(t.double() if t.is_floating_point() else t for t in batch) if isinstance(batch, tuple) else \
        batch.double()
    whole, floor = copy.deepcopy(model), copy.deepcopy(model)
    _steps.whole_step(whole, batch, 4, MODELS[name])
    _steps.lockstep_step(floor, batch, 4, MODELS[name])
    for a, b in zip(whole.parameters(), floor.parameters(), strict=True):
        assert_close(b.grad, a.grad, rtol=1e-9, atol=1e-12)
    for a, b in zip(whole.buffers(), floor.buffers(), strict=True):
        assert_close(b, a)
    assert all("forward" not in vars(m) for m in floor.modules())  # the layers' own forwards are back


def test_the_lockstep_floor_refuses_a_model_whose_batch_norms_it_cannot_meet():
    class Norm(torch.nn.BatchNorm1d):  # a subclass: its forward is anyone's
        pass

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), Norm(3))
    case = _steps.Case(lambda: model, None, lambda m, x: m(x).square().mean())
    with pytest.raises(_steps.NoFloor, match="BatchNorm1d/2d/3d layers in training mode only"):
        _steps.lockstep_step(model, torch.randn(8, 3), 4, case)


def test_the_lockstep_floor_refuses_batch_norm_in_a_checkpointed_region_and_leaves_no_hooks_behind():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = torch.nn.BatchNorm1d(3), torch.nn.BatchNorm1d(3)

        def forward(self, x):
            return checkpoint(self.second, self.first(x), use_reentrant=False)

    model = Net()
    case = _steps.Case(lambda: model, None, lambda m, x: m(x).square().mean())
    with pytest.raises(_steps.NoFloor, match="inside a checkpointed region"):
        _steps.lockstep_step(model, torch.randn(8, 3), 4, case)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert all("forward" not in vars(m) for m in model.modules())


def test_the_table_times_each_floor_beside_its_schedule():
    assert _methods.timed_methods(["layerwise", "recompute", "passes"]) == [
        "plain", "layerwise", "lockstep", "recompute", "checkpointed", "passes"]
    assert _methods.timed_methods(["recompute", "passes"]) == ["plain", "recompute", "checkpointed", "passes"]
    assert _methods.timed_methods(["segments:keep_every=1", "segments"]) == [
        "plain", "segments:keep_every=1", "checkpointed_all:keep_every=1", "segments", "checkpointed_all"]


class ConvNet(torch.nn.Module):
    """Two conv-BatchNorm blocks in a forward of its own: dynamo compiles it whole (an nn.Sequential that breaks its
    graph inside its loop would run uncompiled)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4)
        self.conv2, self.bn2 = torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        return self.fc(torch.relu(self.bn2(self.conv2(x))).mean((2, 3)))


def test_the_compiled_floor_breaks_its_graph_where_exact_mode_does_and_makes_plain_accumulations_gradient():
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    base = ConvNet()
    case = _steps.Case(ConvNet, None, lambda m, batch: torch.nn.functional.cross_entropy(m(batch[0]), batch[1]))
    batch = (torch.randn(8, 3, 6, 6), torch.randint(0, 3, (8,)))
    eager = copy.deepcopy(base)
    _steps.plain_step(eager, batch, 4, case)
    graphs = {}
    for method in _steps.compiled_methods(["layerwise"]):
        counter = CompileCounter()
        with _steps.compiling_apart(3):
            model = _steps.compiled_model(method, copy.deepcopy(base), counter)
            _methods.methods(["layerwise"])[method](model, batch, 4, case)
        graphs[method] = counter.frame_count
        if method == _steps.COMPILED_FLOOR:
            for a, b in zip(eager.parameters(), model.parameters(), strict=True):
                assert_close(b.grad, a.grad)
    assert graphs == {"compiled plain": 1, "compiled floor": 3, "compiled layerwise": 3}  # broken at bn1 and bn2


def test_a_ratio_is_the_median_over_rounds_of_each_rounds_ratio():
    from _table import Times

    times = Times({"plain": [1.0, 2.0, 4.0], "a": [2.0, 2.0, None], "b": "failed"}, {"a": 30.0})
    assert times.ratio("a") == 1.5 and times.median("a") == 2.0  # rounds 1 and 2: 2x and 1x
    assert times.ratio("b") == "failed" and times.ratio("plain", "b") == "-"
