"""The study's answer as a table (summary.md), a figure (curves.png) and one page with both (report.html).

The table is the study's: rows are norms, columns are BxK configs, each cell the mean
validation accuracy over the evaluations after step `StudySettings.average_after` (250 by
default), averaged over runs, with the spread
(standard deviation across runs). The figure is the study's too: validation accuracy against
step, one panel per norm, one line per config, the mean over runs with a band from the worst
to the best run.
"""
from __future__ import annotations

import base64
import html
import io
import math
import platform
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ._settings import StudySettings, parse_config
from ._store import atomic_write

__all__ = ["write_report", "write_files", "summary_cells", "grid_table", "cell_results", "finding", "versus",
           "curves_png", "config_label", "Cell"]


def config_label(b: int, k: int) -> str:
    return f"bs{b} x {k}"


class Cell(NamedTuple):
    """A cell's result: mean over runs of each run's mean accuracy in the window, its spread, the runs counted."""

    mean: float
    spread: float
    runs: int


def cell_results(rows: list[dict[str, Any]], after: int) -> dict[tuple[str, int, int], Cell]:
    """(norm, B, K) -> Cell, for the cells with an evaluation after step `after`."""
    per_run = defaultdict(lambda: defaultdict(list))  # (norm, B, K) -> run -> accuracies after `after`
    for r in rows:
        if r["iter"] > after:
            per_run[(r["norm"], r["batch_size"], r["num_accum"])][r["run"]].append(r["valid_acc"])
    cells = {}
    for key, runs in per_run.items():
        means = [statistics.fmean(v) for v in runs.values()]
        cells[key] = Cell(statistics.fmean(means), statistics.stdev(means) if len(means) > 1 else 0.0, len(means))
    return cells


def summary_cells(settings: StudySettings, rows: list[dict[str, Any]],
                  failures: dict[tuple[str, int, int], str]) -> list[list[str]]:
    """The table as strings: a header row, then one row per norm."""
    after = settings.window()
    return grid_table(settings.norms, [parse_config(c) for c in settings.configs], cell_results(rows, after), failures,
                      settings.runs, missing=f"n/a (no evaluation after step {after})")


Key = tuple[str, int, int]


def grid_table(names: Sequence[str], configs: Sequence[tuple[int, int]], results: dict[Key, Cell],
               failures: dict[Key, str], runs: int, first: str = "norm",
               key: Callable[[str, int, int], Key] = lambda name, b, k: (name, b, k),
               missing: str = "n/a") -> list[list[str]]:
    """A header row (`first`, then one column per BxK config), then one row per name; `key` says which cell's
    result stands at (name, B, K) (a method that ignores the split shows the same cell in every column)."""
    table = [[first] + [config_label(b, k) for b, k in configs]]
    for name in names:
        line = [name]
        for b, k in configs:
            cell = key(name, b, k)
            result = results.get(cell)
            if cell in failures:
                line.append(f"failed: {failures[cell]}")
            elif result is None:
                line.append(missing)
            else:
                partial = f" ({result.runs}/{runs} runs)" if result.runs != runs else ""
                line.append(f"{result.mean:.3f} ± {result.spread:.3f}{partial}")
        table.append(line)
    return table


def finding(settings: StudySettings, rows: list[dict[str, Any]]) -> str | None:
    """One sentence on what the table shows about BatchNorm under accumulation, when the grid can tell.

    It needs bn at an accumulated config BxK (K > 1) and at the same batch in one go (B*K x 1);
    with bn-exact at BxK too, it also says whether exact accumulation gets the big batch's accuracy.
    A difference counts when it is larger than twice the larger spread over runs of the two cells.
    """
    configs = [parse_config(c) for c in settings.configs]
    results = {key: cell for key, cell in cell_results(rows, settings.window()).items()
               if key[0] in settings.norms and key[1:] in configs}
    for b, k in configs:
        small, big = results.get(("bn", b, k)), results.get(("bn", b * k, 1))
        if k == 1 or small is None or big is None:
            continue
        acc, one_go = config_label(b, k), config_label(b * k, 1)
        text = (f"torch's BatchNorm (bn) at {acc} reaches {small.mean:.3f} validation accuracy against "
                f"{big.mean:.3f} for the same batch in one go ({one_go}), {versus(small, big)}")
        exact = results.get(("bn-exact", b, k))
        if exact is not None:
            text += (f"; accumnorm's exact BatchNorm (bn-exact) at {acc} reaches {exact.mean:.3f}, "
                     f"{versus(exact, small)}, and {exact.mean - big.mean:+.3f} from the batch in one go")
        return text + "."
    return None


def versus(a: Cell, b: Cell) -> str:
    """a's mean minus b's, and whether that is more than twice the larger spread over runs of the two."""
    gap, noise = a.mean - b.mean, 2 * max(a.spread, b.spread)
    if min(a.runs, b.runs) < 2:
        return f"{gap:+.3f} (one run: no spread over runs to weigh it against)"
    return f"{gap:+.3f}, {'more' if abs(gap) > noise else 'not more'} than twice the spread over runs ({noise:.3f})"


def write_report(out: Path, settings: StudySettings, rows: list[dict[str, Any]],
                 failures: dict[tuple[str, int, int], str], device: str, workers: int = 1,
                 threads: int | None = None) -> None:
    """Write summary.md, curves.png and report.html into `out` from the results rows.

    `workers` processes of `threads` torch threads each (default: this process's) trained the cells.
    """
    table = summary_cells(settings, rows, failures)
    caption = (f"Mean validation accuracy after step {settings.window()} (mean ± std over {settings.runs} runs), "
               f"{settings.dataset}, {settings.iterations} steps, Adam lr {settings.lr}, "
               f"evaluation every {settings.eval_every} steps.")
    configs = [parse_config(c) for c in settings.configs]
    png = curves_png({name: configs for name in settings.norms}, rows, "valid acc")
    write_files(out, "Normalization under gradient accumulation", caption, table, finding(settings, rows), png,
                settings.to_json(), device=device, workers=workers, threads=threads)


def write_files(out: Path, title: str, caption: str, table: list[list[str]], sentence: str | None, png: bytes,
                settings: dict[str, Any], device: str, workers: int = 1, threads: int | None = None) -> None:
    """Write summary.md (title, caption, table, sentence), curves.png and report.html (all of them and the
    settings) into `out`, each file replaced whole."""
    md = ["| " + " | ".join(table[0]) + " |", "|" + "---|" * len(table[0])]
    md += ["| " + " | ".join(line) + " |" for line in table[1:]]
    conclusion = f"\n{sentence}\n" if sentence else ""
    atomic_write(out / "summary.md", f"# {title}\n\n{caption}\n\n" + "\n".join(md) + "\n" + conclusion)
    atomic_write(out / "curves.png", png)

    info = {**settings, "device": device, "torch": torch.__version__, "workers": workers,
            "threads per worker": threads or torch.get_num_threads(),
            "python": platform.python_version()}
    cell = lambda tag, text: f"<{tag}>{html.escape(str(text))}</{tag}>"  # noqa: E731
    head = "<tr>" + "".join(cell("th", t) for t in table[0]) + "</tr>"
    body = "".join("<tr>" + "".join(cell("td", t) for t in line) + "</tr>" for line in table[1:])
    setting_rows = "".join(f"<tr>{cell('th', k)}{cell('td', v)}</tr>" for k, v in info.items())
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>accumnorm study</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}} table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #bbb;padding:4px 8px;text-align:left}} img{{max-width:100%}}</style></head>
<body><h1>{html.escape(title)}</h1>
<p>{html.escape(caption)}</p>
<table>{head}{body}</table>
{f"<p>{html.escape(sentence)}</p>" if sentence else ""}
<img alt="validation accuracy against step" src="data:image/png;base64,{base64.b64encode(png).decode()}">
<h2>Settings</h2><table>{setting_rows}</table>
</body></html>
"""
    atomic_write(out / "report.html", page)


def curves_png(panels: dict[str, Sequence[tuple[int, int]]], rows: list[dict[str, Any]], ylabel: str) -> bytes:
    """The figure as PNG bytes: one panel per name of `panels`, one line per BxK config it lists, each the mean over
    runs with a min-max band."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    curves = defaultdict(lambda: defaultdict(list))  # (norm, B, K) -> step -> accuracies over runs
    for r in rows:
        curves[(r["norm"], r["batch_size"], r["num_accum"])][r["iter"]].append(r["valid_acc"])
    cols = min(3, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3.4 * nrows), squeeze=False, sharey=True)
    for ax, (name, configs) in zip(axes.flat, panels.items()):
        for b, k in configs:
            points = sorted(curves[(name, b, k)].items())
            if not points:
                continue  # failed or not run: the table says why
            steps = [s for s, _ in points]
            ax.plot(steps, [statistics.fmean(a) for _, a in points], label=config_label(b, k))
            ax.fill_between(steps, [min(a) for _, a in points], [max(a) for _, a in points], alpha=0.2)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()
