"""The study's answer as a table (summary.md), a figure (curves.png) and one page with both (report.html).

The table is the study's: rows are norms, columns are BxK configs, each cell the mean
validation accuracy over the evaluations after step 250, averaged over runs, with the spread
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
from pathlib import Path
from typing import Any

import torch

from .settings import StudySettings, parse_config
from .store import atomic_write

AFTER_STEP = 250  # the study averages the evaluations after this step: the first ones are still warming up


def config_label(b: int, k: int) -> str:
    return f"bs{b} x {k}"


def summary_cells(settings: StudySettings, rows: list[dict[str, Any]], failures: dict[tuple[str, int, int], str]) -> list[list[str]]:
    """The table as strings: a header row, then one row per norm."""
    per_run = defaultdict(list)  # (norm, B, K) -> run -> accuracies after AFTER_STEP
    for r in rows:
        if r["iter"] > AFTER_STEP:
            per_run[(r["norm"], r["batch_size"], r["num_accum"])].append((r["run"], r["valid_acc"]))
    configs = [parse_config(c) for c in settings.configs]
    table = [["norm"] + [config_label(b, k) for b, k in configs]]
    for name in settings.norms:
        line = [name]
        for b, k in configs:
            if (name, b, k) in failures:
                line.append(f"failed: {failures[(name, b, k)]}")
                continue
            runs = defaultdict(list)
            for run, acc in per_run[(name, b, k)]:
                runs[run].append(acc)
            means = [statistics.fmean(v) for v in runs.values()]
            if not means:
                line.append(f"n/a (no evaluation after step {AFTER_STEP})")
                continue
            spread = statistics.stdev(means) if len(means) > 1 else 0.0
            partial = f" ({len(means)}/{settings.runs} runs)" if len(means) != settings.runs else ""
            line.append(f"{statistics.fmean(means):.3f} ± {spread:.3f}{partial}")
        table.append(line)
    return table


def write_report(out: Path, settings: StudySettings, rows: list[dict[str, Any]], failures: dict[tuple[str, int, int], str],
                 device: str, workers: int = 1, threads: int | None = None) -> None:
    """Write summary.md, curves.png and report.html into `out` from the results rows.

    `workers` processes of `threads` torch threads each (default: this process's) trained the cells.
    """
    table = summary_cells(settings, rows, failures)
    caption = (f"Mean validation accuracy after step {AFTER_STEP} (mean ± std over {settings.runs} runs), "
               f"{settings.dataset}, {settings.iterations} steps, Adam lr {settings.lr}, "
               f"evaluation every {settings.eval_every} steps.")
    md = ["| " + " | ".join(table[0]) + " |", "|" + "---|" * len(table[0])]
    md += ["| " + " | ".join(line) + " |" for line in table[1:]]
    atomic_write(out / "summary.md", f"# Normalization under gradient accumulation\n\n{caption}\n\n" + "\n".join(md) + "\n")

    png = _curves_png(settings, rows)
    atomic_write(out / "curves.png", png)

    info = {**settings.to_json(), "device": device, "torch": torch.__version__, "workers": workers,
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
<body><h1>Normalization under gradient accumulation</h1>
<p>{html.escape(caption)}</p>
<table>{head}{body}</table>
<img alt="validation accuracy against step" src="data:image/png;base64,{base64.b64encode(png).decode()}">
<h2>Settings</h2><table>{setting_rows}</table>
</body></html>
"""
    atomic_write(out / "report.html", page)


def _curves_png(settings: StudySettings, rows: list[dict[str, Any]]) -> bytes:
    """The figure as PNG bytes: one panel per norm, one line per config, mean over runs and min-max band."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    curves = defaultdict(lambda: defaultdict(list))  # (norm, B, K) -> step -> accuracies over runs
    for r in rows:
        curves[(r["norm"], r["batch_size"], r["num_accum"])][r["iter"]].append(r["valid_acc"])
    cols = min(3, len(settings.norms))
    nrows = math.ceil(len(settings.norms) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3.4 * nrows), squeeze=False, sharey=True)
    for ax, name in zip(axes.flat, settings.norms):
        for b, k in (parse_config(c) for c in settings.configs):
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
        ax.set_ylabel("valid acc")
    for ax in list(axes.flat)[len(settings.norms):]:
        ax.set_visible(False)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()
