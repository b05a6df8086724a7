"""The study runner end to end on tiny grids of the offline digits: files, failures, resume, refusals."""
import csv
import json
import urllib.error
from pathlib import Path

import pytest
import torch

from accumnorm.study import StudySettings, parse_config, run_study
from accumnorm.study import _norm_study as norm_study
from accumnorm.study._report import finding, summary_cells
from accumnorm.study._tasks import data_order

TINY = dict(dataset="digits", iterations=4, eval_every=2, runs=2)
FILES = ("results.csv", "summary.md", "curves.png", "report.html", "settings.json")


def _rows(out):
    with open(out / "results.csv", newline="") as f:
        return list(csv.DictReader(f))


def _key(row):
    return row["norm"], row["batch_size"], row["num_accum"], row["run"], row["iter"]


def _snapshot(out):
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def test_parse_config():
    assert parse_config("4x4") == (4, 4)
    assert parse_config(" 1x16 ") == (1, 16)
    for bad in ("4-4", "4x", "x4", "0x4", "4x0", "4x4x4", ""):
        with pytest.raises(ValueError, match=f"expected BxK like 4x4, got '{bad}'"):
            parse_config(bad)


def test_grid_writes_every_file_and_reports_the_cell_that_cannot_run(tmp_path):
    # On 8x8 digits the last feature map is 1x1: torch's BatchNorm at micro-batch 1 raises there.
    settings = StudySettings(norms=("bn", "none", "ln"), configs=("1x4", "4x1"), **TINY)
    run_study(tmp_path, settings, device="cpu", progress=False)
    assert all((tmp_path / f).exists() for f in FILES)
    rows = _rows(tmp_path)
    assert list(rows[0]) == ["norm", "batch_size", "num_accum", "run", "iter", "train_loss", "valid_acc", "seconds"]
    cells = {(r["norm"], r["batch_size"], r["num_accum"]) for r in rows}
    assert cells == {("bn", "4", "1"), ("none", "1", "4"), ("none", "4", "1"), ("ln", "1", "4"), ("ln", "4", "1")}
    assert len(rows) == len(cells) * 2 * 2  # runs x evaluations (steps 2 and 4)
    assert all(0.0 <= float(r["valid_acc"]) <= 1.0 and float(r["train_loss"]) > 0 for r in rows)
    summary = (tmp_path / "summary.md").read_text()
    bn_line = next(line for line in summary.splitlines() if line.startswith("| bn |"))
    assert "failed: Expected more than 1 value per channel" in bn_line
    assert "| norm | bs1 x 4 | bs4 x 1 |" in summary
    page = (tmp_path / "report.html").read_text()
    assert "data:image/png;base64,iVBOR" in page and "Expected more than 1 value per channel" in page
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "settings.json").read_text()) == settings.to_json()


def test_stacked_runs_match_runs_trained_alone(tmp_path):
    """Run 1 of a 2-run study (seed 0, trained stacked with run 0) is run 0 of a 1-run study with seed 1."""
    for name in ("bn", "gn4"):
        two = StudySettings(norms=(name,), configs=("4x2",), seed=0, **TINY)
        run_study(tmp_path / f"{name}-two", two, progress=False)
        alone = StudySettings(norms=(name,), configs=("4x2",), seed=1, **{**TINY, "runs": 1})
        run_study(tmp_path / f"{name}-one", alone, progress=False)
        stacked = [r for r in _rows(tmp_path / f"{name}-two") if r["run"] == "1"]
        single = _rows(tmp_path / f"{name}-one")
        assert [r["iter"] for r in stacked] == [r["iter"] for r in single] == ["2", "4"]
        for a, b in zip(stacked, single):
            assert float(a["train_loss"]) == pytest.approx(float(b["train_loss"]), rel=1e-4)
            assert float(a["valid_acc"]) == pytest.approx(float(b["valid_acc"]), abs=1.5 / 360)  # one image may flip


def test_without_norm_the_accumulation_split_does_not_matter(tmp_path):
    """No layer couples samples: 1x4, 2x2 and 4x1 compute the same gradients, so the same training."""
    run_study(tmp_path, StudySettings(norms=("none",), configs=("1x4", "2x2", "4x1"), **TINY), progress=False)
    by_config = {}
    for r in _rows(tmp_path):
        by_config.setdefault((r["batch_size"], r["num_accum"]), []).append(float(r["train_loss"]))
    ref = by_config[("4", "1")]
    assert by_config[("1", "4")] == pytest.approx(ref, rel=1e-4)
    assert by_config[("2", "2")] == pytest.approx(ref, rel=1e-4)


def test_resume_after_a_crash_skips_finished_runs_and_gives_the_same_results(tmp_path, monkeypatch):
    settings = StudySettings(norms=("ln", "none"), configs=("2x2",), **TINY)  # ln: one run at a time
    run_study(tmp_path / "straight", settings, progress=False)

    class Killed(BaseException):  # like a kill -9 in the middle of a run: nothing catches it
        pass

    calls, train = [], norm_study._train

    def crash_on_second(name, b, k, runs, *args):
        calls.append((name, tuple(runs)))
        if calls == [("ln", (0,)), ("ln", (1,))]:  # the first attempt at ln run 1
            raise Killed
        return train(name, b, k, runs, *args)

    monkeypatch.setattr(norm_study, "_train", crash_on_second)  # reaches this process only: workers=1
    with pytest.raises(Killed):
        run_study(tmp_path / "resumed", settings, progress=False, workers=1)
    assert {r["run"] for r in _rows(tmp_path / "resumed")} == {"0"}  # run 0 was kept whole, nothing of run 1
    assert not (tmp_path / "resumed" / "summary.md").exists()
    calls.clear()
    run_study(tmp_path / "resumed", settings, progress=False, workers=1)
    assert calls == [("ln", (1,)), ("none", (0, 1))]  # finished run 0 of ln was not trained again
    got, want = sorted(_rows(tmp_path / "resumed"), key=_key), sorted(_rows(tmp_path / "straight"), key=_key)
    assert [_key(r) for r in got] == [_key(r) for r in want]
    for a, b in zip(got, want):
        assert float(a["train_loss"]) == pytest.approx(float(b["train_loss"]), rel=1e-5)
        assert float(a["valid_acc"]) == pytest.approx(float(b["valid_acc"]), abs=1.5 / 360)


def test_cells_in_worker_processes_give_the_same_results_and_failures(tmp_path):
    """Each run's seed fixes its computation: 2 worker processes of 1 thread give what 1 process of 1 thread gives.

    (The thread count, not the process, changes the rounding: bn's losses move by ~1e-4 after 4 steps.)
    """
    settings = StudySettings(norms=("bn", "gn4"), configs=("1x2", "2x2"), **TINY)  # bn at 1x2 cannot run on digits
    threads = torch.get_num_threads()
    try:
        for workers in (1, 2):
            torch.set_num_threads(workers)  # a budget of 1 thread per worker
            run_study(tmp_path / f"w{workers}", settings, device="cpu", progress=False, workers=workers)
    finally:
        torch.set_num_threads(threads)
    got, want = sorted(_rows(tmp_path / "w2"), key=_key), sorted(_rows(tmp_path / "w1"), key=_key)
    assert [_key(r) for r in got] == [_key(r) for r in want] and len(got) == 3 * 2 * 2  # cells x runs x evaluations
    for a, b in zip(got, want):
        assert float(a["valid_acc"]) == float(b["valid_acc"])
        assert float(a["train_loss"]) == pytest.approx(float(b["train_loss"]), rel=1e-6)
    for workers in (1, 2):
        summary = (tmp_path / f"w{workers}" / "summary.md").read_text()
        bn_line = next(line for line in summary.splitlines() if line.startswith("| bn |"))
        assert "| failed: Expected more than 1 value per channel" in bn_line
    assert "<th>workers</th><td>2</td>" in (tmp_path / "w2" / "report.html").read_text()
    with pytest.raises(ValueError, match="workers must be a positive int, got 0"):
        run_study(tmp_path / "w0", settings, progress=False, workers=0)
    assert not (tmp_path / "w0").exists()


def test_refuses_an_out_with_other_settings_and_leaves_it_untouched(tmp_path):
    run_study(tmp_path, StudySettings(norms=("none",), configs=("2x2",), **TINY), progress=False)
    before = _snapshot(tmp_path)
    other = StudySettings(norms=("none",), configs=("2x2",), **{**TINY, "runs": 3, "lr": 0.01})
    with pytest.raises(ValueError, match=r"different settings \(lr: 0.001 there, 0.01 now; runs: 2 there, 3 now\)"):
        run_study(tmp_path, other, progress=False)
    assert _snapshot(tmp_path) == before


def test_missing_dataset_without_network_is_a_clear_error(tmp_path, monkeypatch):
    from torchvision import datasets

    def offline(self):  # as torchvision's: the folders first, then the network, which fails
        Path(self.raw_folder).mkdir(parents=True, exist_ok=True)
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(datasets.MNIST, "download", offline)
    out = tmp_path / "out"
    settings = StudySettings(dataset="mnist", data_dir=str(tmp_path / "empty"), norms=("none",), configs=("1x1",))
    with pytest.raises(FileNotFoundError, match=r"dataset 'mnist' is not under .*empty and downloading it failed"):
        run_study(out, settings, progress=False)
    assert not out.exists() and not (tmp_path / "empty").exists()  # no empty folders left behind
    (tmp_path / "data" / "MNIST").mkdir(parents=True)  # the dataset's own folder given, one level too deep
    deep = StudySettings(dataset="mnist", data_dir=str(tmp_path / "data" / "MNIST"), norms=("none",), configs=("1x1",))
    with pytest.raises(FileNotFoundError, match=r"looks like the MNIST folder itself: give the folder above it"):
        run_study(out, deep, progress=False)
    assert sorted(p.name for p in (tmp_path / "data" / "MNIST").iterdir()) == []


@pytest.mark.parametrize("kwargs, message", [
    (dict(norms=("bn", "gn4", "bn")), "norms lists 'bn' more than once"),
    (dict(configs=("16x1", " 16x1")), "configs lists '16x1' more than once"),
    (dict(runs=0), "runs must be a positive int, got 0"),
    (dict(eval_every=2.5), "eval_every must be a positive int, got 2.5"),
    (dict(configs=("4-4",)), "expected BxK like 4x4, got '4-4'"),
    (dict(norms=("bn", "batchnorm")), "unknown norm 'batchnorm'"),
    (dict(norms=("gn3",)), r"norm 'gn3' does not fit the study's network: num_channels \(32\) must be divisible"),
    (dict(lr=0.0), "lr must be a finite number > 0, got 0.0"),
    (dict(lr=float("inf")), "lr must be a finite number > 0, got inf"),
    (dict(eval_every=5000), r"eval_every \(5000\) is more than iterations \(3600\): no run would ever be evaluated"),
    (dict(seed=-1), r"seed must be an int from 0 to 2\*\*64 - runs"),
])
def test_bad_settings_fail_before_anything_is_written(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        run_study(tmp_path / "out", StudySettings(**kwargs), progress=False)
    assert not (tmp_path / "out").exists()


def test_unknown_dataset(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset 'imagenet'; expected one of digits, digits16, mnist"):
        run_study(tmp_path / "out", StudySettings(dataset="imagenet"), progress=False)
    assert not (tmp_path / "out").exists()


def test_data_order_is_a_stream_of_permutations_per_seed():
    order = data_order(10, steps=7, per_step=4, seeds=[0, 1])  # 28 samples: 2 epochs and 8 more
    assert order.shape == (2, 7, 4)
    for run in order.flatten(1):
        assert sorted(run[:10].tolist()) == list(range(10)) and sorted(run[10:20].tolist()) == list(range(10))
    assert not torch.equal(order[0], order[1])  # each run has its own order
    assert torch.equal(order[1], data_order(10, steps=7, per_step=4, seeds=[1])[0])  # from its own seed only


def test_summary_is_the_mean_after_step_250_with_the_spread_over_runs():
    settings = StudySettings(norms=("bn", "gn4"), configs=("1x16", "16x1"), runs=2)
    row = lambda norm, b, k, run, it, acc: dict(norm=norm, batch_size=b, num_accum=k, run=run, iter=it, valid_acc=acc)  # noqa: E731
    rows = [row("bn", 16, 1, 0, 250, 0.0), row("bn", 16, 1, 0, 300, 0.90), row("bn", 16, 1, 0, 600, 0.94),
            row("bn", 16, 1, 1, 300, 0.96), row("bn", 16, 1, 1, 600, 0.96), row("gn4", 1, 16, 0, 300, 0.5)]
    table = summary_cells(settings, rows, {("bn", 1, 16): "Expected more than 1 value"})
    assert table[0] == ["norm", "bs1 x 16", "bs16 x 1"]
    # run means 0.92 and 0.96 (step 250 is not after 250): mean 0.94, sample std 0.028
    assert table[1] == ["bn", "failed: Expected more than 1 value", "0.940 ± 0.028"]
    assert table[2] == ["gn4", "0.500 ± 0.000 (1/2 runs)", "n/a (no evaluation after step 250)"]


def test_summary_says_in_one_sentence_what_bn_loses_and_bn_exact_recovers():
    settings = StudySettings(norms=("bn", "bn-exact"), configs=("16x1", "1x16"), runs=2)
    row = lambda norm, b, k, run, acc: dict(norm=norm, batch_size=b, num_accum=k, run=run, iter=300, valid_acc=acc)  # noqa: E731
    rows = [row("bn", 16, 1, 0, 0.95), row("bn", 16, 1, 1, 0.97), row("bn", 1, 16, 0, 0.50), row("bn", 1, 16, 1, 0.60),
            row("bn-exact", 1, 16, 0, 0.96), row("bn-exact", 1, 16, 1, 0.96)]
    # spreads: bn 16x1 0.0141, bn 1x16 0.0707, bn-exact 1x16 0.0
    assert finding(settings, rows) == (
        "torch's BatchNorm (bn) at bs1 x 16 reaches 0.550 validation accuracy against 0.960 for the same batch in one "
        "go (bs16 x 1), -0.410, more than twice the spread over runs (0.141); accumnorm's exact BatchNorm (bn-exact) "
        "at bs1 x 16 reaches 0.960, +0.410, more than twice the spread over runs (0.141), and +0.000 from the batch "
        "in one go.")
    rows[3] = row("bn", 1, 16, 1, 0.94)  # bn 1x16 at 0.72 +- 0.31: within the noise
    assert "not more than twice the spread over runs (0.622)" in finding(settings, rows)
    assert finding(StudySettings(norms=("bn",), configs=("1x16",)), rows) is None  # no batch in one go to compare
    one_run = [r for r in rows if r["run"] == 0]  # one run: no spread to weigh a difference against
    assert finding(StudySettings(norms=("bn", "bn-exact"), configs=("16x1", "1x16"), runs=1), one_run) == (
        "torch's BatchNorm (bn) at bs1 x 16 reaches 0.500 validation accuracy against 0.950 for the same batch in one "
        "go (bs16 x 1), -0.450 (one run: no spread over runs to weigh it against); accumnorm's exact BatchNorm "
        "(bn-exact) at bs1 x 16 reaches 0.960, +0.460 (one run: no spread over runs to weigh it against), and +0.010 "
        "from the batch in one go.")


def test_configs_whose_micro_batch_exceeds_the_training_set_are_refused_before_anything_runs(tmp_path):
    settings = StudySettings(dataset="digits", norms=("none",), configs=("2x2", "2000x1"), runs=1, iterations=1,
                             eval_every=1)
    with pytest.raises(ValueError, match=r"configs 2000x1 have micro-batches larger than the 1437 training samples "
                                         r"of digits: expected B <= 1437"):
        run_study(tmp_path / "out", settings, progress=False)
    assert not (tmp_path / "out").exists()


def test_unknown_norm_lists_the_alternatives_too(tmp_path):
    with pytest.raises(ValueError, match=r"unknown norm 'renorm'.*brn, bn-stale, frn, evonorm-s0"):
        StudySettings(norms=("renorm",))
