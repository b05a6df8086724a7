"""The methods bench_backward.py runs, by name: plain accumulation, the whole batch, each exact schedule with its
settings, and each schedule's floor.

An exact schedule is named with its settings, `name[:key=value[:key=value...]]`: "recompute", "passes",
"segments:keep_every=2". Each setting is passed to `accumnorm.backward` as a keyword argument of its own
(`backward_options`, the one place that says how), its value read as a Python literal where it is one (4, 0.5, True,
None) and as text otherwise (store=cpu). Each such name is a method of its own: a column of the tables, a point of
the frontier pictures. Whether this accumnorm takes a schedule with its settings is asked, not assumed (`refusal`):
one step of a small net, so that a schedule or a setting a version lacks is reported, not run.

"auto" with `memory_budget=1.5x` (a number and x) runs at a budget that many times plain accumulation's peak as
measured in the same run, at the same K (`relative_budget`, `resolved`): the benchmark measures plain's peak first,
then runs "auto" with that budget in bytes, and shows which schedule ran. A budget in bytes is a plain setting.

A schedule's floor (`FLOORS`) is what its time cannot go below, timed beside it: for layerwise the lockstep and
nothing else, for recompute plain accumulation with its regions checkpointed, for segments the same with all of
its regions (at keep_every=1 only: _steps.py). A floor takes the settings it names and no others: "recompute:c=4"
has no floor until one that takes `c` is registered; the floor of a schedule with settings is named with them
("floor:c=4").
"""
from __future__ import annotations

import ast
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from _steps import (
    COMPILED_FLOOR,
    COMPILED_PLAIN,
    Method,
    checkpointed_step,
    compiled,
    lockstep_step,
    plain_step,
    segments_floor,
    whole_step,
)

import accumnorm

# The exact schedules the tables show by default, in their order.
SCHEDULES = ("layerwise", "recompute", "passes")

Settings = tuple[tuple[str, Any], ...]


class Spec(NamedTuple):
    """An exact schedule and its settings, as a method's name gives them."""

    schedule: str
    settings: Settings = ()

    def __str__(self) -> str:
        return ":".join([self.schedule, *(f"{k}={v}" for k, v in self.settings)])


def parse_spec(name: str) -> Spec:
    """`name[:key=value...]` as a Spec; ValueError, saying what is wrong, for anything else."""
    schedule, *pairs = (part.strip() for part in name.split(":"))
    if not schedule.isidentifier():
        raise ValueError(f"{name!r}: a schedule's name is a word, e.g. recompute or segments:keep_every=2")
    settings: dict[str, Any] = {}
    for pair in pairs:
        key, is_pair, text = (s.strip() for s in pair.partition("="))
        if not is_pair or not key.isidentifier() or not text:
            raise ValueError(f"{name!r}: each setting is key=value, got {pair!r}")
        if key in settings:
            raise ValueError(f"{name!r}: {key} set twice")
        settings[key] = _value(text)
    return Spec(schedule, tuple(settings.items()))


def _value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def relative_budget(name: str) -> float | None:
    """The factor of a method's budget relative to plain's peak (`auto:memory_budget=1.5x`: 1.5); None for any
    other method."""
    value = dict(parse_spec(name.removeprefix("compiled ")).settings).get("memory_budget")
    match = re.fullmatch(r"(\d+(?:\.\d*)?)x", value) if isinstance(value, str) else None
    return float(match.group(1)) if match else None


def resolved(name: str, plain_peak: int) -> str:
    """A method with a budget relative to plain's peak (`relative_budget`) as the method with that budget in bytes."""
    factor = relative_budget(name)
    spec = parse_spec(name)
    if factor is None:
        return name
    return str(Spec(spec.schedule, tuple((k, int(factor * plain_peak) if k == "memory_budget" else v)
                                         for k, v in spec.settings)))


def backward_options(spec: Spec) -> dict[str, Any]:
    """accumnorm.backward's keyword arguments for `spec`: the schedule, and each setting as a keyword of its own."""
    return {"schedule": spec.schedule, **dict(spec.settings)}


def schedule_step(name: str) -> Method:
    """The step of an exact schedule with its settings: accumnorm.backward, with the loss per micro-batch or, for a
    loss that couples the batch's samples, once over the whole batch's outputs."""
    options = backward_options(parse_spec(name))

    def step(model: nn.Module, batch: Any, micro: int, case: Any) -> None:
        if case.batch_loss is None:
            accumnorm.backward(model, batch, case.loss, micro_batch_size=micro, **options)
        else:
            accumnorm.backward(model, batch, micro_batch_size=micro, forward_fn=case.forward,
                               batch_loss_fn=case.batch_loss, **options)
    return step


NOT_AVAILABLE = "not available in this accumnorm"


def refusal(name: str) -> str | None:
    """None if accumnorm.backward takes the schedule `name` with its settings (one step of a net of three
    Linear-BatchNorm layers, 8 samples in micro-batches of 2, asked directly), else why not: NOT_AVAILABLE for a
    schedule or a setting this accumnorm does not know, its own message for a value it refuses."""
    if relative_budget(name) is not None:
        if name.startswith("compiled"):
            return "a budget relative to plain's peak is not run compiled"
        name = resolved(name, 2**40)
    torch.manual_seed(0)
    net = nn.Sequential(*(layer for _ in range(3) for layer in (nn.Linear(3, 3), nn.BatchNorm1d(3), nn.ReLU())))
    try:
        schedule_step(name)(net, torch.randn(8, 3), 2, _Probe)
    except ValueError as e:
        if str(e).startswith("schedule must be"):  # the argument check's refusal of a name it does not know
            return NOT_AVAILABLE
        return f"refused: {e}"
    except TypeError as e:
        if "unexpected keyword argument" in str(e):  # a setting accumnorm.backward has no parameter for
            return NOT_AVAILABLE
        return f"refused: {e}"
    return None


class _Probe:
    """`refusal`'s loss: the mean square of the net's output, per micro-batch."""

    batch_loss = None

    @staticmethod
    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).square().mean()


class Floor(NamedTuple):
    """A schedule's floor: its method's name, `make(**settings)` its step, and the settings it takes."""

    name: str
    make: Callable[..., Method]
    settings: frozenset[str] = frozenset()


FLOORS = {"layerwise": Floor("lockstep", lambda: lockstep_step),
          "recompute": Floor("checkpointed", lambda: checkpointed_step),
          "segments": Floor("checkpointed_all", segments_floor, frozenset({"keep_every"}))}
_BY_FLOOR_NAME = {f.name: f for f in FLOORS.values()}
# Method names that are no exact schedule's.
RESERVED = ("plain", "whole", *_BY_FLOOR_NAME)


def floor_of(name: str) -> str | None:
    """The name of the floor timed beside schedule `name`, or None where it has none for these settings."""
    spec = parse_spec(name)
    floor = FLOORS.get(spec.schedule)
    if floor is None or any(k not in floor.settings for k, _ in spec.settings):
        return None
    return str(Spec(floor.name, spec.settings))


def schedule_of(method: str) -> str:
    """The schedule a method's name runs ("passes" for "compiled passes:x=1"; "plain" for "compiled plain")."""
    return parse_spec(method.removeprefix("compiled ")).schedule


def timed_methods(schedules: list[str]) -> list[str]:
    """The methods timed, in the table's order: plain, and each schedule followed by its floor where it has one."""
    return ["plain", *(m for s in schedules for m in (s, floor_of(s)) if m is not None)]


def method(name: str) -> Method:
    """The step of any method by name: plain, whole, a floor, an exact schedule (run on a compiled model under its
    "compiled ..." name, `_steps.compiled_model`), the compiled plain and floor (plain accumulation, compiled)."""
    if name in ("plain", "whole", COMPILED_PLAIN, COMPILED_FLOOR):
        return whole_step if name == "whole" else plain_step
    spec = parse_spec(name.removeprefix("compiled "))
    if spec.schedule in _BY_FLOOR_NAME:
        return _BY_FLOOR_NAME[spec.schedule].make(**dict(spec.settings))
    return schedule_step(str(spec))


def methods(schedules: list[str]) -> dict[str, Method]:
    """Every method a run of `schedules` names: plain, the whole batch, each schedule and its floor, each of them
    compiled (`_steps.compiled_methods`)."""
    names = ["whole", *timed_methods(schedules), COMPILED_PLAIN, COMPILED_FLOOR, *map(compiled, schedules)]
    return {n: method(n) for n in names if relative_budget(n) is None}  # the others' budgets are per K


def parse_schedules(text: str) -> tuple[list[str], dict[str, str]]:
    """A comma-separated list of schedules with their settings, each by its canonical name, in two parts: those
    accumnorm.backward takes, in their order, and those it does not, each with why (`refusal`). ValueError for a
    name no schedule can have, or one given twice."""
    names = [str(parse_spec(part)) for part in text.split(",") if part.strip()]
    for name in names:
        if parse_spec(name).schedule in RESERVED or name.startswith("compiled"):
            raise ValueError(f"{name!r} is the name of a method of the benchmark's own, not of a schedule")
    if len(set(names)) < len(names):
        raise ValueError(f"a schedule given twice in {text!r}")
    refused = {n: why for n in names if (why := refusal(n)) is not None}
    return [n for n in names if n not in refused], refused
