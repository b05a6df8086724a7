"""The `accumnorm` command. `accumnorm study --quick` reruns a small normalization-under-accumulation study;
`accumnorm study --task simclr` measures contrastive learning under accumulation."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

# A small offline grid that shows the finding in minutes on 2 CPU cores. BatchNorm breaks at micro-batch 1: on the
# 8x8 digits the last feature map is 1x1 and torch's BatchNorm cannot run there at all, so the digits are upscaled
# to 16x16 (last map 2x2). 1x16 against 16x1 is the study's pair; bn-exact's 1x16 cell is the grid's longest task
# (it gets a worker of its own). 3 runs give a spread; the table averages the evaluations after step 130 (half the
# run).
QUICK = dict(dataset="digits16", norms="bn,bn-exact,gn4", configs="16x1,1x16", runs=3, iterations=260, eval_every=65)
# --task simclr --quick: every method at 4x4 on the same offline digits, 2 runs of 10 steps: a demo of the files,
# too short to separate the methods (docs/study/simclr.md has the real study).
SIMCLR_QUICK = dict(dataset="digits16", configs="4x4", runs=2, iterations=10, eval_every=5)
QUICKS = {"bn": QUICK, "simclr": SIMCLR_QUICK}
ONLY = {"norms": "bn", "average_after": "bn", "methods": "simclr", "temperature": "simclr"}  # options of one task


def _parser() -> argparse.ArgumentParser:
    from accumnorm.study import SimCLRSettings, StudySettings

    d, c = StudySettings(), SimCLRSettings()
    p = argparse.ArgumentParser(prog="accumnorm", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("study", help="train every norm x BxK config x run and write a table, curves and a report",
                       description="Rerun the study: the VGG-like net, Adam, K micro-batches of B per step. "
                                   "Or, with --task simclr, SimCLR pre-training under accumulation, scored by a "
                                   "linear probe. Writes results.csv, summary.md, curves.png, report.html to --out; "
                                   "rerunning the same command resumes.")
    s.add_argument("--task", help="bn: normalization under accumulation (default); simclr: contrastive learning "
                                  "under accumulation, methods x configs")
    s.add_argument("--quick", action="store_true",
                   help="a small offline grid (1.5 to 2 minutes on 2 CPU cores); other options still override it. "
                        f"--task bn: {', '.join(f'{k}={v}' for k, v in QUICK.items())} (shows the finding); "
                        f"--task simclr: {', '.join(f'{k}={v}' for k, v in SIMCLR_QUICK.items())} (a demo)")
    s.add_argument("--dataset", help=f"digits or digits16 (offline, 8x8 or upscaled to 16x16), mnist, fashion-mnist or "
                                     f"cifar10 (default {d.dataset})")
    s.add_argument("--data-dir", help="where torchvision datasets are (downloaded there when missing and online)")
    s.add_argument("--norms", help="comma list: bn (torch, per-micro-batch statistics), bn-exact (accumnorm), gn4, "
                                   "gn16, in, none, or any accumnorm.norm name, e.g. brn, bn-stale, frn, evonorm-s0 "
                                   f"(default {','.join(d.norms)})")
    s.add_argument("--methods", help="--task simclr: comma list of bn-whole (the batch in one go), bn (plain "
                                     "accumulation), bn-gradcache (loss whole, BatchNorm per micro-batch), bn-exact "
                                     f"(both whole), gn (GroupNorm, loss whole) (default {','.join(c.methods)})")
    s.add_argument("--configs", help="comma list of BxK: micro-batch B, K micro-batches per step "
                                     f"(default {','.join(d.configs)}; --task simclr {','.join(c.configs)})")
    s.add_argument("--runs", type=int, help=f"runs (seeds) per cell (default {d.runs})")
    s.add_argument("--iterations", type=int, help=f"optimizer steps per run (default {d.iterations}; --task simclr "
                                                  f"{c.iterations})")
    s.add_argument("--eval-every", type=int, help=f"steps between validation passes (default {d.eval_every}; --task "
                                                  f"simclr {c.eval_every}: linear probes)")
    s.add_argument("--average-after", type=_step_or_fraction, metavar="STEP|FRACTION",
                   help="the table averages each run's evaluations after this step (an int), or after this fraction "
                        "of the run (a float below 1), e.g. 250 or 0.5 (default: the study's 250, or half the run "
                        "when it is shorter than 500 steps); refused when no evaluation would come after it")
    s.add_argument("--lr", type=float, help=f"Adam learning rate (default {d.lr})")
    s.add_argument("--temperature", type=float, help=f"--task simclr: NT-Xent's temperature (default {c.temperature})")
    s.add_argument("--seed", type=int, help=f"run r uses seed + r (default {d.seed})")
    s.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    s.add_argument("--out", help="output directory (default study-out/quick with --quick, else study-out/<dataset>; "
                                    "study-out/simclr-quick and study-out/simclr-<dataset> with --task simclr)")
    s.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    s.add_argument("--workers", type=int,
                   help="processes training cells in parallel, splitting the --threads budget (default on a CPU: one "
                        "per thread, at most one per pending cell; 1 trains in this process; on CUDA always 1)")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _step_or_fraction(text: str) -> int | float:
    """--average-after's value: an int is a step, a float a fraction of the run."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a step (an int) or a fraction of the run (a float), got {text!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    from accumnorm.study import run_study
    from accumnorm.study._settings import check_positive_int
    from accumnorm.study._tasks import settings_class

    given = {k: v for k, v in vars(args).items() if v is not None}
    task = given.pop("task", "bn")
    out = None
    try:
        settings_type = settings_class(task)
        for option, owner in ONLY.items():
            if option in given and owner != task:
                raise ValueError(f"--{option.replace('_', '-')} is an option of --task {owner}, not of --task {task}")
        options = {**(QUICKS[task] if args.quick else {}), **given}
        fields = {k: options[k] for k in settings_type.__dataclass_fields__ if k in options}
        for key in ("norms", "methods", "configs"):
            if key in fields:
                fields[key] = tuple(x.strip() for x in fields[key].split(",") if x.strip())
        name = "quick" if args.quick else fields.get("dataset", settings_type.dataset)
        out = options.get("out") or f"study-out/{'' if task == 'bn' else task + '-'}{name}"
        if args.threads is not None:
            check_positive_int("threads", args.threads)
            torch.set_num_threads(args.threads)
        settings = settings_type(**fields)
        written = run_study(out, settings, device=args.device, progress=not args.no_progress, workers=args.workers)
    except (ValueError, TypeError, OSError) as err:  # OSError: a path that is a file, or not writable
        print(f"accumnorm study: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the runs already finished are in results.csv, and the same command goes on from them
        kept = f"the finished runs are kept in {out}: run the same command again to go on from them" \
            if out and Path(out).exists() else "nothing was written"
        print(f"\naccumnorm study: interrupted; {kept}", file=sys.stderr)
        return 130
    print((Path(written) / "summary.md").read_text())
    files = [name for name in ("summary.md", "curves.png", "report.html", "results.csv")
             if (Path(written) / name).exists()]
    print(f"wrote {out}/{', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
