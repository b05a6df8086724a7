"""Side by side: the study's own loop (../shared/bench/seed_loop.py) against `accumnorm study`, same slice.

Both do the same work: each norm at the same BxK, R runs (seeds 0..R-1), the same number of
optimizer steps and one evaluation at the end, on the same data, with the same torch thread
count, one after the other in this one process tree. Ours splits that thread budget between
worker processes training cells in parallel (its default on a CPU): its training-loop seconds
are summed over cells that overlap in time. Wall times are whole processes (start-up, data
loading, training, evaluation, and for ours the reports), so the wall ratio is what a user
waits; CPU seconds (user + system of each process tree) are the compute spent, which other load
on the machine moves least. Not a test: the machine's load moves the numbers; run it on a quiet
machine.

  python benchmarks/bench_study.py --data-dir ../shared/data/mnist-mini --threads 2
"""
from __future__ import annotations

import argparse
import csv
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(cmd: list[str]) -> tuple[float, float, str]:
    """Run cmd, fail loudly if it fails; (wall seconds, CPU seconds of its whole process tree, stdout)."""
    t0, cpu0 = time.perf_counter(), _children_cpu()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr}")
    return wall, cpu, done.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "mnist-mini"))
    p.add_argument("--seed-loop", default=str(ROOT.parent / "shared" / "bench" / "seed_loop.py"))
    p.add_argument("--norms", default="bn,gn16")
    p.add_argument("--config", default="1x16")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    b, k = a.config.split("x")
    norms = a.norms.split(",")

    base_wall, base_cpu, base_train, base_acc = 0.0, 0.0, 0.0, {}
    for norm in norms:
        for run in range(a.runs):
            wall, cpu, out = timed([sys.executable, a.seed_loop, "--data-dir", a.data_dir, "--norm", norm,
                                    "--batch-size", b, "--num-accum", k, "--iterations", str(a.iterations),
                                    "--eval-period", str(a.iterations), "--seed", str(run),
                                    "--threads", str(a.threads)])
            result = json.loads(out.strip().splitlines()[-1])
            base_wall, base_cpu, base_train = base_wall + wall, base_cpu + cpu, base_train + result["wall_s"]
            base_acc.setdefault(norm, []).append(result["evals"][-1][2])

    with tempfile.TemporaryDirectory() as tmp:
        ours_wall, ours_cpu, _ = timed([sys.executable, "-m", "accumnorm._cli", "study", "--dataset", "mnist",
                                        "--data-dir", a.data_dir, "--norms", a.norms, "--configs", a.config,
                                        "--runs", str(a.runs), "--iterations", str(a.iterations),
                                        "--eval-every", str(a.iterations), "--threads", str(a.threads), "--device",
                                        "cpu", "--out", tmp, "--no-progress"])
        with open(Path(tmp) / "results.csv", newline="") as f:
            rows = list(csv.DictReader(f))
    ours_acc = {norm: [float(r["valid_acc"]) for r in rows if r["norm"] == norm] for norm in norms}
    ours_train = sum({(r["norm"], r["batch_size"], r["num_accum"]): float(r["seconds"]) for r in rows}.values())

    print(f"slice: norms {a.norms} at {a.config}, {a.runs} runs, {a.iterations} steps, one evaluation, "
          f"{a.threads} threads, {a.data_dir}")
    print(f"{'':13}  {'wall s':>8}  {'training loops s':>16}  {'CPU s':>8}")
    print(f"{'seed_loop.py':13}  {base_wall:8.1f}  {base_train:16.1f}  {base_cpu:8.1f}")
    print(f"{'accumnorm':13}  {ours_wall:8.1f}  {ours_train:16.1f}  {ours_cpu:8.1f}")
    ratios = base_wall / ours_wall, base_train / ours_train, base_cpu / ours_cpu
    print(f"{'speed ratio':13}  {ratios[0]:7.2f}x  {ratios[1]:15.2f}x  {ratios[2]:7.2f}x")
    print("(training loops: seconds inside the training loops summed over runs, for ours over cells that may run in "
          "parallel within the same threads; CPU: user + system seconds of each whole process tree)")
    for norm in norms:
        fmt = lambda accs: f"{statistics.fmean(accs):.3f} (runs {', '.join(f'{x:.3f}' for x in accs)})"  # noqa: E731
        print(f"valid acc {norm:>5}: seed_loop {fmt(base_acc[norm])} | accumnorm {fmt(ours_acc[norm])}")


if __name__ == "__main__":
    main()
