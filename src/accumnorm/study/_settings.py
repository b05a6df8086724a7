"""What a study measures: each task's settings, checked once, and the BxK config strings."""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from ._model import SimpleModel, norm_fn

_CONFIG = re.compile(r"(\d+)x(\d+)")
AVERAGE_AFTER = 250  # the study's window: its table averages the evaluations after this step


def parse_config(text: str) -> tuple[int, int]:
    """'4x4' -> (micro-batch size B, accumulation count K)."""
    match = _CONFIG.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None or min(int(match[1]), int(match[2])) < 1:
        raise ValueError(f"expected BxK like 4x4, got {text!r}")
    return int(match[1]), int(match[2])


def check_positive_int(name: str, value: Any) -> None:
    """The one check of every count the study takes (runs, iterations, eval_every, workers, threads)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_grid(settings: Any, names: str) -> None:
    """The checks every task's settings share: counts, lr, seed, a non-empty grid of `names` x configs.

    Writes the configs (and the names, as a tuple) back in canonical spelling, so that ' 4x4' and '4x4' are the
    same settings on disk. Raises ValueError naming the setting, before any file is written.
    """
    for name in ("runs", "iterations", "eval_every"):
        check_positive_int(name, getattr(settings, name))
    if settings.eval_every > settings.iterations:
        raise ValueError(f"eval_every ({settings.eval_every}) is more than iterations ({settings.iterations}): no run "
                         "would ever be evaluated, so none would write a result; expected eval_every <= iterations")
    if not getattr(settings, names) or not settings.configs:
        raise ValueError(f"need at least one {names[:-1]} and one config, got {names}={getattr(settings, names)!r} "
                         f"configs={settings.configs!r}")
    check_positive_float("lr", settings.lr)
    seed = settings.seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= 2**64 - settings.runs:
        raise ValueError(f"seed must be an int from 0 to 2**64 - runs (run r is seeded with seed + r), got {seed!r}")
    object.__setattr__(settings, "configs", tuple("{}x{}".format(*parse_config(c)) for c in settings.configs))
    object.__setattr__(settings, names, tuple(getattr(settings, names)))
    for name in (names, "configs"):
        given = getattr(settings, name)
        twice = sorted({x for x in given if given.count(x) > 1})
        if twice:
            raise ValueError(f"{name} lists {', '.join(map(repr, twice))} more than once: each is one column or row "
                             "of the table; give each once")


def check_positive_float(name: str, value: Any) -> None:
    """A setting that must be a finite number > 0 (a learning rate, a temperature)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class StudySettings:
    """What a study measures; saved as settings.json next to its results.

    The table averages each run's evaluations after step `average_after` (the first ones are still warming up):
    an int is a step, a float from 0 to 1 a fraction of `iterations`. Default: the study's 250, or half the run
    when it is shorter than 500 steps. A window with no evaluation in it is refused.
    """

    dataset: str = "mnist"
    data_dir: str | None = None
    norms: tuple[str, ...] = ("bn", "bn-exact", "gn4", "gn16", "in", "none")
    configs: tuple[str, ...] = ("16x1", "1x16", "4x4", "1x1")
    runs: int = 3
    iterations: int = 3600
    eval_every: int = 300
    lr: float = 1e-3
    seed: int = 0
    average_after: int | float | None = None

    def __post_init__(self) -> None:
        check_grid(self, "norms")
        self.window()
        for name in self.norms:
            build = norm_fn(name)  # unknown names fail here, before any file is written
            try:  # and so does a norm that cannot fit the study's widths (gn3); built on meta: no memory
                with torch.device("meta"):
                    SimpleModel(build)
            except ValueError as err:
                raise ValueError(f"norm {name!r} does not fit the study's network: {err}") from err

    def window(self) -> int:
        """The step after which the table averages the evaluations; see `average_after`.

        Raises ValueError when no evaluation would come after it, naming what to change.
        """
        after, iterations = self.average_after, self.iterations
        if after is None:
            step = min(AVERAGE_AFTER, iterations // 2)
        elif isinstance(after, bool) or not isinstance(after, (int, float)) or not 0 <= after < math.inf:
            raise ValueError(f"average_after: expected a step (an int >= 0) or a fraction of the run (a float "
                             f"from 0 to 1), got {after!r}")
        elif isinstance(after, float):
            if after >= 1:
                raise ValueError(f"average_after {after!r} is a fraction of the run: expected a float below 1, or an "
                                 "int for a step")
            step = int(after * iterations)
        else:
            step = after
        last = iterations // self.eval_every * self.eval_every
        if step >= last:
            given = f"average_after={after!r}" + (f" (step {step})" if isinstance(after, float) else "")
            raise ValueError(f"{given} leaves no evaluation to average: the last is at step {last} (iterations "
                             f"{iterations}, eval_every {self.eval_every}); expected a step below {last}, e.g. "
                             f"average_after={last // 2} or 0.5, or more iterations")
        return step

    def to_json(self) -> dict[str, Any]:
        """What the results mean, saved as settings.json: average_after only changes the report, not the rows."""
        saved = {**dataclasses.asdict(self), "norms": list(self.norms), "configs": list(self.configs)}
        del saved["average_after"]
        return saved


WHOLE = "bn-whole"
METHODS = {
    WHOLE: "BatchNorm, the whole batch in one forward/backward of plain torch",
    "bn": "plain accumulation: BatchNorm and NT-Xent per micro-batch",
    "bn-gradcache": "GradCache: BatchNorm per micro-batch, NT-Xent over the whole batch",
    "bn-exact": "accumnorm exact: BatchNorm and NT-Xent over the whole batch",
    "gn": "GroupNorm, NT-Xent over the whole batch",
}


@dataclass(frozen=True)
class SimCLRSettings:
    """What a SimCLR study measures; saved as settings.json next to its results."""

    dataset: str = "mnist"
    data_dir: str | None = None
    methods: tuple[str, ...] = tuple(METHODS)
    configs: tuple[str, ...] = ("8x8", "4x16")
    runs: int = 3
    iterations: int = 300
    eval_every: int = 100
    lr: float = 1e-3
    temperature: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        check_grid(self, "methods")
        check_positive_float("temperature", self.temperature)
        for name in self.methods:
            if name not in METHODS:
                raise ValueError(f"unknown method {name!r}; expected one of {', '.join(METHODS)}")

    def to_json(self) -> dict[str, Any]:
        return {"task": "simclr", **dataclasses.asdict(self), "methods": list(self.methods),
                "configs": list(self.configs)}


def whole_cell(name: str, b: int, k: int) -> tuple[str, int, int]:
    """The cell whose result stands at (name, B, K): bn-whole trains the B*K samples in one go at any split."""
    return (name, b * k, 1) if name == WHOLE else (name, b, k)
