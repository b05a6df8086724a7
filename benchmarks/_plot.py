"""bench_backward.py's frontier pictures, and its dump of every figure (JSON) that they can be redrawn from.

A frontier picture is one K's: a panel per model, each exact schedule a point at its time (x) and its peak memory
(y), both as ratios to plain accumulation's (plain itself at 1x, 1x), on log scales: below and left is better.
Plain, layerwise, recompute and passes have markers of their own; a schedule given with several settings
("segments:keep_every=1,segments:keep_every=2") has one colour, its points joined by a line in the order --schedules
gave them, each labelled with its settings; "auto" with a budget relative to plain's peak
(`auto:memory_budget=1.5x`) is labelled with the schedule it ran, under a dotted line at its budget. The time is the
first of --threads' (the dump holds every thread count's). A method with no figure (skipped, failed, not measured)
has no point; the panel says why, but an "auto" timed apart from its memory (its budget is plain's peak in the same
run): it is placed at the time of the schedule it ran, timed under that schedule's own name. The floors are time
alone and have no point; the dump has them.

    python benchmarks/_plot.py results.json pictures/    # redraw the pictures of a --json dump
    python benchmarks/_plot.py time.json memory.json pictures/    # of runs that measured time and memory apart
"""
from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from typing import Any

from _memory import Memory
from _methods import parse_spec, relative_budget
from _models import BATCH
from _table import Row, mib

# (marker, colour) of the schedules shown from the start; any other schedule takes the next colour of OTHERS.
STYLES = {"plain": ("*", "black"), "layerwise": ("o", "tab:blue"), "recompute": ("s", "tab:orange"),
          "passes": ("^", "tab:green")}
OTHERS = ("tab:purple", "tab:red", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")


def require_matplotlib(error: Callable[[str], Any]) -> None:
    """Call `error` with what to install if matplotlib is missing: checked before a run, not after hours of it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        error("--plot needs matplotlib, which is not installed: pip install matplotlib (or accumnorm[study])")


def dump(path: str, header: str, schedules: list[str], rows: list[Row]) -> None:
    """Every figure of `rows` to `path` as JSON, with the run's header and its schedules in their order."""
    with open(path, "w") as f:
        json.dump({"header": header, "batch": BATCH, "schedules": schedules, "rows": [r.to_json() for r in rows]},
                  f, indent=1)


def load(path: str) -> tuple[str, list[str], list[Row]]:
    """A dump's header, schedules and rows."""
    with open(path) as f:
        data = json.load(f)
    return data["header"], data["schedules"], [Row.from_json(r) for r in data["rows"]]


def load_joined(paths: list[str]) -> tuple[list[str], list[Row]]:
    """Several dumps' schedules (each once, in order) and rows, joined: a model at a K in more than one dump is one
    row, each figure from the first dump that measured it (memory and time measured in runs of their own)."""
    schedules: list[str] = []
    rows: dict[tuple[str, int], Row] = {}
    for path in paths:
        _, theirs, loaded = load(path)
        schedules += [s for s in theirs if s not in schedules]
        for row in loaded:
            have = rows.setdefault((row.name, row.k), row)
            if have is row:
                continue
            for method, figure in row.memory.items():
                if not isinstance(have.memory.get(method), Memory):  # none yet, or only why there is none
                    have.memory[method] = figure
            for threads, times in row.timing.items():
                have.timing.setdefault(threads, times)
    return schedules, list(rows.values())


def point(row: Row, method: str) -> tuple[float, float] | str:
    """`method`'s (time, peak) as ratios to plain's at the row's first thread count, or why it has none."""
    memory, plain = row.memory.get(method, "not measured"), row.memory.get("plain")
    if isinstance(memory, str) or not isinstance(plain, Memory):
        return memory if isinstance(memory, str) else "plain's memory not measured"
    if not row.timing:
        return "not timed"
    timing = next(iter(row.timing.values()))
    time = timing.ratio(method)
    if isinstance(time, str) and relative_budget(method) is not None and memory.ran:
        time = timing.ratio(method_of(memory.ran))  # untimed "auto": at the time of the schedule it ran
    if isinstance(time, str) or math.isnan(time):
        return time if isinstance(time, str) else "not timed"
    return time, memory.peak / plain.peak


def method_of(label: str) -> str:
    """The method name of a schedule as `accumnorm.last_schedule` labels it: "segments(keep_every=2)" is
    "segments:keep_every=2"."""
    schedule, _, settings = label.partition("(")
    return str(parse_spec(":".join([schedule, *settings.rstrip(")").split(",")]) if settings else schedule))


def frontiers(rows: list[Row], schedules: list[str], directory: str) -> list[str]:
    """Each K's picture (module doc), as DIR/frontier-K<k>.png and .svg; the paths written."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    os.makedirs(directory, exist_ok=True)
    groups: dict[str, list[str]] = {}  # schedule -> its methods, in the order given
    for s in schedules:
        groups.setdefault(parse_spec(s).schedule, []).append(s)
    others = iter(OTHERS * len(groups))
    styles = {g: STYLES.get(g) or ("D", next(others)) for g in ["plain", *groups]}
    paths = []
    for k in sorted({r.k for r in rows}):
        at_k = [r for r in rows if r.k == k]
        cols = min(3, len(at_k))
        fig = Figure(figsize=(4.6 * cols, 3.9 * math.ceil(len(at_k) / cols) + 0.6), constrained_layout=True)
        for i, row in enumerate(at_k):
            ax = fig.add_subplot(math.ceil(len(at_k) / cols), cols, i + 1)
            _panel(ax, row, groups, styles)
        threads = next((t for r in at_k for t in r.timing), None)
        fig.suptitle(f"K = {k}: {k} micro-batches of {BATCH // k}. Peak memory and time as ratios to plain "
                     f"accumulation's\n(time at {threads} thread{'s' * (threads != 1)}; lower left is better)")
        fig.axes[0].legend(handles=[Line2D([], [], marker=m, color=c, linestyle="", label=g)
                                    for g, (m, c) in styles.items()], fontsize=7, loc="best")
        for ext in ("png", "svg"):
            paths.append(os.path.join(directory, f"frontier-K{k}.{ext}"))
            fig.savefig(paths[-1], dpi=110)
    return paths


def _panel(ax: Any, row: Row, groups: dict[str, list[str]], styles: dict[str, tuple[str, str]]) -> None:
    """One model's points at one K."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain, times = row.memory.get("plain"), next(iter(row.timing.values()), None)
    ms = times.median("plain") if times else "-"
    ax.set_title(f"{row.name} ({row.calls} BN), {row.k}x{BATCH // row.k}: plain "
                 + (f"{mib(plain.peak)} MiB" if isinstance(plain, Memory) else "-") + ", "
                 + (f"{ms * 1e3:.0f} ms" if isinstance(ms, float) and ms == ms else "-"), fontsize=9)
    ax.set_xlabel("time / plain's", fontsize=8)
    ax.set_ylabel("peak / plain's", fontsize=8)
    ax.plot([1], [1], marker=styles["plain"][0], color=styles["plain"][1], markersize=11, linestyle="")
    missing = []
    for group, names in groups.items():
        marker, colour = styles[group]
        got = [(n, p) for n in names if not isinstance(p := point(row, n), str)]
        missing += [f"{n}: {p}" for n in names if isinstance(p := point(row, n), str)]
        if got:
            ax.plot([p[0] for _, p in got], [p[1] for _, p in got], marker=marker, color=colour,
                    linestyle="-" if len(got) > 1 else "", linewidth=1)
        for n, (x, y) in got:
            if parse_spec(n).settings:
                below = group == "auto"  # apart from the schedule it ran, often at its point
                ax.annotate(_label(row, n), (x, y), textcoords="offset points", xytext=(4, -11 if below else 4),
                            fontsize=7, color=colour)
        for n in names:
            factor = relative_budget(n)
            if factor is not None:  # the line its points must stay under
                ax.axhline(factor, color=colour, linestyle=":", linewidth=1)
    ax.margins(0.15)
    ax.autoscale_view()
    ax.minorticks_off()
    for ticks, limits in ((ax.set_xticks, ax.get_xlim()), (ax.set_yticks, ax.get_ylim())):
        at = _ticks(*limits)
        ticks(at, [f"{v:g}x" for v in at])
    if missing:
        ax.text(0.98, 0.02, "\n".join(missing), transform=ax.transAxes, ha="right", va="bottom", fontsize=6,
                color="dimgray")
    ax.grid(True, which="both", linewidth=0.3)


def _label(row: Row, method: str) -> str:
    """A point's label: its settings; for "auto", the schedule it ran (`Memory.ran`), its budget being the line."""
    memory = row.memory.get(method)
    if parse_spec(method).schedule == "auto" and isinstance(memory, Memory) and memory.ran:
        return f"ran {memory.ran}"
    return method.partition(":")[2]


# Round ratios per decade, finest first: the ticks of log axes that may span a tenth of a decade or several.
_ROUND = ((1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8), (1, 1.5, 2, 3, 5, 7), (1, 2, 5), (1,))


def _ticks(low: float, high: float, most: int = 7) -> list[float]:
    """The finest of the round ratios between `low` and `high` of which there are `most` at most."""
    for per_decade in _ROUND:
        inside = [v for e in range(-2, 4) for m in per_decade if low <= (v := round(m * 10.0**e, 3)) <= high]
        if len(inside) <= most:
            return inside
    return inside


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dumps", nargs="+", metavar="dump",
                   help="JSON files of bench_backward.py --json; several are joined (`load_joined`)")
    p.add_argument("directory", help="where the pictures go")
    args = p.parse_args(argv)
    require_matplotlib(p.error)
    schedules, rows = load_joined(args.dumps)
    print(*(f"wrote {path}" for path in frontiers(rows, schedules, args.directory)), sep="\n")


if __name__ == "__main__":
    main()
