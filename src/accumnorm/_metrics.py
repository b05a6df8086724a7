"""A run's logs: config.json, metrics.csv and TensorBoard scalars, in its log directory.

A continued run rewrites metrics.csv atomically as it starts, keeping the rows up to its starting step (a run
killed after its last checkpoint logged past it) and dropping rows that cannot be read, with a warning; its
config.json keeps the configuration it continues under "previous", and a change of batch size in the middle of an
epoch, where the position in the epoch counts batches, is said in a warning.
"""
from __future__ import annotations

import csv
import json
import warnings
from pathlib import Path
from typing import Any

from ._files import atomic_write, csv_text, read_csv

__all__ = ["MetricLog", "METRIC_FIELDS"]

METRIC_FIELDS = ("step", "name", "value")


class MetricLog:
    """config.json, metrics.csv and TensorBoard scalars in one directory; does nothing without one."""

    def __init__(self, directory: Path | None, step: int):
        self.directory, self.start_step = directory, step
        self.writer = self.csv = None

    def start(self, config: dict[str, Any]) -> None:
        """Open the files; rows past the starting step (left by a run killed after its last checkpoint)
        and rows that cannot be read are dropped, so a resumed run's log reads as one run."""
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        self.write_config(self._continued(config))
        path = self.directory / "metrics.csv"
        rows = []
        if path.exists():
            rows, _ = read_csv(path, METRIC_FIELDS, {"step": int, "value": float},
                               then="this run writes the file again without them")
        kept = [r for r in rows if int(r["step"]) <= self.start_step]
        atomic_write(path, csv_text(METRIC_FIELDS, kept, lineterminator="\r\n"))  # csv's own line end, as below
        self.file = open(path, "a", newline="")
        self.csv = csv.DictWriter(self.file, METRIC_FIELDS)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # TensorBoard is optional; the CSV has everything
            return
        self.writer = SummaryWriter(self.directory, purge_step=self.start_step + 1)

    def _continued(self, config: dict[str, Any]) -> dict[str, Any]:
        """`config`, with the configuration of the run it continues, if any, under "previous"; a warning if the batch
        size changed in the middle of an epoch."""
        path = self.directory / "config.json"
        if not path.exists() or config.get("start_step", 0) == 0:
            return config
        previous = json.loads(path.read_text())
        was, now = previous.get("batch_per_rank"), config.get("batch_per_rank")
        if config.get("batch_in_epoch") and was != now:
            warnings.warn(f"this run continues {self.directory} with batches of {now} samples per rank where it had "
                          f"{was}, {config['batch_in_epoch']} batches into an epoch: the position in the epoch counts "
                          "batches, so the rest of this epoch is not the data the run would have seen", stacklevel=4)
        return {**config, "previous": previous}

    def write_config(self, config: dict[str, Any]) -> None:
        if self.directory is not None:
            atomic_write(self.directory / "config.json", json.dumps(config, indent=2, default=str) + "\n")

    def log(self, step: int, values: dict[str, float]) -> None:
        if self.csv is None:
            return
        self.csv.writerows({"step": step, "name": k, "value": v} for k, v in values.items())
        self.file.flush()
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self.csv is not None:
            self.file.close()
        if self.writer is not None:
            self.writer.close()
