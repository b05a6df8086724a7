"""Exact BatchNorm under accumulation against plain PyTorch accumulation: memory and time, side by side.

For each model and each number of accumulation steps K (a batch of 32 in K micro-batches of 32 / K), one
optimizer step's gradient is made each of these ways:

  plain      the models' own torch BatchNorm, the usual loop: loss * b / B, backward, K times
  whole      the whole batch at once, in torch (memory only: what accumulation stands in for)
  layerwise  accumnorm.backward(schedule="layerwise"): micro-batches in lockstep, one whole-batch BN per BN call
  lockstep   beside layerwise, time only: the same lockstep of torch's BatchNorm layers and nothing else of
             accumnorm's (no checks, state swaps, random streams or transaction): the floor under layerwise's time;
             "n/a" for a model it cannot run (other BatchNorm classes, BatchNorm in checkpointed regions)
  recompute  accumnorm.backward(schedule="recompute")
  checkpointed  beside recompute, time only: plain accumulation with the regions recompute would choose each in
             torch's checkpoint(use_reentrant=False), nothing else of accumnorm's: the floor under recompute's time
  passes     accumnorm.backward(schedule="passes"): 2L + 1 passes for L BN calls; skipped, saying so, for
             models of more than --skip-passes-over BN calls, where it takes tens of plain steps

--schedules lists the exact schedules, each with its settings if any, name[:key=value[:key=value...]]:
"layerwise,recompute,segments:keep_every=1,segments:keep_every=2" shows four, each a method of its own (a column of
the tables, a point of the pictures), the settings passed to accumnorm.backward as keyword arguments (keep_every=2;
values read as Python literals, else as text: store=cpu). Each is first asked of accumnorm.backward with one step of
a small net; one it does not take (a schedule or a setting this accumnorm lacks, a value it refuses) is not run, and
the header says why ("segments:keep_every=2: not available in this accumnorm" from a version without it). A
schedule's floor is timed beside it where a floor takes its settings (benchmarks/_methods.py; lockstep and
checkpointed take none). Beside segments:

  checkpointed_all  time only: plain accumulation with every region segments uses (the small ones too) each in
             torch's checkpoint, nothing else of accumnorm's: the floor under segments' own recomputation; "n/a" at
             keep_every above 1, whose recomputation of a region's arguments from the region before torch's
             checkpoint cannot express

and with --compile BACKEND, time only, each on its own copy of the model compiled with
torch.compile(model, backend=BACKEND), in the same rounds as the others:

  compiled plain      plain accumulation, no graph break: BatchNorm fused in the graph, each micro-batch
                      normalized alone
  compiled floor      plain accumulation with a graph break at each BatchNorm call (each BatchNorm layer's
                      forward under torch.compiler.disable), as exact mode breaks the graph, and nothing else of
                      accumnorm's: the floor under compiled exact's time
  compiled <schedule> accumnorm.backward on the compiled model, for each exact schedule shown

The full table gives, each figure beside its ratio to plain's:

  peak MiB   the step's peak memory above the level before it, the median of --peak-runs fresh processes per
             configuration (3 by default; one run of each method in turn), each with glibc's heap trimmed first
             (benchmarks/_memory.py: on a CPU the peak resident memory, on CUDA torch.cuda.max_memory_allocated),
             at --memory-threads threads; saved and host MiB are the runs' medians too
  time       each schedule's time over plain's at each of --threads: rounds interleaved so that machine noise
             hits all alike, every other round in reverse order, the ratio the median over rounds of the
             round's time over plain's (the machine's speed drifts; a ratio within one round cancels it); with
             --min-round-ms, each method's time in a round is the mean of as many steps as plain needs to fill
             that long (the same number for every method), which steadies the rounds of small models
  saved MiB  the peak of autograd's live saved tensors in the step, weights left out
  host MiB   what a host store (store=None on CUDA) would move per step: the saved tensors, there and back

A summary follows: for the middle K, one row per model, the ratios alone (the short table a README can hold).
With --compile, the compile table follows it: for each model and K, compiled plain's milliseconds and its ratio to
eager plain's, the compiled floor, each compiled schedule and each eager schedule as ratios to compiled plain's
(the median over rounds, as above), each compiled schedule over the compiled floor ("c.layerwise/floor"), and the
seconds of the first step of compiled plain and of each compiled schedule: the step that compiles, untimed in the
rounds, each from empty caches (a fresh inductor cache directory) so that no method reuses another's kernels.
Dynamo is reset before each model, K and thread count: every compiled method compiles for those shapes alone,
and its recompile limit, which counts the graphs of a code object that the compiled copies share, is multiplied
by their number, so that each compiles all it would alone.

--json FILE writes every figure (bytes, each run's peak, every round's seconds at every thread count, the words
of what was not measured) to FILE as JSON, rewritten after each model. --plot DIR draws, for each K, the
memory-time frontier: a panel per model, each schedule's peak against its time as ratios to plain's (time at the
first of --threads), to DIR/frontier-K<k>.png and .svg (matplotlib, checked before the run starts);
`python benchmarks/_plot.py FILE DIR` redraws them from a --json dump (benchmarks/_plot.py says what they show).

"BN" is the number of training-mode F.batch_norm calls one forward makes (L above). The models
(benchmarks/_models.py, each with its own batch and loss, all from their configs, no weights): the study's
VGG-like net, torchvision's resnet50 and efficientnet_b0 (MNIST digits upscaled to --size, 3 channels),
ultralytics' YOLOv8n (its raw maps, mean squares), MONAI's 3D UNet (digits extruded to --volume^3, per-voxel
cross-entropy), segmentation_models_pytorch's Unet on resnet18 (per-pixel cross-entropy), torchvision's
densenet121 with its BatchNorms inside activation checkpointing, and the SimCLR study's encoder and projection
head on two views of each digit, with NT-Xent over the whole batch (exact: accumnorm.backward's whole-batch form;
plain: each micro-batch's own NT-Xent, as plain accumulation takes it; at K = 32 a micro-batch's views have one
candidate each, their own other view, so plain's loss is 0 and its gradient zero: the cost of plain's
operations, not a useful step), and tiny_deep, 48 blocks of 8-channel conv-BatchNorm-ReLU on 8x8 digits, where
kernels cost nothing and a step is all host work (the regime of a GPU with a small micro-batch: what a schedule's
own Python costs per call); resnet18, mobilenet_v3_small and a model torch.fx cannot trace ("dynamic") on
request. A model whose library is not installed is skipped with a note; a
method that fails shows "failed" and the error goes to stderr.

On a CPU with glibc, the processes keep the memory they free for reuse (`--allocator keep`, the default), as
torch's CUDA caching allocator does on a GPU, and as jemalloc or tcmalloc, which PyTorch's CPU tuning guide
recommends, do: by default glibc hands large freed blocks back to the OS and the next step faults them in
again, thousands of page faults per step or none depending on the heap's history, not on the method
measured. `--allocator glibc` measures with glibc's defaults. `--allocator mmap` maps each block of 64 KiB or more
from the OS and hands it back when freed (what `MALLOC_MMAP_THRESHOLD_=65536` does): no heap keeps freed blocks
between uses, so the peak follows the live tensors. Where many micro-batches hold small tensors each (K = 16 and
32 here), a heap that keeps what it freed can hold far more than the tensors; this shows how much.

    python benchmarks/bench_backward.py --markdown    # the full table: 9 models x K = 4, 8, 16, 32, 1 and 2 threads
    python benchmarks/bench_backward.py --models study,simclr --ks 4 --rounds 1 --size 32
    python benchmarks/bench_backward.py --models resnet50 --no-memory --threads 2 --schedules layerwise
    python benchmarks/bench_backward.py --compile inductor --models study,resnet50 --ks 4,8 --no-memory --threads 1
    python benchmarks/bench_backward.py --models tiny_deep,study --ks 16,32 --rounds 1 --json r.json --plot pictures
    python benchmarks/bench_backward.py --schedules recompute,segments:keep_every=1,segments:keep_every=2 --ks 8,32 \
        --plot pictures

The full default run measures 129 configurations' memory in 3 fresh processes each (387 processes) and times
3 rounds of each configuration after a warm-up, at K = 4, 8, 16 and 32. Its length has not been measured: the
run with one process per configuration and K up to 16 (99 processes) was estimated at 16 minutes on a quiet 2-core
CPU; this one runs three times the processes, and K = 32's steps are the longest (32 micro-batches; passes runs
2L + 1 passes over each): expect hours. The run prints its own total at the end. `--peak-runs 1`, `--ks 4,8,16`,
`--rounds 2` or `--memory-threads 2` shorten it. Timings taken on a loaded machine are noise; the memory figures
are not. --compile adds the compiling first steps, three per model, K and thread count (more with more
schedules): with inductor on a CPU, minutes each for a deep net.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch
from _memory import Memory, measure_runs, use_allocator
from _methods import SCHEDULES, method, methods, parse_schedules, relative_budget, resolved, schedule_of, timed_methods
from _models import BATCH, MODELS
from _plot import dump, frontiers, require_matplotlib
from _steps import bn_calls, compiled, compiled_methods, compiling_apart, prepare
from _table import Row, Times, columns, compile_columns, line, summary_columns, table
from _timing import time_methods

DEFAULT_MODELS = ("resnet50", "efficientnet_b0", "yolov8n", "monai_unet3d", "smp_unet", "densenet121_ckpt", "study",
                  "simclr", "tiny_deep")


def parse_list(p: argparse.ArgumentParser, flag: str, text: str, allowed: list, kind: type = str) -> list:
    try:
        values = [kind(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        p.error(f"{flag}: expected a comma-separated list of {kind.__name__}, got {text!r}")
    wrong = [v for v in values if allowed and v not in allowed]
    if wrong:
        p.error(f"{flag}: {wrong} not among {', '.join(map(str, allowed))}")
    return values


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--ks", default="4,8,16,32",
                   help=f"accumulation steps, each dividing the batch of {BATCH} (default 4,8,16,32)")
    p.add_argument("--schedules", default=",".join(SCHEDULES),
                   help="exact schedules to show, each with its settings, name[:key=value...], e.g. "
                        "layerwise,recompute,segments:keep_every=1,segments:keep_every=2: each a method of its own, "
                        "the settings passed to accumnorm.backward as keyword arguments; those it does not take are "
                        "reported, not run "
                        f"(default: {','.join(SCHEDULES)})")
    p.add_argument("--threads", default="1,2", help="torch threads of the timed runs, comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of plain and each schedule (0: no timing)")
    p.add_argument("--passes-rounds", type=int, default=1, help="timed rounds of passes (slow on deep nets)")
    p.add_argument("--min-round-ms", type=float, default=0.0, metavar="MS",
                   help="in each round, every method takes as many steps as plain needs to take MS milliseconds, "
                        "its time the mean per step (default 0: one step each)")
    p.add_argument("--skip-passes-over", type=int, default=20, metavar="N",
                   help="skip passes (2L+1 passes) for models with more than N BatchNorm calls (default 20)")
    p.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                   help="measure memory in fresh processes (default: yes)")
    p.add_argument("--memory-threads", type=int, default=1, help="torch threads of the memory runs (default 1)")
    p.add_argument("--peak-runs", type=int, default=3, metavar="N",
                   help="fresh processes per configuration; each figure is their median (default 3)")
    p.add_argument("--size", type=int, default=64, help="input height and width of 2D models (default 64)")
    p.add_argument("--volume", type=int, default=32, help="input side of 3D models (default 32: 32^3 voxels)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", metavar="BACKEND",
                   help="also time plain accumulation, the compiled floor and each schedule on models compiled with "
                        "torch.compile(backend=BACKEND), e.g. inductor or aot_eager: the compile table (see above)")
    p.add_argument("--markdown", action="store_true", help="print the table in markdown, to paste into a page")
    p.add_argument("--json", metavar="FILE", help="write every figure to FILE (rewritten after each model), from "
                                                  "which `python benchmarks/_plot.py FILE DIR` redraws the pictures")
    p.add_argument("--plot", metavar="DIR", help="draw each K's frontier, peak against time as ratios to plain's, one "
                                                 "panel per model, to DIR/frontier-K<k>.png and .svg (matplotlib)")
    p.add_argument("--allocator", choices=("keep", "mmap", "glibc"), default="keep",
                   help="keep: glibc keeps freed memory for reuse (default); mmap: blocks of 64 KiB and more mapped "
                        "and handed back; glibc: its defaults (see above)")
    args = p.parse_args()
    args.models = parse_list(p, "--models", args.models, list(MODELS))
    args.ks = parse_list(p, "--ks", args.ks, [k for k in range(1, BATCH + 1) if BATCH % k == 0], int)
    try:
        args.schedules, args.refused = parse_schedules(args.schedules)
    except ValueError as e:
        p.error(f"--schedules: {e}")
    args.threads = parse_list(p, "--threads", args.threads, [], int)
    if args.rounds < 0 or args.passes_rounds < 0 or args.min_round_ms < 0 or any(
            t < 1 for t in [*args.threads, args.memory_threads, args.peak_runs]):
        p.error("--rounds, --passes-rounds and --min-round-ms must be >= 0, --memory-threads, --peak-runs and each of "
                "--threads >= 1")
    if args.plot:
        if not (args.memory and args.rounds and args.threads):
            p.error("--plot draws peak against time: it needs both measured (--memory, --rounds >= 1)")
        require_matplotlib(p.error)
    if args.compile and args.compile not in torch._dynamo.list_backends(exclude_tags=()):
        p.error(f"--compile: {args.compile!r} not among {', '.join(torch._dynamo.list_backends(exclude_tags=()))}")
    if args.passes_rounds > args.rounds:
        args.passes_rounds = args.rounds
    for name, why in args.refused.items():
        print(f"note: schedule {name}: {why}: not shown", file=sys.stderr)
    return args


def header(args: argparse.Namespace, allocator: str) -> str:
    where = f"{args.device}, {allocator}"
    steady = f", each at least {args.min_round_ms:g} ms of plain's steps" if args.min_round_ms else ""
    timing = (f"time: median of {args.rounds} interleaved rounds ({args.passes_rounds} for passes){steady} at "
              f"{', '.join(map(str, args.threads))} threads" if args.rounds else "time: not measured")
    memory = (f"memory: the median of {args.peak_runs} fresh processes per configuration, {args.memory_threads} "
              "thread(s), peak " + ("resident" if args.device == "cpu" else "allocated") + " above the pre-step level"
              if args.memory else "memory: not measured")
    refused = "".join(f"; {name}: {why}" for name, why in args.refused.items())
    return (f"batch {BATCH} at {args.size}x{args.size} (3D: {args.volume}^3), {where}; {memory}; {timing}; "
            f"passes skipped for models of more than {args.skip_passes_over} BN calls{refused}")


def bench_model(name: str, args: argparse.Namespace, device: torch.device) -> list[Row]:
    """The rows of one model: for each K, memory in fresh processes, then time in this one."""
    prepared = prepare(name, args.size, args.volume, device)
    if prepared is None:
        return []
    base, batch = prepared
    case = MODELS[name]
    calls = bn_calls(base, batch, case.loss)
    schedules = [s for s in args.schedules if schedule_of(s) != "passes" or calls <= args.skip_passes_over]
    skipped = {m: f"skipped ({calls} > {args.skip_passes_over} BN)" for s in args.schedules if s not in schedules
               for m in (s, compiled(s))}
    by_name = methods(schedules)
    timeout = 600.0
    whole = measure_runs(name, ["whole"], BATCH, args, timeout)["whole"] if args.memory else "-"
    rows = []
    relative = [s for s in schedules if relative_budget(s) is not None]
    for k in args.ks:
        micro, label = BATCH // k, f"{name} {k}x{BATCH // k}"
        shown = ["plain", *(s for s in schedules if s not in relative)]
        memory: dict[str, Memory | str] = {"whole": whole, **skipped}
        if args.memory:
            memory.update(measure_runs(name, shown, micro, args, timeout))
        plain = memory.get("plain")
        for s in relative:  # after plain's peak, which sets their budgets
            if isinstance(plain, Memory):
                in_bytes = resolved(s, plain.peak)
                memory[s] = measure_runs(name, [in_bytes], micro, args, timeout)[in_bytes]
                by_name[s] = method(in_bytes)
            else:
                memory[s] = "no plain peak"
        timing: dict[int, Times] = {}
        names = [m for m in timed_methods(schedules) if m in by_name] + (
            [m for m in compiled_methods(schedules) if relative_budget(m) is None] if args.compile else [])
        steps = {m: (lambda model, m=m, micro=micro: by_name[m](model, batch, micro, case)) for m in names}
        for threads in args.threads if args.rounds else []:
            torch.set_num_threads(threads)
            # every compiled method compiles afresh, for these shapes and threads
            with compiling_apart(len(compiled_methods(schedules))) if args.compile else contextlib.nullcontext():
                timing[threads] = time_methods(steps, base, args, device, label)
            timing[threads].rounds.update(skipped)
        rows.append(Row(name, calls, k, memory, timing))
    return rows


def main() -> None:
    args = parse_args()
    allocator = use_allocator(args.allocator)
    device = torch.device(args.device)
    start = time.perf_counter()
    print(header(args, allocator) + ("\n" if args.markdown else ""))
    threads = args.threads if args.rounds else []
    cols = columns(args.schedules, threads)
    print(*table(cols, [], args.markdown), sep="\n", flush=True)
    rows: list[Row] = []
    for name in args.models:
        try:
            done = bench_model(name, args, device)
        except Exception as e:  # a model that cannot run at these settings (too small an input): the others go on
            print(f"note: {name} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            continue
        for row in done:
            print(line([cell(row) for _, cell in cols], args.markdown), flush=True)
        rows += done
        if args.json:
            dump(args.json, header(args, allocator), args.schedules, rows)
    k = args.ks[len(args.ks) // 2]
    print(f"\nSummary at K = {k}: peak and time as ratios to plain accumulation's\n")
    print(*table(summary_columns(args.schedules, threads), [r for r in rows if r.k == k], args.markdown), sep="\n")
    if args.compile and threads:
        print(f"\nCompiled with torch.compile(backend={args.compile!r}): times as ratios to compiled plain "
              f"accumulation's, c.<schedule>/floor to the compiled floor's; each compiled method's first step "
              f"(compiling, from empty caches) in seconds\n")
        print(*table(compile_columns(args.schedules, threads), rows, args.markdown), sep="\n")
    if args.plot:
        print(*(f"wrote {path}" for path in frontiers(rows, args.schedules, args.plot)), sep="\n")
    print(f"\n{time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
