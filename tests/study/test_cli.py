"""`accumnorm study` on the command line: options reach the runner, bad input is a clear error."""
import csv
import json
import re
import statistics
from pathlib import Path

import pytest
from torch import nn

import accumnorm.study
from accumnorm._cli import QUICK, main
from accumnorm.study import StudySettings
from accumnorm.study._data import load_dataset
from accumnorm.study._model import SimpleModel


def test_bad_config_string_is_a_clear_error_and_writes_nothing(tmp_path, capsys):
    assert main(["study", "--quick", "--configs", "1x16,4-4", "--out", str(tmp_path / "out")]) == 2
    assert "expected BxK like 4x4, got '4-4'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_quick_grid_is_the_default_and_options_override_it(monkeypatch, tmp_path):
    seen = {}
    (tmp_path / "summary.md").write_text("the table")
    monkeypatch.setattr(accumnorm.study, "run_study",
                        lambda out, settings, **kw: seen.update(out=out, settings=settings, **kw) or tmp_path)
    assert main(["study", "--quick", "--runs", "1", "--norms", "bn, gn16"]) == 0
    s = seen["settings"]
    assert (s.dataset, s.configs, s.iterations, s.eval_every) == ("digits16", ("16x1", "1x16"), 260, 65)
    assert (s.runs, s.norms, seen["out"], seen["progress"], seen["workers"]) == (1, ("bn", "gn16"), "study-out/quick",
                                                                                  True, None)
    assert main(["study", "--dataset", "fashion-mnist", "--no-progress", "--workers", "1"]) == 0
    s = seen["settings"]
    assert (s.dataset, s.iterations, s.eval_every, s.runs, "bn-exact" in s.norms) == ("fashion-mnist", 3600, 300, 3,
                                                                                       True)
    assert (seen["out"], seen["progress"], seen["workers"]) == ("study-out/fashion-mnist", False, 1)


def test_quick_grid_can_show_the_finding():
    """--quick's settings: bn and bn-exact at micro-batch 1 x 16 and at 16 x 1, 3 runs, evaluations in the window,
    on digits whose last feature map stays larger than 1x1 (torch's BatchNorm cannot run on 1x1 at micro-batch 1)."""
    settings = StudySettings(**{k: v for k, v in QUICK.items() if k not in ("norms", "configs")},
                             norms=tuple(QUICK["norms"].split(",")), configs=tuple(QUICK["configs"].split(",")))
    assert {"bn", "bn-exact"} <= set(settings.norms) and {"1x16", "16x1"} <= set(settings.configs)
    assert settings.runs >= 3 and settings.dataset == "digits16"
    evaluations = range(settings.eval_every, settings.iterations + 1, settings.eval_every)
    assert sum(step > settings.window() for step in evaluations) >= 2
    data = load_dataset(settings.dataset)
    last_map = SimpleModel(nn.BatchNorm2d).features(data.train_x[:2])
    assert last_map.shape[2:] == (2, 2)


def test_a_tiny_study_from_the_command_line(tmp_path):
    out = tmp_path / "out"
    args = ["study", "--quick", "--norms", "none", "--configs", "2x2", "--runs", "1", "--iterations", "2",
            "--eval-every", "1", "--lr", "0.01", "--seed", "3", "--device", "cpu", "--threads", "1",
            "--out", str(out), "--no-progress"]
    assert main(args) == 0
    files = {"results.csv", "summary.md", "curves.png", "report.html", "settings.json"}
    assert {p.name for p in out.iterdir()} == files
    assert json.loads((out / "settings.json").read_text()) == dict(
        dataset="digits16", data_dir=None, norms=["none"], configs=["2x2"], runs=1, iterations=2, eval_every=1,
        lr=0.01, seed=3)
    assert len((out / "results.csv").read_text().splitlines()) == 1 + 2  # header, steps 1 and 2
    assert main(args) == 0  # rerun: everything done, nothing appended
    assert len((out / "results.csv").read_text().splitlines()) == 1 + 2


@pytest.mark.parametrize("started", [True, False])
def test_ctrl_c_says_in_one_line_that_the_same_command_goes_on(monkeypatch, tmp_path, capsys, started):
    """Once the study has its directory, the same command goes on from it; before (a Ctrl-C while torch imports),
    there is nothing to go on from, and the line said the runs were kept in a directory that did not exist."""
    def interrupted(out, *args, **kwargs):
        if started:
            Path(out).mkdir()
        raise KeyboardInterrupt

    monkeypatch.setattr(accumnorm.study, "run_study", interrupted)
    assert main(["study", "--quick", "--out", str(tmp_path / "q")]) == 130
    err = capsys.readouterr().err
    assert err.strip() == ((f"accumnorm study: interrupted; the finished runs are kept in {tmp_path / 'q'}: run the "
                            "same command again to go on from them") if started else
                           "accumnorm study: interrupted; nothing was written")


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["study", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for option in ("--dataset", "--data-dir", "--norms", "--configs", "--runs", "--iterations", "--eval-every",
                   "--lr", "--seed", "--device", "--out", "--quick"):
        assert option in text


TINY_RUN = ["--quick", "--norms", "none", "--configs", "2x1", "--runs", "1", "--iterations", "1", "--eval-every", "1",
            "--device", "cpu", "--workers", "1", "--no-progress"]


@pytest.mark.parametrize("flags, message", [
    (["--eval-every", "50", "--iterations", "20"], "eval_every (50) is more than iterations (20)"),
    (["--lr", "inf"], "lr must be a finite number > 0, got inf"),
    (["--lr", "nan"], "lr must be a finite number > 0, got nan"),
    (["--lr", "-0.1"], "lr must be a finite number > 0, got -0.1"),
    (["--threads", "-1"], "threads must be a positive int, got -1"),
    (["--threads", "0"], "threads must be a positive int, got 0"),
    (["--workers", "0"], "workers must be a positive int, got 0"),
    (["--runs", "0"], "runs must be a positive int, got 0"),
    (["--iterations", "-3"], "iterations must be a positive int, got -3"),
    (["--eval-every", "0"], "eval_every must be a positive int, got 0"),
    (["--seed", "-1"], "seed must be an int from 0 to 2**64 - runs"),
    (["--device", "meta"], "device must hold data to train on, like 'cpu' or 'cuda', got 'meta'"),  # every cell failed
])
def test_bad_numeric_flags_are_one_line_errors_before_anything_runs(tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    assert main(["study", *TINY_RUN, *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("accumnorm study: error: ") and message in err and err.count("\n") == 1, err
    assert not out.exists()


def test_an_out_that_is_a_file_is_refused_and_left_alone(tmp_path, capsys):
    out = tmp_path / "notes.txt"
    out.write_text("mine")
    assert main(["study", *TINY_RUN, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out} is a file, not a directory" in err and err.count("\n") == 1, err
    assert out.read_text() == "mine"
    assert main(["study", *TINY_RUN, "--out", str(out / "sub")]) == 2  # under the file: one line, no traceback
    err = capsys.readouterr().err
    assert err.startswith("accumnorm study: error:") and err.count("\n") == 1, err
    assert out.read_text() == "mine"


def test_the_study_prints_its_table_and_finding_then_where_the_files_are(tmp_path, capsys):
    """What `accumnorm study --quick` shows: summary.md's table and the sentence that reads it, then the files."""
    out = tmp_path / "out"
    assert main(["study", "--quick", "--dataset", "digits", "--norms", "bn,gn4", "--configs", "2x2,4x1", "--runs", "2",
                 "--iterations", "4", "--eval-every", "2", "--workers", "1", "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith((out / "summary.md").read_text())
    table, sentence, files = (printed.index(text) for text in (
        "| norm | bs2 x 2 | bs4 x 1 |", "torch's BatchNorm (bn) at bs2 x 2 reaches", f"wrote {out}/summary.md"))
    assert table < sentence < files
    assert re.search(r"\| gn4 \| 0\.\d{3} ± 0\.\d{3} \| 0\.\d{3} ± 0\.\d{3} \|", printed), printed


def test_a_short_study_averages_evaluations_it_has(tmp_path, capsys):
    """`--iterations 120 --eval-every 40` used to train every run, then report "n/a (no evaluation after step 250)" in
    every cell: the default window is half of a run shorter than 500 steps."""
    out = tmp_path / "out"
    assert main(["study", "--dataset", "digits", "--norms", "none", "--configs", "8x2", "--runs", "2", "--iterations",
                 "120", "--eval-every", "40", "--workers", "1", "--out", str(out), "--no-progress"]) == 0
    summary = (out / "summary.md").read_text()
    assert "n/a" not in summary and "after step 60 " in summary, summary
    assert re.search(r"\| none \| 0\.\d{3} ± 0\.\d{3} \|", summary), summary
    rows = list(csv.DictReader((out / "results.csv").open()))
    mean = statistics.fmean(statistics.fmean(float(r["valid_acc"]) for r in rows if r["run"] == run and
                                             int(r["iter"]) > 60) for run in ("0", "1"))
    assert f"| none | {mean:.3f} ±" in summary


@pytest.mark.parametrize("flags, message", [
    (["--average-after", "120"], "average_after=120 leaves no evaluation to average: the last is at step 120 "
                                 "(iterations 120, eval_every 40); expected a step below 120, e.g. average_after=60"),
    (["--eval-every", "50", "--average-after", "0.9"], "average_after=0.9 (step 108) leaves no evaluation to average: "
                                                       "the last is at step 100 (iterations 120, eval_every 50)"),
    (["--average-after", "1.5"], "average_after 1.5 is a fraction of the run: expected a float below 1"),
    (["--average-after", "-1"], "average_after: expected a step (an int >= 0) or a fraction of the run"),
    (["--average-after", "nan"], "average_after: expected a step (an int >= 0) or a fraction of the run"),
])
def test_a_window_without_evaluations_is_refused_before_training(tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    assert main(["study", *TINY_RUN, "--iterations", "120", "--eval-every", "40", *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("accumnorm study: error: ") and message in err and err.count("\n") == 1, err
    assert not out.exists()


def test_a_window_that_is_no_number_is_refused_saying_what_it_takes(tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exited:
        main(["study", *TINY_RUN, "--average-after", "abc", "--out", str(out)])
    assert exited.value.code == 2 and not out.exists()
    assert ("argument --average-after: expected a step (an int) or a fraction of the run (a float), got 'abc'"
            in capsys.readouterr().err)


def test_the_window_is_a_step_or_a_fraction_and_the_api_refuses_an_empty_one():
    short = dict(dataset="digits", iterations=120, eval_every=40)
    assert StudySettings(**short).window() == 60  # half of a run shorter than 500 steps
    assert StudySettings().window() == 250  # the study's window in the study's 3,600 steps
    assert StudySettings(**short, average_after=0).window() == 0
    assert StudySettings(**short, average_after=0.25).window() == 30
    assert StudySettings(**short, average_after=80).window() == 80
    for bad in (120, 200, 1.0, -1, True, "60"):
        with pytest.raises(ValueError, match="average_after"):
            StudySettings(**short, average_after=bad)
    with pytest.raises(ValueError, match="the last is at step 100"):
        StudySettings(**{**short, "eval_every": 50}, average_after=0.9)


def test_the_window_does_not_change_what_the_results_mean(tmp_path, capsys):
    """average_after changes the report only: a rerun with another window trains nothing and rewrites the table."""
    out = tmp_path / "out"
    args = ["study", *TINY_RUN, "--iterations", "4", "--eval-every", "2", "--out", str(out)]
    assert main(args) == 0
    before = (out / "results.csv").read_bytes()
    assert main([*args, "--average-after", "2"]) == 0
    assert (out / "results.csv").read_bytes() == before
    assert "after step 2 " in (out / "summary.md").read_text()
