"""The study's registry of tasks, at the bottom of its imports: what a task is, which there are, what they share.

The runner (_runner.py) owns what every task shares: the grid of names x BxK configs x runs, resuming from
results.csv, worker processes, the progress bar. A task says which cells its settings make, which runs of a
cell train together, how to train them, and how to report the rows. Two tasks, each a module above this one:

- ``bn``: the normalization-under-accumulation study (`StudySettings`, _norm_study.py, _report.py);
- ``simclr``: contrastive pre-training under accumulation (`SimCLRSettings`, _simclr.py, _simclr_report.py).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import torch

from ._settings import SimCLRSettings, StudySettings

__all__ = ["TASKS", "StudyTask", "settings_class", "data_order"]

TASKS: dict[str, type] = {"bn": StudySettings, "simclr": SimCLRSettings}  # task name -> its settings
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
    """The settings dataclass of the task named `task` (a key of TASKS)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    return TASKS[task]


def data_order(n: int, steps: int, per_step: int, seeds: Iterable[int]) -> torch.Tensor:
    """Sample indices (R, steps, per_step): per run, an endless stream of permutations of range(n) from its seed."""
    orders = []
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        epochs = math.ceil(steps * per_step / n)
        orders.append(torch.cat([torch.randperm(n, generator=gen) for _ in range(epochs)])[: steps * per_step])
    return torch.stack(orders).view(-1, steps, per_step)
