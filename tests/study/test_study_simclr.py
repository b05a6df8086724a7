"""`accumnorm study --task simclr`: each method takes the gradient it claims, the quick grid writes the study's
files, resumes and refuses what the first study refuses."""
import copy
import csv
import json

import pytest
import torch
import torch.nn.functional as F

from accumnorm._cli import SIMCLR_QUICK, main
from accumnorm.study import SimCLRSettings, run_study
from accumnorm.study import _simclr as simclr_module
from accumnorm.study._data import Dataset
from accumnorm.study._settings import METHODS, WHOLE
from accumnorm.study._simclr import SIMCLR, SimCLRNet, linear_probe, nt_xent, train_step, two_views
from accumnorm.study._simclr_report import finding
from helpers import rel_err


def _rows(out):
    with open(out / "results.csv", newline="") as f:
        return list(csv.DictReader(f))


def _gradient(method, model, views, micro_batch_size):
    model = copy.deepcopy(model)
    loss = train_step(method, model, views, micro_batch_size, temperature=0.5)
    return loss, torch.cat([p.grad.flatten() for p in model.parameters()]), model


def test_each_method_takes_the_gradient_it_claims(one_thread):
    """bn-exact is bn-whole's gradient (and running statistics); plain accumulation and GradCache with per-micro-batch
    BatchNorm are not; GroupNorm with the loss whole is its whole batch's gradient at any split."""
    torch.manual_seed(0)
    views = two_views(torch.rand(16, 1, 16, 16), torch.Generator().manual_seed(1))
    bn_model, gn_model = SimCLRNet("bn"), SimCLRNet("gn")
    whole_loss, whole, whole_model = _gradient(WHOLE, bn_model, views, 16)
    exact_loss, exact, exact_model = _gradient("bn-exact", bn_model, views, 4)
    assert rel_err(exact_loss, whole_loss) < 1e-5 and rel_err(exact, whole) < 1e-4
    for a, b in zip(exact_model.buffers(), whole_model.buffers()):
        assert rel_err(a, b, 1e-3) < 1e-4
    plain_loss, plain, _ = _gradient("bn", bn_model, views, 4)
    assert plain_loss < whole_loss - 0.5  # NT-Xent over 8 views (6 negatives each) is lower than over 32
    assert rel_err(plain, whole) > 0.05
    gradcache_loss, gradcache, _ = _gradient("bn-gradcache", bn_model, views, 4)
    assert rel_err(gradcache, whole) > 0.05 and abs(float(gradcache_loss - whole_loss)) > 1e-3
    assert rel_err(_gradient("gn", gn_model, views, 4)[1], _gradient(WHOLE, gn_model, views, 16)[1]) < 1e-4


def test_nt_xent_is_simclrs_loss():
    """Each view's cross-entropy over the cosine similarities to the other 2N - 1 views, its other view the target."""
    torch.manual_seed(0)
    z1, z2 = torch.randn(3, 5), torch.randn(3, 5)
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    terms = []
    for i in range(6):
        logits = torch.stack([z[i] @ z[j] / 0.5 for j in range(6) if j != i])
        positive = (i + 3) % 6
        terms.append(-(logits[positive - (positive > i)] - logits.logsumexp(0)))
    assert torch.allclose(nt_xent(z1, z2, 0.5), torch.stack(terms).mean(), atol=1e-6)


def test_views_come_from_their_generator_only():
    x = torch.rand(4, 1, 16, 16)
    state = torch.get_rng_state()
    a1, a2 = two_views(x, torch.Generator().manual_seed(3))
    b1, _ = two_views(x, torch.Generator().manual_seed(3))
    assert torch.equal(torch.get_rng_state(), state)  # the global stream is untouched
    assert torch.equal(a1, b1) and a1.shape == x.shape and not torch.allclose(a1, a2, atol=0.05)


def test_linear_probe_scores_features_that_separate_the_classes(one_thread):
    """One-hot class features give a perfect probe; features that carry no label give about chance. The probe
    leaves the encoder's mode and the global random stream as they were."""
    y = torch.arange(200) % 4
    separable = F.one_hot(y, 4).float()[:, :, None, None] + 0.1 * torch.randn(200, 4, 1, 1)
    noise = torch.randn(200, 4, 1, 1)
    encoder = torch.nn.Sequential(torch.nn.BatchNorm2d(4), torch.nn.Flatten())
    state = torch.get_rng_state()
    assert linear_probe(encoder, Dataset(separable[:100], y[:100], separable[100:], y[100:])) == 1.0
    assert linear_probe(encoder, Dataset(noise[:100], y[:100], noise[100:], y[100:])) < 0.5
    assert encoder.training and torch.equal(torch.get_rng_state(), state)


def test_bn_whole_trains_once_per_effective_batch_size():
    settings = SimCLRSettings(configs=("8x8", "4x16", "16x2"), methods=(WHOLE, "bn"))
    assert SIMCLR.cells(settings) == [(WHOLE, 64, 1), (WHOLE, 32, 1), ("bn", 8, 8), ("bn", 4, 16), ("bn", 16, 2)]


def test_the_sentence_compares_every_method_with_the_whole_batch():
    settings = SimCLRSettings(configs=("4x4",), runs=2, iterations=10, eval_every=5)
    rows = [dict(norm=name, batch_size=b, num_accum=k, run=r, iter=it, valid_acc=acc)
            for name, b, k, accs in ((WHOLE, 16, 1, (0.90, 0.92)), ("bn-exact", 4, 4, (0.90, 0.93)),
                                     ("bn", 4, 4, (0.80, 0.82)))
            for r, acc in enumerate(accs) for it in (5, 10)]
    assert finding(settings, rows) == (
        "At bs4 x 4, against 0.910 for the whole batch in one go (bn-whole): bn 0.810 (-0.100, more than twice the "
        "spread over runs (0.028)); bn-exact 0.915 (+0.005, not more than twice the spread over runs (0.042)). Run by "
        "run (same seed, weights and views), bn-exact and bn-whole differ by at most 0.010.")


def test_quick_from_the_command_line_writes_the_files_and_resumes(tmp_path, monkeypatch):
    """--task simclr --quick: every method at 4x4 on the offline digits; a rerun trains nothing; another setting in
    the same --out is refused, and so is the first study's task."""
    out = tmp_path / "out"
    args = ["study", "--task", "simclr", "--quick", "--out", str(out), "--no-progress", "--threads", "2"]
    assert main(args) == 0
    assert {p.name for p in out.iterdir()} == {"results.csv", "summary.md", "curves.png", "report.html",
                                               "settings.json"}
    saved = json.loads((out / "settings.json").read_text())
    assert saved["task"] == "simclr" and saved["methods"] == list(METHODS) and saved["configs"] == ["4x4"]
    rows = _rows(out)
    evaluations = SIMCLR_QUICK["iterations"] // SIMCLR_QUICK["eval_every"]
    assert len(rows) == len(METHODS) * SIMCLR_QUICK["runs"] * evaluations
    assert {(r["norm"], r["batch_size"], r["num_accum"]) for r in rows} == {
        (WHOLE, "16", "1"), *((name, "4", "4") for name in METHODS if name != WHOLE)}
    assert all(0 <= float(r["valid_acc"]) <= 1 for r in rows)
    last = {(r["norm"], r["run"]): float(r["valid_acc"]) for r in rows if int(r["iter"]) == SIMCLR_QUICK["iterations"]}
    for run in ("0", "1"):  # the same gradients from the same weights and views: at most a digit or two apart
        assert abs(last[("bn-exact", run)] - last[(WHOLE, run)]) <= 2 / 360
    summary = (out / "summary.md").read_text()
    assert "| method | bs4 x 4 |" in summary and all(f"| {name} | 0." in summary for name in METHODS)
    before = (out / "results.csv").read_bytes()

    def no_training(*args):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(simclr_module, "train", no_training)
    assert main([*args, "--workers", "1"]) == 0
    assert (out / "results.csv").read_bytes() == before


@pytest.mark.parametrize("flags, messages", [
    (["--task", "simclr", "--methods", "gn", "--temperature", "0.2"],
     ["different settings (temperature: 0.5 there, 0.2 now)"]),
    (["--norms", "gn4"], ["different settings (configs: ['4x4'] there, ['16x1', '1x16'] now", "task: 'simclr' there"]),
])
def test_an_out_holding_other_settings_is_refused_and_left_alone(tmp_path, capsys, flags, messages):
    out = tmp_path / "out"
    tiny = ["--runs", "1", "--iterations", "1", "--eval-every", "1", "--out", str(out), "--no-progress",
            "--workers", "1"]
    assert main(["study", "--task", "simclr", "--quick", "--methods", "gn", *tiny]) == 0
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(["study", "--quick", *flags, *tiny]) == 2
    err = capsys.readouterr().err
    assert all(message in err for message in messages) and err.count("\n") == 1, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize("flags, message", [
    (["--task", "moco"], "unknown task 'moco'; expected one of bn, simclr"),
    (["--task", "simclr", "--norms", "bn"], "--norms is an option of --task bn, not of --task simclr"),
    (["--methods", "bn"], "--methods is an option of --task simclr, not of --task bn"),
    (["--temperature", "0.1"], "--temperature is an option of --task simclr, not of --task bn"),
    (["--task", "simclr", "--average-after", "5"], "--average-after is an option of --task bn, not of --task simclr"),
    (["--task", "simclr", "--methods", "bn,byol"], "unknown method 'byol'; expected one of bn-whole, bn, bn-gradcache"),
    (["--task", "simclr", "--temperature", "0"], "temperature must be a finite number > 0, got 0.0"),
    (["--task", "simclr", "--temperature", "nan"], "temperature must be a finite number > 0, got nan"),
    (["--task", "simclr", "--configs", "4x4,4-4"], "expected BxK like 4x4, got '4-4'"),
    (["--task", "simclr", "--runs", "0"], "runs must be a positive int, got 0"),
    (["--task", "simclr", "--eval-every", "50", "--iterations", "20"], "eval_every (50) is more than iterations (20)"),
])
def test_bad_flags_are_one_line_errors_before_anything_is_written(tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    assert main(["study", "--quick", *flags, "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("accumnorm study: error: ") and message in err and err.count("\n") == 1, err
    assert not out.exists()


@pytest.mark.slow
def test_bn_exact_trains_as_bn_whole_and_plain_accumulation_does_not(tmp_path, one_thread):
    """Six steps on the offline digits: bn-exact's losses are bn-whole's to float rounding; bn's are another
    quantity (NT-Xent over a micro-batch) and GradCache's, BatchNorm per micro-batch, another trajectory."""
    settings = SimCLRSettings(dataset="digits16", methods=(WHOLE, "bn-exact", "bn-gradcache", "bn"), configs=("4x4",),
                              runs=1, iterations=6, eval_every=3)
    run_study(tmp_path, settings, progress=False, workers=1)
    loss = {(r["norm"], r["iter"]): float(r["train_loss"]) for r in _rows(tmp_path)}
    for it in ("3", "6"):
        assert loss[("bn-exact", it)] == pytest.approx(loss[(WHOLE, it)], rel=1e-4)
        assert loss[("bn", it)] < loss[(WHOLE, it)] - 0.5
    assert loss[("bn-gradcache", "6")] != pytest.approx(loss[(WHOLE, "6")], rel=1e-3)
