"""`accumnorm study` on the command line: options reach the runner, bad input is a clear error."""
import json

import pytest
from torch import nn

import accumnorm.study
from accumnorm._cli import QUICK, main
from accumnorm.study import StudySettings
from accumnorm.study._data import load_dataset
from accumnorm.study._model import SimpleModel
from accumnorm.study._report import AFTER_STEP


def test_bad_config_string_is_a_clear_error_and_writes_nothing(tmp_path, capsys):
    assert main(["study", "--quick", "--configs", "1x16,4-4", "--out", str(tmp_path / "out")]) == 2
    assert "expected BxK like 4x4, got '4-4'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_quick_grid_is_the_default_and_options_override_it(monkeypatch):
    seen = {}
    monkeypatch.setattr(accumnorm.study, "run_study",
                        lambda out, settings, **kw: seen.update(out=out, settings=settings, **kw))
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
    """--quick's settings: bn and bn-exact at micro-batch 1 x 16 and at 16 x 1, 3 runs, an evaluation after step 250,
    on digits whose last feature map stays larger than 1x1 (torch's BatchNorm cannot run on 1x1 at micro-batch 1)."""
    settings = StudySettings(**{k: v for k, v in QUICK.items() if k not in ("norms", "configs")},
                             norms=tuple(QUICK["norms"].split(",")), configs=tuple(QUICK["configs"].split(",")))
    assert {"bn", "bn-exact"} <= set(settings.norms) and {"1x16", "16x1"} <= set(settings.configs)
    assert settings.runs >= 3 and settings.dataset == "digits16"
    assert any(step > AFTER_STEP for step in range(settings.eval_every, settings.iterations + 1, settings.eval_every))
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
