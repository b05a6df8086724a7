"""How the study's grid is trained: its tasks, in this process or in spawned workers, and one progress bar.

A task is the runs of one cell trained together. On a CPU the tasks run in worker processes that split the
thread budget (see _runner's doc for why); on CUDA one process drives the GPU. Each task's outcome is its result
rows, or why its cell cannot run; the runner stores the rows as they come back.
"""
from __future__ import annotations

import multiprocessing
import os
import queue
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ._data import Dataset, load_dataset
from ._model import EXACT_BN

if TYPE_CHECKING:
    from ._settings import StudySettings
    from ._tasks import StudyTask

__all__ = ["Task", "Outcome", "parallelism", "in_process", "in_workers", "GridProgress"]


class Task(NamedTuple):
    """Runs of one cell trained together: all pending runs of a stackable norm, else one run."""

    name: str
    b: int
    k: int
    runs: tuple[int, ...]

    def label(self) -> str:
        return f"{self.name} {self.b}x{self.k} run{'s' if len(self.runs) > 1 else ''} {','.join(map(str, self.runs))}"


Outcome = list[dict[str, Any]] | str  # a finished task's result rows, or why its cell cannot run


def parallelism(workers: int | None, device: torch.device, tasks: int) -> tuple[int, int]:
    """(worker processes, torch threads each) for `tasks` pending tasks within this process's thread budget."""
    budget = torch.get_num_threads()
    if device.type != "cpu":
        return 1, budget
    workers = max(1, min(workers or budget, tasks))
    return workers, budget if workers == 1 else max(1, budget // workers)


def _attempt(kind: StudyTask, task: Task, data: Dataset, settings: StudySettings,
             on_step: Callable[[int], None]) -> Outcome:
    """Train `task` of `kind`; a ValueError or RuntimeError (torch's BatchNorm on a 1x1 map at micro-batch 1) is its
    outcome."""
    try:
        return kind.train(task.name, task.b, task.k, task.runs, data, settings, on_step)
    except (ValueError, RuntimeError) as err:
        return str(err).strip().splitlines()[0]


def in_process(kind: StudyTask, tasks: Sequence[Task], data: Dataset, settings: StudySettings,
               bar: GridProgress) -> Iterator[tuple[Task, Outcome]]:
    """Train the tasks here, one after the other; after a failure, the rest of that cell is skipped."""
    failed = set()
    for i, task in enumerate(tasks):
        if task[:3] not in failed:
            bar.start(i)
            outcome = _attempt(kind, task, data, settings, bar.stepper(i))
            if isinstance(outcome, str):
                failed.add(task[:3])
            yield task, outcome
        bar.finish(i)  # a failed cell's runs count as done: the grid goes on


def in_workers(kind: StudyTask, tasks: Sequence[Task], settings: StudySettings, workers: int, threads: int,
               bar: GridProgress) -> Iterator[tuple[Task, Outcome]]:
    """Train the tasks (of `kind`) in `workers` spawned processes of `threads` threads; yield each as it finishes.

    The likely costliest tasks go first (bn-exact's extra passes, then more micro-batches per
    step), so that the grid does not end on one long task while the other workers idle. After a
    failure the tasks of that cell not yet started are cancelled.
    """
    ctx = multiprocessing.get_context("spawn")
    steps = ctx.Queue()  # (task index, run-steps) from the workers, drained here while waiting
    stop = ctx.Event()  # set when this generator ends: workers quit at their next step (e.g. after a Ctrl-C)
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                               initargs=(kind, settings, threads, steps, stop, os.getpid()))
    try:
        order = sorted(range(len(tasks)), key=lambda i: (tasks[i].name == EXACT_BN, tasks[i].k), reverse=True)
        running = {pool.submit(_work, i, tasks[i]): i for i in order}
        while running:
            finished, _ = wait(running, timeout=0.1, return_when=FIRST_COMPLETED)
            while True:
                try:
                    bar.step(*steps.get_nowait())
                except queue.Empty:
                    break
            for future in finished:
                i = running.pop(future)
                if not future.cancelled():
                    outcome = future.result()
                    if isinstance(outcome, str):
                        for other, j in running.items():
                            if tasks[j][:3] == tasks[i][:3]:
                                other.cancel()
                    yield tasks[i], outcome
                bar.finish(i)
    finally:
        stop.set()  # tasks already handed to a worker cannot be cancelled: they end at their next step
        pool.shutdown(cancel_futures=True)


_worker: dict[str, Any] = {}  # in a worker: its task's kind, dataset, settings, step queue, stop event, parent's pid


def _init_worker(kind: StudyTask, settings: StudySettings, threads: int, steps: Any, stop: Any, parent: int) -> None:
    """Set up a worker process once: its share of the threads and its own copy of the dataset."""
    torch.set_num_threads(threads)
    _worker.update(kind=kind, data=load_dataset(settings.dataset, settings.data_dir), settings=settings, steps=steps,
                   stop=stop, parent=parent)


def _work(index: int, task: Task) -> Outcome:
    """Train task number `index` in a worker process, reporting every step to the parent."""
    def on_step(n: int) -> None:
        if _worker["stop"].is_set() or os.getppid() != _worker["parent"]:
            os._exit(1)  # the parent stopped or was killed: nobody will store this task's rows
        _worker["steps"].put((index, n))

    return _attempt(_worker["kind"], task, _worker["data"], _worker["settings"], on_step)


class GridProgress:
    """One bar over the whole grid, in run-steps (a stacked step of R runs counts R), fed by task number."""

    def __init__(self, tasks: Sequence[Task], iterations: int, runs_done: int, total_runs: int, enabled: bool):
        from tqdm.auto import tqdm

        self.tasks, self.iterations, self.runs_done, self.total_runs = tasks, iterations, runs_done, total_runs
        self.credited: dict[int, int] = {}  # run-steps counted so far of each task in progress
        self.finished: set[int] = set()
        self.bar = tqdm(total=total_runs * iterations, initial=runs_done * iterations, unit="step",
                        disable=not enabled, smoothing=0.05,
                        bar_format="{l_bar}{bar}| {n}/{total} run-steps [{elapsed}<{remaining}] {postfix}")
        self._postfix()

    def start(self, i: int) -> None:
        self.credited[i] = 0
        self._postfix()

    def step(self, i: int, n: int) -> None:
        if i in self.finished:
            return  # a step message that came after its task's result: finish() counted it
        if i not in self.credited:
            self.start(i)
        self.credited[i] += n
        self.bar.update(n)

    def stepper(self, i: int) -> Callable[[int], None]:
        return lambda n: self.step(i, n)

    def finish(self, i: int) -> None:
        """Task `i` is over (trained, failed or skipped): count all its run-steps."""
        runs = len(self.tasks[i].runs)
        self.bar.update(runs * self.iterations - self.credited.pop(i, 0))
        self.finished.add(i)
        self.runs_done += runs
        self._postfix()

    def close(self) -> None:
        self.bar.close()

    def _postfix(self) -> None:
        now = "; ".join(self.tasks[i].label() for i in self.credited)
        self.bar.set_postfix_str(f"{self.runs_done}/{self.total_runs} runs done" + (f", now {now}" if now else ""))
