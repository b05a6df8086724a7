"""The SimCLR task's answer: summary.md, curves.png and report.html, written by report.py's machinery.

The table: rows are methods, columns BxK configs, each cell the linear-probe validation accuracy at the last
evaluation, mean ± std over runs. bn-whole trains the B*K samples in one go, so its cell is the same in every
column of one effective batch size. The sentence compares every method with bn-whole at each accumulated
config, and bn-exact with bn-whole run by run (same seed, same weights, same views: they compute the same
gradients, so they differ only by float rounding, amplified over training).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ._report import Cell, cell_results, config_label, curves_png, grid_table, versus, write_files
from ._settings import WHOLE, SimCLRSettings, parse_config, whole_cell

__all__ = ["write_report", "finding", "last_evaluation"]


def last_evaluation(settings: SimCLRSettings) -> int:
    """The step of each run's last linear probe, the one the table reports."""
    return settings.iterations // settings.eval_every * settings.eval_every


def write_report(out: Path, settings: SimCLRSettings, rows: list[dict[str, Any]],
                 failures: dict[tuple[str, int, int], str], device: str, workers: int = 1,
                 threads: int | None = None) -> None:
    """Write summary.md, curves.png and report.html into `out` from the results rows."""
    last = last_evaluation(settings)
    results = cell_results(rows, after=last - 1)
    configs = [parse_config(c) for c in settings.configs]
    table = grid_table(settings.methods, configs, results, failures, settings.runs, first="method", key=whole_cell,
                       missing=f"n/a (no evaluation at step {last})")
    caption = (f"Linear-probe validation accuracy at step {last} (mean ± std over {settings.runs} runs): SimCLR on "
               f"{settings.dataset}, NT-Xent at temperature {settings.temperature}, Adam lr {settings.lr}, "
               f"{settings.iterations} steps, a probe every {settings.eval_every}. A probe is a logistic regression "
               "on the frozen encoder's features of the training images, scored on the validation images. "
               f"{WHOLE} trains each batch in one go: one run per effective batch size, the same in every column "
               "of that size.")
    panels = {name: list(dict.fromkeys(whole_cell(name, b, k)[1:] for b, k in configs)) for name in settings.methods}
    write_files(out, "SimCLR under gradient accumulation", caption, table, finding(settings, rows),
                curves_png(panels, rows, "linear-probe acc"), settings.to_json(), device=device, workers=workers,
                threads=threads)


def finding(settings: SimCLRSettings, rows: list[dict[str, Any]]) -> str | None:
    """What the table says, config by config, against bn-whole; None when bn-whole or accumulation is missing."""
    last = last_evaluation(settings)
    results: dict[tuple[str, int, int], Cell] = cell_results(rows, after=last - 1)
    final = {(r["norm"], r["batch_size"], r["num_accum"], r["run"]): r["valid_acc"] for r in rows if r["iter"] == last}
    sentences = []
    for b, k in (parse_config(c) for c in settings.configs):
        whole = results.get(whole_cell(WHOLE, b, k))
        others = [(name, results[(name, b, k)]) for name in settings.methods if (name, b, k) in results]
        if k == 1 or whole is None or not others:
            continue
        parts = [f"{name} {cell.mean:.3f} ({versus(cell, whole)})" for name, cell in others if name != WHOLE]
        text = f"At {config_label(b, k)}, against {whole.mean:.3f} for the whole batch in one go ({WHOLE}): "
        text += "; ".join(parts) + "."
        pairs = [abs(final[("bn-exact", b, k, r)] - final[(WHOLE, b * k, 1, r)]) for r in range(settings.runs)
                 if ("bn-exact", b, k, r) in final and (WHOLE, b * k, 1, r) in final]
        if pairs:
            text += (f" Run by run (same seed, weights and views), bn-exact and {WHOLE} differ by at most "
                     f"{max(pairs):.3f}.")
        sentences.append(text)
    return " ".join(sentences) or None
