"""Exact BatchNorm under accumulation against plain PyTorch accumulation, side by side, on real networks.

For each model and split (micro-batch b x K accumulation steps = a batch of 16), one optimizer step's
gradient is made three ways, interleaved round by round so that machine noise hits all alike:

  plain      the models' own torch BatchNorm, the usual loop: loss * b / B, backward, K times
  layerwise  accumnorm.backward(schedule="layerwise"): micro-batches in lockstep, one whole-batch BN per BN call
  passes     accumnorm.backward(schedule="passes"): 2L + 1 passes for L BN calls (skipped above --skip-passes-over)

and prints the median milliseconds per step, each schedule's ratio to plain (the median over rounds of its
time over plain's in the same round), and the memory each holds: the peak bytes of autograd's saved tensors
during the step (each storage counted once), which for the layerwise schedule on a CPU is its store (the
whole batch's saved tensors), and on CUDA the peak of torch.cuda.max_memory_allocated (the store then lives
in pinned host memory). "BN" is the number of training-mode F.batch_norm calls one forward makes (L above).

The models (benchmarks/_models.py, each with its own batch and loss, all from their configs, no weights):
the study's VGG-like net and torchvision's resnet18, resnet50, mobilenet_v3_small, efficientnet_b0
(classification of MNIST digits upscaled to --size, 3 channels); ultralytics' YOLOv8n (its raw maps, mean
squares); MONAI's 3D UNet (digits extruded to --volume^3, per-voxel cross-entropy); segmentation_models_pytorch's
Unet on resnet18 (per-pixel cross-entropy); a model with Python control flow torch.fx cannot trace; torchvision's
densenet121 with its BatchNorms inside activation checkpointing; the SimCLR study's encoder and projection head on
two views of each digit, with NT-Xent over the whole batch (exact: accumnorm.backward's whole-batch form; plain:
each micro-batch's own NT-Xent, as plain accumulation takes it). A model whose library is not installed is
skipped with a note; a schedule that fails on a model shows "failed" and the error goes to stderr.

On a CPU with glibc, the process keeps the memory it frees for reuse (`--allocator keep`, the default), as
torch's CUDA caching allocator does on a GPU, and as jemalloc or tcmalloc, which PyTorch's CPU tuning guide
recommends, do: by default glibc hands large freed blocks back to the OS and the next step faults them in
again, thousands of page faults per step or none depending on the heap's history, not on the method
measured. `--allocator glibc` measures with glibc's defaults.

    python benchmarks/bench_backward.py                    # every model, 64x64, 4x4 and 2x8, 2 threads
    python benchmarks/bench_backward.py --models resnet18 --splits 4x4 --rounds 3 --passes-rounds 1
    python benchmarks/bench_backward.py --models yolov8n,smp_unet --markdown   # a table to paste into a README
"""
from __future__ import annotations

import argparse
import copy
import ctypes
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from _models import BATCH, MODELS, Batch, Case
from torch.overrides import TorchFunctionMode

import accumnorm

Method = Callable[[nn.Module, Batch, int, Case], None]


def split(batch: Batch, micro: int) -> list[Batch]:
    """The micro-batches of a tensor or a tuple/list of tensors, micro samples each (the last may be smaller)."""
    if isinstance(batch, torch.Tensor):
        return list(batch.split(micro))
    return [type(batch)(parts) for parts in zip(*(t.split(micro) for t in batch))]


def samples(batch: Batch) -> int:
    return len(batch if isinstance(batch, torch.Tensor) else batch[0])


def to(batch: Batch, device: torch.device) -> Batch:
    return batch.to(device) if isinstance(batch, torch.Tensor) else type(batch)(t.to(device) for t in batch)


def plain_step(model: nn.Module, batch: Batch, micro: int, case: Case) -> None:
    for part in split(batch, micro):
        (case.loss(model, part) * samples(part) / samples(batch)).backward()


def schedule_step(schedule: str) -> Method:
    def step(model: nn.Module, batch: Batch, micro: int, case: Case) -> None:
        if case.batch_loss is None:
            accumnorm.backward(model, batch, case.loss, micro_batch_size=micro, schedule=schedule)
        else:  # the loss once over the whole batch's outputs
            accumnorm.backward(model, batch, micro_batch_size=micro, schedule=schedule, forward_fn=case.forward,
                               batch_loss_fn=case.batch_loss)
    return step


METHODS: dict[str, Method] = {"plain": plain_step, "layerwise": schedule_step("layerwise"),
                              "passes": schedule_step("passes")}


class CountBN(TorchFunctionMode):
    """Counts the training-mode F.batch_norm calls made under it (torch's, timm's, anyone's BatchNorm)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.batch_norm and kwargs.get("training", args[5] if len(args) > 5 else False):
            self.calls += 1
        return func(*args, **kwargs)


def bn_calls(model: nn.Module, batch: Batch, loss_fn: Callable[[nn.Module, Batch], torch.Tensor]) -> int:
    """L: the BatchNorm calls one forward makes (counted on a copy, on 2 samples, without grad)."""
    with torch.no_grad(), CountBN() as count:
        loss_fn(copy.deepcopy(model), split(batch, 2)[0])
    return count.calls


class SavedBytes:
    """Peak bytes of tensors autograd holds for backward, each storage counted once (saved-tensor hooks)."""

    def __init__(self) -> None:
        self.live = self.peak = 0
        self.count: dict[int, int] = {}

    def pack(self, t: torch.Tensor):
        key, nbytes, owner = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), self
        if owner.count.get(key, 0) == 0:
            owner.live += nbytes
            owner.peak = max(owner.peak, owner.live)
        owner.count[key] = owner.count.get(key, 0) + 1

        class Held:
            def __del__(self) -> None:
                owner.count[key] -= 1
                if owner.count[key] == 0:
                    owner.live -= nbytes

        return t.detach(), Held()  # detached: t's grad_fn holds the node that holds this (a cycle no collector breaks)

    @staticmethod
    def unpack(packed) -> torch.Tensor:
        return packed[0]


def memory(model: nn.Module, step: Callable[[nn.Module], None], device: torch.device) -> int:
    """Peak bytes held by one step: saved tensors on a CPU, max_memory_allocated on CUDA."""
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(model)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    saved = SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        step(model)
    return saved.peak


def timed(model: nn.Module, step: Callable[[nn.Module], None], device: torch.device) -> float:
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    step(model)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


# (median seconds, nan if not timed; median over rounds of the round's time over plain's; peak bytes), or why there
# is none
Result = tuple[float, float, int] | str


def bench(name: str, base: nn.Module, batch: Batch, micro: int, methods: list[str], args: argparse.Namespace,
          device: torch.device) -> dict[str, Result]:
    """Each method's result, and the whole batch's memory; a method that raises is reported "failed"."""
    case = MODELS[name]
    steps = {m: (lambda model, m=m: METHODS[m](model, batch, micro, case)) for m in methods}
    steps["whole batch"] = lambda model: plain_step(model, batch, BATCH, case)
    models = {m: copy.deepcopy(base) for m in steps}  # same weights; each its own running statistics
    peaks: dict[str, float | None] = {}
    times: dict[str, list[float | None]] = {m: [] for m in methods}
    failed: set[str] = set()

    def attempt(method: str, measure: Callable[..., float]) -> float | None:
        if method in failed:
            return None
        try:
            return measure(models[method], steps[method], device)
        except Exception as e:  # reported; the other methods go on
            failed.add(method)
            print(f"note: {name} {micro}x{BATCH // micro} {method} failed: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
            return None

    # The memory run is also the warm-up (allocator, first-call costs): it is not timed.
    for m in steps:
        peaks[m] = attempt(m, memory)
    for r in range(args.rounds):
        # Every other round in reverse order: a method gains nothing from its place in the round.
        for m in methods if r % 2 == 0 else methods[::-1]:
            times[m].append(attempt(m, timed) if m != "passes" or r < args.passes_rounds else None)
    return {m: "failed" if m in failed else (*_summary(times.get(m, []), times["plain"]), peaks[m]) for m in steps}


def _summary(times: list[float | None], plain: list[float | None]) -> tuple[float, float]:
    """The median time, and the median of each round's time over plain's in the same round: the machine's speed
    drifts over a run, and a ratio within one round cancels what the drift does to both."""
    pairs = [(t, p) for t, p in zip(times, plain) if t is not None and p is not None]
    if not pairs:
        return float("nan"), float("nan")
    return statistics.median(t for t, _ in pairs), statistics.median(t / p for t, p in pairs)


# (text header, markdown header, text width): the text table is fixed-width, the markdown one pipe-separated
COLUMNS = [("model", "model", -20), ("split", "split", 6), ("BN", "BN calls", 5), ("plain ms", "plain ms", 10),
           ("layerwise", "layerwise ms", 17), ("passes", "passes ms", 18), ("mem plain", "{mem} plain", 11),
           ("layerwise", "{mem} layerwise", 11), ("passes", "{mem} passes", 9), ("whole", "{mem} whole batch", 8)]


def row(cells: list[str], markdown: bool) -> str:
    if markdown:
        return "| " + " | ".join(cells) + " |"
    return "".join(f"{c:<{-w}}" if w < 0 else f"{c:>{w}}" for c, (_, _, w) in zip(cells, COLUMNS))


def cells(name: str, micro: int, calls: int, r: dict[str, Result]) -> list[str]:
    def ms(m: str) -> str:
        if isinstance(r[m], str):
            return r[m]
        t, ratio, _ = r[m]
        if t != t:  # not timed (--passes-rounds 0)
            return "-"
        return f"{t * 1e3:.0f}" if m == "plain" or ratio != ratio else f"{t * 1e3:.0f} ({ratio:.2f}x)"

    def mib(m: str) -> str:
        return r[m] if isinstance(r[m], str) else f"{r[m][2] / 2**20:.1f}"

    return [name, f"{micro}x{BATCH // micro}", str(calls), ms("plain"), ms("layerwise"), ms("passes"),
            mib("plain"), mib("layerwise"), mib("passes"), mib("whole batch")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--splits", default="4x4,2x8", help="micro-batch x accumulation steps, each making 16")
    p.add_argument("--size", type=int, default=64, help="input height and width of 2D models (default 64)")
    p.add_argument("--volume", type=int, default=32, help="input side of 3D models (default 32: 32^3 voxels)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds of plain and layerwise (median)")
    p.add_argument("--passes-rounds", type=int, default=1, help="timed rounds of passes (slow on deep nets)")
    p.add_argument("--skip-passes-over", type=int, default=100, metavar="N",
                   help="skip passes (2L+1 passes) for models with more than N BatchNorm calls (default 100)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (0: torch's default)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--markdown", action="store_true", help="print the table in markdown, to paste into a README")
    p.add_argument("--allocator", choices=("keep", "glibc"), default="keep",
                   help="keep: glibc keeps freed memory for reuse (default); glibc: its defaults (see above)")
    args = p.parse_args()
    args.allocator = keep_freed_memory() if args.allocator == "keep" else "glibc's defaults"
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    splits = []
    for s in args.splits.split(","):
        b, k = (int(v) for v in s.split("x"))
        if b * k != BATCH:
            p.error(f"split {s} makes {b * k} samples; each split must make {BATCH}")
        splits.append(b)
    print_header(args, device)
    for name in names:
        prepared = prepare(name, args, device)
        if prepared is None:
            continue
        base, batch, calls = prepared
        methods = [m for m in METHODS if m != "passes" or calls <= args.skip_passes_over]
        for micro in splits:
            r = bench(name, base, batch, micro, methods, args, device)
            r.setdefault("passes", "skipped")
            print(row(cells(name, micro, calls, r), args.markdown), flush=True)


def keep_freed_memory() -> str:
    """Have glibc keep freed memory for reuse (module doc): no trimming of the heap's top, and blocks up to its
    largest mmap threshold (32 MiB) from the heap. Says what the allocator does now."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "the C library's defaults (not glibc)"
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    if mallopt(m_trim_threshold, 1 << 30) != 1 or mallopt(m_mmap_threshold, 32 << 20) != 1:
        return "glibc's defaults (mallopt refused)"
    return "glibc keeping freed memory"


def print_header(args: argparse.Namespace, device: torch.device) -> None:
    mem = "saved MiB" if device.type == "cpu" else "peak MiB"
    print(f"batch {BATCH} at {args.size}x{args.size} (3D: {args.volume}^3), {device}, {torch.get_num_threads()} "
          f"threads, median of {args.rounds} interleaved rounds ({args.passes_rounds} for passes, skipped over "
          f"{args.skip_passes_over} BN calls), {args.allocator}; memory: "
          + ("peak MiB of autograd's saved tensors" if device.type == "cpu" else "peak MiB allocated on the device"))
    if args.markdown:
        print()
        print(row([md.format(mem=mem) for _, md, _ in COLUMNS], True))
        print(row(["---"] * len(COLUMNS), True))
    else:
        print(row([text for text, _, _ in COLUMNS], False))


def prepare(name: str, args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, Batch, int] | None:
    """The model (seeded, no dropout), its batch on the device, its BN call count; None if its library is missing."""
    case = MODELS[name]
    torch.manual_seed(0)
    try:
        model = case.build().train().to(device)
    except ImportError as e:  # a benchmark extra that is not installed
        print(f"note: {name} skipped: {e}", file=sys.stderr, flush=True)
        return None
    for m in model.modules():  # dropout would make the runs differ; timing does not need it
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
    batch = to(case.batch(args.size, args.volume), device)
    return model, batch, bn_calls(model, batch, case.loss)


if __name__ == "__main__":
    main()
