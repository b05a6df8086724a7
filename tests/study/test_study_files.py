"""The study's output directory when its files are damaged: a resume names what it skips, trains again
what it lost, and writes results.csv over whole, header first."""
import csv
import re
import shutil

import pytest
import torch

from accumnorm.study import StudySettings, run_study
from accumnorm.study import _norm_study as norm_study

SETTINGS = StudySettings(dataset="digits", norms=("none",), configs=("2x2",), runs=2, iterations=4, eval_every=2)


def _rows(out):
    with open(out / "results.csv", newline="") as f:
        return list(csv.DictReader(f))


def _key(row):
    return row["norm"], row["batch_size"], row["num_accum"], row["run"], row["iter"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-run study, trained once for the whole module."""
    out = tmp_path_factory.mktemp("finished")
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(norm_study, "evaluate", _no_evaluation)
        run_study(out, SETTINGS, progress=False, workers=1)
    return out


def _no_evaluation(model, x, y, runs):
    """What these tests check is the files: the validation pass, most of a run's time here, is left out."""
    return torch.zeros(runs)


@pytest.fixture
def trained(finished, tmp_path, monkeypatch):
    """A copy of the finished study in tmp_path, and the list of (norm, runs) that later calls of _train record."""
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    calls, train = [], norm_study._train

    def recording(name, b, k, runs, *args):
        calls.append((name, tuple(runs)))
        return train(name, b, k, runs, *args)

    monkeypatch.setattr(norm_study, "_train", recording)
    monkeypatch.setattr(norm_study, "evaluate", _no_evaluation)
    return out, calls


def _same_rows(got, want):
    assert sorted(map(_key, got)) == sorted(map(_key, want))
    by_key = {_key(r): r for r in want}
    for row in got:
        assert float(row["train_loss"]) == pytest.approx(float(by_key[_key(row)]["train_loss"]), rel=1e-4)


@pytest.mark.parametrize("damage", ["garbled", "cut short"])
def test_an_unreadable_row_is_named_and_its_run_trained_again(trained, damage):
    out, calls = trained
    good = _rows(out)
    lines = (out / "results.csv").read_text().splitlines(keepends=True)
    assert len(lines) == 5 and lines[2].startswith("none,2,2,1,2,")  # run 1's row at step 2
    if damage == "garbled":
        lines[2] = "none,2,2,one,2,0.5,0.5,1.0\n"
        expect = r"line 3: run is 'one'"
    else:  # a run killed while a line was written: the last line has no end (run 1's row at step 4)
        lines[4] = lines[4][:12]
        expect = r"line 5: cut short"
    (out / "results.csv").write_text("".join(lines))
    named = re.escape(str(out / "results.csv"))
    with pytest.warns(UserWarning, match=rf"{named}: skipped .*{expect}.*their runs train again"):
        run_study(out, SETTINGS, progress=False, workers=1)
    assert calls == [("none", (1,))]  # run 0's rows are whole: kept, not trained again
    _same_rows(_rows(out), good)
    assert (out / "results.csv").read_text().count("\n") == 5  # header and 4 rows: nothing left of the damage


@pytest.mark.parametrize("header", ["", "norm,batch\n", None])
def test_a_results_file_without_its_header_is_started_over_with_one(trained, header):
    """Emptied, a wrong header, or the header line lost: the rerun writes the header and whole runs, never rows
    without a header."""
    out, calls = trained
    good = _rows(out)
    lines = (out / "results.csv").read_text().splitlines(keepends=True)
    (out / "results.csv").write_text("".join(lines[1:]) if header is None else header)
    with pytest.warns(UserWarning, match=rf"{re.escape(str(out / 'results.csv'))}: skipped .*(no header|empty file)"):
        run_study(out, SETTINGS, progress=False, workers=1)
    assert calls == ([] if header is None else [("none", (0, 1))])  # headerless rows still read as rows
    _same_rows(_rows(out), good)
    run_study(out, SETTINGS, progress=False, workers=1)  # and the next rerun finds everything done
    assert len(calls) == (0 if header is None else 1)


def test_rows_of_runs_cut_short_are_left_out_with_a_warning(trained):
    """A readable file whose rows do not make whole runs (edited by hand): those runs train again."""
    out, calls = trained
    lines = (out / "results.csv").read_text().splitlines(keepends=True)
    (out / "results.csv").write_text("".join(lines[:4]))  # run 1 lost its step-4 row
    with pytest.warns(UserWarning, match="1 rows of runs that are cut short or not in this grid are left out"):
        run_study(out, SETTINGS, progress=False, workers=1)
    assert calls == [("none", (1,))] and len(_rows(out)) == 4


def test_a_damaged_settings_file_is_named(trained):
    out, _ = trained
    (out / "settings.json").write_text('{"dataset": "dig')
    with pytest.raises(ValueError, match=rf"{re.escape(str(out / 'settings.json'))} is damaged \(.*\): .*restore it"):
        run_study(out, SETTINGS, progress=False, workers=1)
