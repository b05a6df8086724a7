"""The output directory: its settings, its results, written so that a crash never corrupts them.

Every file is replaced whole (`accumnorm._files.atomic_write`: temp file + os.replace, atomic on
POSIX), so after a `kill -9` each file is either its old or its new version. Each finished task's rows
are written to results.csv in one such replacement, which is what makes the study resumable: a run is
done iff all its rows are there. settings.json pins what the rows mean; a directory holding other
settings is refused rather than mixed.

A results.csv damaged all the same (a disk error, an edit) does not stop a resume: rows that cannot
be read are skipped with a warning naming the file and the lines, their runs train again, and the file
is rewritten, header first, without them.
"""
from __future__ import annotations

import json
import warnings
from collections import defaultdict
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

from .._files import atomic_write, csv_text, read_csv

__all__ = ["atomic_write", "open_out", "read_results", "read_whole_runs", "write_results", "run_key"]

FIELDS = ("norm", "batch_size", "num_accum", "run", "iter", "train_loss", "valid_acc", "seconds")
_TYPES = {"batch_size": int, "num_accum": int, "run": int, "iter": int,
          "train_loss": float, "valid_acc": float, "seconds": float}
RESULTS, SETTINGS = "results.csv", "settings.json"
RunKey = tuple[str, int, int, int]  # norm, batch_size, num_accum, run


def run_key(row: dict[str, Any]) -> RunKey:
    return row["norm"], row["batch_size"], row["num_accum"], row["run"]


def open_out(out: Path, settings: dict[str, Any]) -> None:
    """Make `out` hold results of `settings`: create it, or check that it already does.

    Raises ValueError naming the settings that differ, before anything in `out` is touched.
    """
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file, not a directory: the study writes several files into its output "
                         "directory; use another --out")
    saved_path = out / SETTINGS
    if saved_path.exists():
        saved = _read_settings(saved_path)
        differ = [f"{k}: {saved.get(k)!r} there, {settings.get(k)!r} now"
                  for k in sorted(saved.keys() | settings.keys()) if saved.get(k) != settings.get(k)]
        if differ:
            raise ValueError(f"{out} holds results of different settings ({'; '.join(differ)}); "
                             "use another --out or the same settings")
        return
    if (out / RESULTS).exists():
        raise ValueError(f"{out} holds a {RESULTS} without {SETTINGS}: cannot tell what it measured; use another --out")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(saved_path, json.dumps(settings, indent=2) + "\n")


def _read_settings(path: Path) -> dict[str, Any]:
    """settings.json, or a ValueError naming it when it is damaged."""
    try:
        saved = json.loads(path.read_text())
        if not isinstance(saved, dict):
            raise ValueError(f"a JSON {type(saved).__name__}, not an object")
    except ValueError as err:  # also bytes that are not UTF-8
        raise ValueError(f"{path} is damaged ({err}): it says what the results beside it measured; restore it, "
                         "or use another --out") from None
    return saved


def read_results(out: Path) -> list[dict[str, Any]]:
    """The readable rows of results.csv with their types (empty when there is none yet); see the module doc."""
    return _read(out)[0]


def _read(out: Path) -> tuple[list[dict[str, Any]], bool]:
    path = out / RESULTS
    if not path.exists():
        return [], True
    rows, intact = read_csv(path, FIELDS, _TYPES, then="their runs train again, and the file is rewritten without "
                                                         "them")
    return [{k: _TYPES.get(k, str)(v) for k, v in row.items()} for row in rows], intact


def read_whole_runs(out: Path, runs: Collection[RunKey], iters: Iterable[int]) -> list[dict[str, Any]]:
    """The rows of results.csv that make up whole runs of the grid: each of `runs` with a row at each of `iters`.

    Anything else (a run missing a row that could not be read, rows of runs outside `runs`) is left out,
    and the file rewritten without it, so that those runs train again and every row follows the header.
    """
    rows, intact = _read(out)
    steps: dict[RunKey, list[int]] = defaultdict(list)
    for row in rows:
        steps[run_key(row)].append(row["iter"])
    whole = {key for key, its in steps.items() if key in runs and sorted(its) == list(iters)}
    kept = [row for row in rows if run_key(row) in whole]
    if intact and len(kept) < len(rows):  # whole lines that do not make whole runs of the grid: edited by hand
        warnings.warn(f"{out / RESULTS}: {len(rows) - len(kept)} rows of runs that are cut short or not in this grid "
                      "are left out; their runs train again", UserWarning, stacklevel=2)
    if not intact or len(kept) < len(rows):
        write_results(out, kept)
    return kept


def write_results(out: Path, rows: list[dict[str, Any]]) -> None:
    """Replace results.csv by a header and `rows`, all or nothing."""
    atomic_write(out / RESULTS, csv_text(FIELDS, rows))
