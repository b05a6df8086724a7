"""bench_backward.py's tables: one row per model and K, each figure beside its ratio to plain accumulation's.

The full table gives every figure; the summary gives, for one K, the ratios alone, one row per model (the
short table a README can hold). With --compile, the compile table gives the compiled methods' times as ratios to
compiled plain accumulation's, each exact schedule's also to the compiled floor's, and each compiled model's first
(compiling) step in seconds.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable

from _memory import Memory
from _methods import schedule_of, timed_methods
from _models import BATCH
from _steps import COMPILED_FLOOR, COMPILED_PLAIN, compiled

Column = tuple[str, Callable[["Row"], str]]


def mib(n: int) -> str:
    return f"{n / 2**20:.0f}" if n >= 10 * 2**20 else f"{n / 2**20:.1f}"


class Times:
    """The timed rounds of one model at one K and thread count: each method's time in each round (None where it
    was not timed) or why it has none ("failed", "n/a", "skipped ..."), and the time of its first, untimed step
    (for a compiled model, the step that compiles it)."""

    def __init__(self, rounds: dict[str, list[float | None] | str], first: dict[str, float]) -> None:
        self.rounds, self.first = rounds, first

    def median(self, m: str) -> float | str:
        """m's median time; nan if it was not timed."""
        got = self.rounds.get(m, "-")
        if isinstance(got, str):
            return got
        timed = [t for t in got if t is not None]
        return statistics.median(timed) if timed else float("nan")

    def ratio(self, m: str, over: str = "plain") -> float | str:
        """The median over rounds of m's time over `over`'s in the same round (the machine's speed drifts; a ratio
        within one round cancels it); nan if they share no timed round."""
        got, base = self.rounds.get(m, "-"), self.rounds.get(over, "-")
        if isinstance(got, str):
            return got
        if isinstance(base, str):
            return "-"
        ratios = [t / b for t, b in zip(got, base) if t is not None and b is not None]
        return statistics.median(ratios) if ratios else float("nan")


def _cell(value: float | str, fmt: str, unit: str = "") -> str:
    if isinstance(value, str):
        return value
    return "-" if value != value else format(value, fmt) + unit  # nan: not timed


class Row:
    """One model at one K: each method's memory (fresh processes) and time (per thread count)."""

    def __init__(self, name: str, calls: int, k: int, memory: dict[str, Memory | str],
                 timing: dict[int, Times]) -> None:
        self.name, self.calls, self.k, self.memory, self.timing = name, calls, k, memory, timing

    def ratio(self, m: str) -> str:
        """m's peak over plain's."""
        got, plain = self.memory.get(m, "-"), self.memory.get("plain")
        if isinstance(got, str):
            return got
        return f"{got.peak / plain.peak:.2f}x" if isinstance(plain, Memory) else "-"

    def peak(self, m: str) -> str:
        got = self.memory.get(m, "-")
        if isinstance(got, str) or m == "plain":
            return got if isinstance(got, str) else mib(got.peak)
        return f"{mib(got.peak)} ({self.ratio(m)})"

    def time(self, m: str, over: str = "plain") -> str:
        """m's milliseconds if it is `over`, else its ratio to `over`'s, at each thread count."""
        def cell(t: Times) -> str:
            if m != over:
                return _cell(t.ratio(m, over), ".2f", "x")
            got = t.median(m)
            return _cell(got * 1e3 if isinstance(got, float) else got, ".0f")
        return self._per_thread(cell)

    def first_step(self, m: str) -> str:
        """The seconds of m's first step (a compiled model's compiling step) at each thread count."""
        return self._per_thread(lambda t: _cell(t.first.get(m, "-"), ".1f"))

    def _per_thread(self, cell: Callable[[Times], str]) -> str:
        return " / ".join(cell(t) for t in self.timing.values()) or "-"

    def ran(self, m: str) -> str:
        """The schedule m ran in its memory runs (auto's choice), with its setting."""
        got = self.memory.get(m, "-")
        return got if isinstance(got, str) else got.ran or "-"

    def figures(self, methods: list[str], field: str) -> str:
        return " / ".join(mib(getattr(v, field)) if isinstance(v := self.memory.get(m, "-"), Memory) else v
                          for m in methods)

    def to_json(self) -> dict:
        """Every figure of the row, in JSON's types: bytes, seconds, and the words of those not measured."""
        return {"model": self.name, "bn_calls": self.calls, "k": self.k, "micro": BATCH // self.k,
                "memory": {m: v if isinstance(v, str) else v._asdict() for m, v in self.memory.items()},
                "timing": {str(t): {"rounds": times.rounds, "first": times.first} for t, times in self.timing.items()}}

    @classmethod
    def from_json(cls, row: dict) -> Row:
        memory = {m: v if isinstance(v, str) else Memory(v["peak"], v["saved"], v["moved"], tuple(v["peaks"]),
                                                         v.get("ran", ""))
                  for m, v in row["memory"].items()}
        timing = {int(t): Times(times["rounds"], times["first"]) for t, times in row["timing"].items()}
        return cls(row["model"], row["bn_calls"], row["k"], memory, timing)


def _first(cols: list[Column]) -> list[Column]:
    return [("model", lambda r: r.name), ("BN", lambda r: str(r.calls)),
            ("K x b", lambda r: f"{r.k}x{BATCH // r.k}")] + cols


def columns(schedules: list[str], threads: list[int]) -> list[Column]:
    """The full table's (header, cell) pairs for the schedules shown."""
    per = " " + "/".join(f"{t}t" for t in threads) if threads else ""
    memory = ["plain", "whole", *schedules]
    return _first([(f"{m} peak MiB", lambda r, m=m: r.peak(m)) for m in memory]
                  + [(f"plain ms{per}", lambda r: r.time("plain"))]
                  + [(f"{m} time{per}", lambda r, m=m: r.time(m)) for m in timed_methods(schedules)[1:]]
                  + [(f"saved MiB {'/'.join(memory)}", lambda r: r.figures(memory, "saved")),
                     (f"host MiB {'/'.join(schedules)}", lambda r: r.figures(schedules, "moved"))]
                  + [(f"{m} ran", lambda r, m=m: r.ran(m)) for m in schedules if schedule_of(m) == "auto"])


def compile_columns(schedules: list[str], threads: list[int]) -> list[Column]:
    """The compile table's: compiled plain's milliseconds and its ratio to eager plain's; the compiled floor and
    each schedule, compiled and eager, over compiled plain; each compiled schedule over the compiled floor; the
    first steps' seconds."""
    per = " " + "/".join(f"{t}t" for t in threads) if threads else ""
    return _first([(f"c.plain ms{per}", lambda r: r.time(COMPILED_PLAIN, COMPILED_PLAIN)),
                   (f"c.plain/plain{per}", lambda r: r.time(COMPILED_PLAIN))]
                  + [(f"{short(m)}{per}", lambda r, m=m: r.time(m, COMPILED_PLAIN))
                     for m in [COMPILED_FLOOR, *(compiled(s) for s in schedules), *schedules]]
                  + [(f"{short(compiled(s))}/floor{per}", lambda r, s=s: r.time(compiled(s), COMPILED_FLOOR))
                     for s in schedules]
                  + [(f"{short(m)} 1st s{per}", lambda r, m=m: r.first_step(m))
                     for m in [COMPILED_PLAIN, *(compiled(s) for s in schedules)]])


def short(method: str) -> str:
    """A compiled method's name in a column's header: "compiled plain" -> "c.plain"."""
    return method.replace("compiled ", "c.")


def summary_columns(schedules: list[str], threads: list[int]) -> list[Column]:
    """The summary's: peak and time as ratios to plain only."""
    per = " " + "/".join(f"{t}t" for t in threads) if threads else ""
    return _first([(f"{m} peak", lambda r, m=m: r.ratio(m)) for m in ["whole", *schedules]]
                  + [(f"{m} time{per}", lambda r, m=m: r.time(m)) for m in timed_methods(schedules)[1:]])


def table(cols: list[Column], rows: list[Row], markdown: bool) -> list[str]:
    lines = [line([h for h, _ in cols], markdown)]
    if markdown:
        lines.append(line(["---"] * len(cols), True))
    return lines + [line([cell(r) for _, cell in cols], markdown) for r in rows]


def line(cells: list[str], markdown: bool) -> str:
    if markdown:
        return "| " + " | ".join(cells) + " |"
    return cells[0].ljust(18) + "".join(c.rjust(max(14, len(c) + 2)) for c in cells[1:])
