"""What `accumnorm study --task` trains, and the little the runner needs to know of each task.

The runner (runner.py) owns what every task shares: the grid of names x BxK configs x runs, resuming from
results.csv, worker processes, the progress bar. A task says which cells its settings make, which runs of a
cell train together, how to train them, and how to report the rows. Two tasks:

- ``bn``: the normalization-under-accumulation study (`StudySettings`, runner.py, report.py);
- ``simclr``: contrastive pre-training under accumulation (`SimCLRSettings`, simclr.py, simclr_report.py).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

__all__ = ["TASKS", "StudyTask", "study_task", "settings_class"]

TASKS = ("bn", "simclr")
Row = dict[str, Any]


class StudyTask(Protocol):
    """What the runner asks of a task."""

    def cells(self, settings: Any) -> list[tuple[str, int, int]]:
        """(name, B, K) of every cell to train, each once."""

    def groups(self, name: str, runs: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The pending `runs` of a cell of `name`, in groups trained together."""

    def train(self, name: str, b: int, k: int, runs: tuple[int, ...], data: Any, settings: Any,
              on_step: Callable[[int], None]) -> list[Row]:
        """Train `runs` of cell (name, B, K); one results.csv row per run per evaluation."""

    def report(self, out: Path, settings: Any, rows: list[Row], failures: dict[tuple[str, int, int], str], *,
               device: str, workers: int, threads: int) -> None:
        """Write summary.md, curves.png and report.html into `out`."""


def settings_class(task: str) -> type:
    """The settings dataclass of the task named `task` (one of TASKS)."""
    if task == "bn":
        from ._settings import StudySettings

        return StudySettings
    if task == "simclr":
        from ._simclr import SimCLRSettings

        return SimCLRSettings
    raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")


def study_task(settings: Any) -> StudyTask:
    """The task that `settings` (a StudySettings or a SimCLRSettings) describe."""
    from ._runner import NORM_STUDY
    from ._settings import StudySettings
    from ._simclr import SIMCLR, SimCLRSettings

    if isinstance(settings, StudySettings):
        return NORM_STUDY
    if isinstance(settings, SimCLRSettings):
        return SIMCLR
    raise TypeError(f"settings must be a StudySettings or a SimCLRSettings, got {type(settings).__name__}")
