"""Oracle tests: a plain-accumulation step as one whole-batch forward (ghost batches) equals the K-micro-batch loop."""
import copy
import csv

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from accumnorm.study import StudySettings, run_study
from accumnorm.study import _norm_study as norm_study
from accumnorm.study._fused import fusable, use_ghost_batches
from accumnorm.study._model import SimpleModel, StackedModel, norm_fn

FUSABLE = ["bn", "gn4", "in", "none", "frn", "evonorm-s0", "ln"]


def _model(name, momentum=0.1):
    torch.manual_seed(0)
    channels = (32, 32, 32, 32) if name == "evonorm-s0" else (8, 8, 16, 16)  # EvoNorm-S0: 32 groups
    m = SimpleModel(norm_fn(name), channels=channels).double()
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.momentum = momentum
    return m


def _literal_step(model, opt, x, y, b):
    """Plain accumulation as the study's loop writes it: K micro-batches, each loss divided by K."""
    k = len(x) // b
    for xm, ym in zip(x.split(b), y.split(b)):
        (F.cross_entropy(model(xm), ym) / k).backward()
    opt.step()
    opt.zero_grad()


def _fused_step(model, opt, x, y):
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("name, b, k, momentum", [
    ("bn", 1, 6, 0.1), ("bn", 2, 3, 0.1), ("bn", 3, 2, None), ("bn", 6, 1, 0.1),
    *[(name, 2, 3, 0.1) for name in FUSABLE[1:]],
])
def test_ghost_batch_steps_equal_the_micro_batch_loop(name, b, k, momentum):
    """float64, 3 Adam steps: parameters, running statistics and step counts agree with the literal loop.

    (Adam divides by the gradient's size, so round-off of sums taken in another order, ~1e-16, grows
    to ~1e-11 in the weights after a few steps: tolerances are 1e-7, float32's round-off is 1e-4.)
    """
    ref = _model(name, momentum)
    ours = copy.deepcopy(ref)
    assert fusable(ours)
    use_ghost_batches(ours, b)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ref, ours)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.rand(b * k, 1, 16, 16, dtype=torch.float64, generator=gen)
        y = torch.randint(0, 10, (b * k,), generator=gen)
        _literal_step(ref, opts[0], x, y, b)
        _fused_step(ours, opts[1], x, y)
    state_ref, state_ours = ref.state_dict(), ours.state_dict()
    assert state_ref.keys() == state_ours.keys()
    for key in state_ref:
        torch.testing.assert_close(state_ours[key], state_ref[key], rtol=1e-7, atol=1e-9,
                                   msg=lambda m, key=key: f"{key}: {m}")
    if name == "bn":
        assert int(ours.features[1].num_batches_tracked) == 3 * k
    ref.eval(), ours.eval()
    x = torch.rand(5, 1, 16, 16, dtype=torch.float64, generator=gen)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-7, atol=1e-9)  # eval: torch's forward, running stats


def test_ghost_batches_of_a_stacked_model_equal_the_micro_batch_loop():
    """The runner's case: R runs stacked into one grouped model, BatchNorm in ghost batches of 1."""
    def runs():
        models = []
        for r in range(2):
            torch.manual_seed(r)
            models.append(SimpleModel(nn.BatchNorm2d, channels=(8, 8, 16, 16)))
        return StackedModel(models).double()

    ref, ours = runs(), runs()
    use_ghost_batches(ours, 1)
    gen = torch.Generator().manual_seed(2)
    x, y = torch.rand(4, 2, 1, 16, 16, dtype=torch.float64, generator=gen), torch.randint(0, 10, (4, 2), generator=gen)

    def loss(model, x, y):
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none").view(y.shape).mean(0).sum()

    for xm, ym in zip(x.split(1), y.split(1)):
        (loss(ref, xm, ym) / 4).backward()
    loss(ours, x, y).backward()
    for (n, p), q in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-9, atol=1e-12, msg=lambda m, n=n: f"{n}: {m}")
    for (n, p), q in zip(ref.named_buffers(), ours.buffers()):
        torch.testing.assert_close(q, p, rtol=1e-9, atol=1e-12, msg=lambda m, n=n: f"{n}: {m}")


def test_the_runner_gives_the_same_results_fused_or_looped(tmp_path, monkeypatch):
    """End to end in float32: the runner's fused cells against the same cells forced through accumnorm.backward."""
    settings = StudySettings(dataset="digits", norms=("bn", "gn4"), configs=("2x4",), runs=2, iterations=4,
                             eval_every=2)
    run_study(tmp_path / "fused", settings, progress=False, workers=1)
    monkeypatch.setattr(norm_study, "fusable", lambda model: False)
    run_study(tmp_path / "loop", settings, progress=False, workers=1)
    rows = {}
    for name in ("fused", "loop"):
        with open(tmp_path / name / "results.csv", newline="") as f:
            rows[name] = sorted(csv.DictReader(f), key=lambda r: (r["norm"], r["run"], int(r["iter"])))
    assert len(rows["fused"]) == len(rows["loop"]) == 2 * 2 * 2
    for a, b in zip(rows["fused"], rows["loop"]):
        assert (a["norm"], a["run"], a["iter"]) == (b["norm"], b["run"], b["iter"])
        assert float(a["train_loss"]) == pytest.approx(float(b["train_loss"]), rel=1e-4)
        assert float(a["valid_acc"]) == pytest.approx(float(b["valid_acc"]), abs=1.5 / 360)


def test_a_group_of_one_value_per_channel_fails_as_torch_does():
    model = _model("bn")
    use_ghost_batches(model, 1)
    with pytest.raises(ValueError, match=r"Expected more than 1 value per channel when training, got input size "
                                         r"torch.Size\(\[1, 16, 1, 1\]\)"):
        model(torch.rand(4, 1, 8, 8, dtype=torch.float64))  # 8x8: the last feature map is 1x1
    with pytest.raises(ValueError, match="expected a batch that splits into groups of 3, got 4 samples"):
        use_ghost_batches(model, 3)
        model(torch.rand(4, 1, 16, 16, dtype=torch.float64))


@pytest.mark.parametrize("layer", [
    nn.BatchNorm2d(8), nn.GroupNorm(2, 8), nn.InstanceNorm2d(8), nn.LayerNorm(8),
])
def test_fusable_accepts_per_sample_layers_and_torch_batchnorm(layer):
    assert fusable(nn.Sequential(nn.Conv2d(1, 8, 3), layer, nn.ReLU()))


@pytest.mark.parametrize("name", ["brn", "bn-stale"])
def test_fusable_refuses_layers_with_state_between_micro_batches(name):
    assert not fusable(SimpleModel(norm_fn(name)))


@pytest.mark.parametrize("layer", [nn.InstanceNorm2d(8, track_running_stats=True), nn.SyncBatchNorm(8), nn.Dropout()])
def test_fusable_refuses_other_layers(layer):
    assert not fusable(nn.Sequential(nn.Conv2d(1, 8, 3), layer))
