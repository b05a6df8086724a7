"""What a study measures: its settings, checked once, and the BxK config strings."""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from ._model import SimpleModel, norm_fn

_CONFIG = re.compile(r"(\d+)x(\d+)")


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


def check_positive_float(name: str, value: Any) -> None:
    """A setting that must be a finite number > 0 (a learning rate, a temperature)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class StudySettings:
    """What a study measures; saved as settings.json next to its results."""

    dataset: str = "mnist"
    data_dir: str | None = None
    norms: tuple[str, ...] = ("bn", "bn-exact", "gn4", "gn16", "in", "none")
    configs: tuple[str, ...] = ("16x1", "1x16", "4x4", "1x1")
    runs: int = 3
    iterations: int = 3600
    eval_every: int = 300
    lr: float = 1e-3
    seed: int = 0

    def __post_init__(self) -> None:
        check_grid(self, "norms")
        for name in self.norms:
            build = norm_fn(name)  # unknown names fail here, before any file is written
            try:  # and so does a norm that cannot fit the study's widths (gn3); built on meta: no memory
                with torch.device("meta"):
                    SimpleModel(build)
            except ValueError as err:
                raise ValueError(f"norm {name!r} does not fit the study's network: {err}") from err

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "norms": list(self.norms), "configs": list(self.configs)}
