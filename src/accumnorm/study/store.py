"""The output directory: its settings, its results, written so that a crash never corrupts them.

Every file is replaced whole (temp file + os.replace, atomic on POSIX), so after a `kill -9`
each file is either its old or its new version. Finished runs are appended to results.csv in
one such replacement, which is what makes the study resumable: a run is done iff its rows are
there. settings.json pins what the rows mean; a directory holding other settings is refused
rather than mixed.
"""
from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

FIELDS = ("norm", "batch_size", "num_accum", "run", "iter", "train_loss", "valid_acc", "seconds")
_TYPES = {"batch_size": int, "num_accum": int, "run": int, "iter": int,
          "train_loss": float, "valid_acc": float, "seconds": float}
RESULTS, SETTINGS = "results.csv", "settings.json"


def atomic_write(path: Path, data: str | bytes) -> None:
    """Replace `path` by `data` in one step: readers and crashes see the old or the new file, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def open_out(out: Path, settings: dict[str, Any]) -> None:
    """Make `out` hold results of `settings`: create it, or check that it already does.

    Raises ValueError naming the settings that differ, before anything in `out` is touched.
    """
    saved_path = out / SETTINGS
    if saved_path.exists():
        saved = json.loads(saved_path.read_text())
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


def read_results(out: Path) -> list[dict[str, Any]]:
    """The rows of results.csv with their types (empty when there is none yet)."""
    path = out / RESULTS
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [{k: _TYPES.get(k, str)(v) for k, v in row.items()} for row in csv.DictReader(f)]


def append_results(out: Path, rows: list[dict[str, Any]]) -> None:
    """Add the rows of finished runs to results.csv, all or none."""
    path = out / RESULTS
    buf = io.StringIO()
    writer = csv.DictWriter(buf, FIELDS, lineterminator="\n")
    if not path.exists():
        writer.writeheader()
    writer.writerows(rows)
    old = path.read_text() if path.exists() else ""
    atomic_write(path, old + buf.getvalue())
