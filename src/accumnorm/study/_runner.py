"""Run a study's grid: every name x every BxK config x several runs, resumable, runs trained together.

The runner is the top of the study's imports: below it the tasks (_norm_study.py, _simclr.py), below those
the registry (_tasks.py), settings, data, models and files.

On a CPU the cells also run in parallel, in worker processes that split the thread budget
(torch.get_num_threads()) between them: at micro-batch 1 a step is a long chain of small
calls that intra-op threads barely speed up (a step takes ~65 ms on 2 threads, ~93 ms on 1),
so two cells on one thread each get through ~1.4x more steps than one cell on two threads.
The cells are independent and every run's seed fixes its whole computation, so the results
do not depend on the process a cell ran in (_grid.py). Workers are spawned (torch is not fork-safe),
load the dataset once each, train one task (the runs of a cell trained together) at a time
and send their step counts to the parent's progress bar; the parent appends each finished
task's rows to results.csv as it comes back, so a kill loses only the tasks in progress.
On CUDA one process drives the GPU.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from . import _store as store
from ._data import OFFLINE, load_dataset
from ._grid import GridProgress, Task, in_process, in_workers, parallelism
from ._norm_study import NORM_STUDY
from ._settings import SimCLRSettings, StudySettings, check_positive_int, parse_config
from ._simclr import SIMCLR
from ._tasks import StudyTask

__all__ = ["run_study", "study_task"]


def run_study(out: str | Path, settings: StudySettings | SimCLRSettings | None = None, *,
              device: str | torch.device | None = None, progress: bool = True, workers: int | None = None) -> Path:
    """Run (or resume) the grid of `settings` into `out`; write the reports; return `out`.

    `settings` say which task: StudySettings the normalization study, SimCLRSettings contrastive learning
    (`accumnorm.study._simclr`). Both share this grid: names x BxK configs x runs.

    Runs already in out/results.csv are skipped (rows of it that cannot be read are skipped with a warning, and
    their runs trained again). A cell that cannot run (e.g. torch's BatchNorm
    at micro-batch 1 where a feature map is 1x1) is reported with its reason and the grid goes on.
    `workers`: processes training cells in parallel on a CPU, each with torch.get_num_threads() //
    workers threads (default: one per thread of that budget, at most one per pending task); 1
    trains in this process. On CUDA always 1. The report says how many ran.
    """
    settings = settings or StudySettings()
    out = Path(out)
    device = _device(device)
    if workers is not None:
        check_positive_int("workers", workers)
    offline = settings.dataset in OFFLINE or settings.data_dir is None
    data_dir = None if offline else str(Path(settings.data_dir).resolve())
    settings = dataclasses.replace(settings, data_dir=data_dir)
    # May fail: nothing written yet (workers load their own).
    data = load_dataset(settings.dataset, settings.data_dir).to(device)
    _check_configs(settings, len(data.train_x))
    store.open_out(out, settings.to_json())

    kind = study_task(settings)
    cells = kind.cells(settings)
    runs = {(name, b, k, r) for name, b, k in cells for r in range(settings.runs)}
    rows = store.read_whole_runs(out, runs, range(settings.eval_every, settings.iterations + 1, settings.eval_every))
    done = {store.run_key(r) for r in rows}
    tasks = []
    for name, b, k in cells:
        pending = tuple(r for r in range(settings.runs) if (name, b, k, r) not in done)
        tasks += [Task(name, b, k, group) for group in kind.groups(name, pending) if group]
    workers, threads = parallelism(workers, device, len(tasks))
    total_runs = len(cells) * settings.runs
    bar = GridProgress(tasks, settings.iterations, total_runs - sum(len(t.runs) for t in tasks), total_runs, progress)
    failures: dict[tuple[str, int, int], str] = {}
    finished = (in_process(kind, tasks, data, settings, bar) if workers == 1
                else in_workers(kind, tasks, settings, workers, threads, bar))
    for task, outcome in finished:
        if isinstance(outcome, str):
            failures[task[:3]] = outcome
        else:
            rows += outcome
            store.write_results(out, rows)
    bar.close()
    kind.report(out, settings, rows, failures, device=str(device), workers=workers, threads=threads)
    return out


def study_task(settings: StudySettings | SimCLRSettings) -> StudyTask:
    """The task that `settings` (a StudySettings or a SimCLRSettings) describe."""
    if isinstance(settings, StudySettings):
        return NORM_STUDY
    if isinstance(settings, SimCLRSettings):
        return SIMCLR
    raise TypeError(f"settings must be a StudySettings or a SimCLRSettings, got {type(settings).__name__}")


def _check_configs(settings: StudySettings, train_size: int) -> None:
    """Refuse, before anything runs, configs whose micro-batch the training set cannot fill."""
    too_big = [c for c in settings.configs if parse_config(c)[0] > train_size]
    if too_big:
        raise ValueError(f"configs {', '.join(too_big)} have micro-batches larger than the {train_size} training "
                         f"samples of {settings.dataset}: expected B <= {train_size}")


def _device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"device must be like 'cpu' or 'cuda', got {device!r}") from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    if dev.type == "meta":
        raise ValueError(f"device must hold data to train on, like 'cpu' or 'cuda', got {device!r}")
    return dev


