"""bench_backward.py's tables: one row per model and K, each figure beside its ratio to plain accumulation's.

The full table gives every figure; the summary gives, for one K, the ratios alone, one row per model (the
short table a README can hold).
"""
from __future__ import annotations

from collections.abc import Callable

from _memory import Memory
from _models import BATCH
from _steps import timed_methods

# (median seconds, median ratio to plain), or why there is none
Timing = tuple[float, float] | str
Column = tuple[str, Callable[["Row"], str]]


def mib(n: int) -> str:
    return f"{n / 2**20:.0f}" if n >= 10 * 2**20 else f"{n / 2**20:.1f}"


class Row:
    """One model at one K: each method's memory (fresh processes) and time (per thread count)."""

    def __init__(self, name: str, calls: int, k: int, memory: dict[str, Memory | str],
                 timing: dict[int, dict[str, Timing]]) -> None:
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

    def time(self, m: str) -> str:
        """Plain's milliseconds, or m's ratio to plain, at each thread count."""
        cells = []
        for by_method in self.timing.values():
            got = by_method.get(m, "-")
            if isinstance(got, str):
                cells.append(got)
            elif got[0] != got[0]:  # not timed
                cells.append("-")
            else:
                cells.append(f"{got[0] * 1e3:.0f}" if m == "plain" else f"{got[1]:.2f}x")
        return " / ".join(cells) if cells else "-"

    def figures(self, methods: list[str], field: str) -> str:
        return " / ".join(mib(getattr(v, field)) if isinstance(v := self.memory.get(m, "-"), Memory) else v
                          for m in methods)


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
                     (f"host MiB {'/'.join(schedules)}", lambda r: r.figures(schedules, "moved"))])


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
