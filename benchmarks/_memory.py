"""The memory one step takes, each configuration measured in a fresh process of its own.

In the child (`measure_in_child` starts it): build the model, run one warm-up step (first-call costs: the
kernels' caches, lazy layers, the thread pool), free the gradients, collect garbage and trim glibc's heap
(`malloc_trim`: what freed memory glibc still holds goes back to the OS), then run the measured step. It
reports three figures (`Memory`):

  peak   the process's peak resident memory during the step above its resident memory just before it
         (Linux: the high-water mark VmHWM, reset to the current size through /proc/self/clear_refs; Linux
         counts resident pages in batches per thread, so it is exact to within a few hundred KiB);
         on CUDA, torch.cuda.max_memory_allocated above the memory allocated before the step
  saved  the peak bytes of the tensors autograd holds for the backward (saved-tensor hooks), each storage
         counted once, weights left out. A tensor saved inside a checkpointed region is packed by the
         region's own hooks, not counted here: what the step keeps, not what a recomputation holds briefly
  moved  the bytes a host store would move in the step: every saved tensor but the weights (parameters and
         leaves that require grad, which a store keeps by reference) copied to the host and back

bench_backward.py measures each configuration in --peak-runs fresh processes, one run of each method in turn
(`measure_runs`), and shows each figure's median: a process's peak resident memory moves by 10-30 MiB between runs
of one configuration (docs/cost.md), with the heap's history, not with the method.

    python benchmarks/_memory.py resnet50 layerwise 8 --size 64 --threads 1    # one line of JSON
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn as nn

import accumnorm


class Memory(NamedTuple):
    peak: int  # bytes
    saved: int
    moved: int
    peaks: tuple[int, ...] = ()  # each fresh process's peak, where `peak` is their median
    ran: str = ""  # the schedule an exact step ran, with its setting (accumnorm.last_schedule), in each run


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h


def keep_freed_memory() -> str:
    """Have glibc keep freed memory for reuse (bench_backward's doc): no trimming of the heap's top, and blocks up
    to its largest mmap threshold (32 MiB) from the heap. Says what the allocator does now."""
    return _mallopt({_M_TRIM_THRESHOLD: 1 << 30, _M_MMAP_THRESHOLD: 32 << 20}, "glibc keeping freed memory")


def map_large_blocks() -> str:
    """Have glibc map each block of 64 KiB or more from the OS and hand it back when freed (a fixed mmap threshold,
    as `MALLOC_MMAP_THRESHOLD_=65536` sets it): no heap holds them between uses, so the peak follows the live
    tensors, at the cost of page faults. Says what the allocator does now."""
    return _mallopt({_M_MMAP_THRESHOLD: 64 << 10}, "glibc mapping blocks of 64 KiB and more")


def use_allocator(name: str) -> str:
    """Set glibc up as --allocator `name` says ("keep", "mmap" or "glibc": its defaults); says what it does now."""
    return {"keep": keep_freed_memory, "mmap": map_large_blocks}.get(name, lambda: "glibc's defaults")()


def _mallopt(settings: dict[int, int], done: str) -> str:
    libc = _libc()
    if libc is None:
        return "the C library's defaults (not glibc)"
    if any(libc.mallopt(option, value) != 1 for option, value in settings.items()):
        return "glibc's defaults (mallopt refused)"
    return done


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 - glibc's, not every C library's
    except (OSError, AttributeError):
        return None
    return libc


def trim_heap() -> None:
    """Collect garbage and hand the free memory glibc holds back to the OS, so that a step's peak starts from what
    the process holds, not from what an earlier one left cached."""
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE).group(1))


def peak_resident(step: Callable[[], None]) -> int:
    """The peak resident bytes of this process while `step` runs, above its resident bytes just before."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark back to the current resident size
    before = _status_kib("VmRSS")
    step()
    return (_status_kib("VmHWM") - before) * 1024


def peak_allocated(step: Callable[[], None], device: torch.device) -> int:
    """CUDA: the peak bytes allocated on `device` while `step` runs, above what was allocated before."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


class SavedBytes:
    """Saved-tensor hooks that count what autograd holds (module doc: `saved`, `moved`); tensors pass unchanged."""

    def __init__(self) -> None:
        self.live = self.peak = self.moved = 0
        self._held: dict[int, int] = {}  # storage address -> saved tensors holding it
        self._lock = threading.RLock()  # autograd may free saved tensors on its own threads

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor | _Held:
        if isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad):
            return t
        self.moved += 2 * t.numel() * t.element_size()
        return _Held(self, t)

    def _count(self, key: int, nbytes: int, references: int) -> None:
        with self._lock:
            self._held[key] = self._held.get(key, 0) + references
            if references > 0 and self._held[key] == 1:
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            elif self._held[key] == 0:
                self.live -= nbytes
                del self._held[key]


class _Held:
    """A saved tensor, counted until autograd lets go of it."""

    def __init__(self, meter: SavedBytes, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        # Detached: t's grad_fn may hold the node that holds this, a cycle no collector breaks.
        self.meter, self.t, self.key, self.nbytes = meter, t.detach(), storage.data_ptr(), storage.nbytes()
        meter._count(self.key, self.nbytes, 1)

    def __del__(self) -> None:
        self.meter._count(self.key, self.nbytes, -1)


def _unpack(saved: torch.Tensor | _Held) -> torch.Tensor:
    return saved.t if isinstance(saved, _Held) else saved


def measure(step: Callable[[], None], device: torch.device) -> Memory:
    """The step's memory (module doc), from a trimmed heap."""
    trim_heap()
    saved = SavedBytes()

    def counted() -> None:
        with saved.hooks():
            step()

    peak = peak_allocated(counted, device) if device.type == "cuda" else peak_resident(counted)
    return Memory(peak, saved.peak, saved.moved)


def measure_in_child(name: str, method: str, micro: int, args: argparse.Namespace, timeout: float) -> Memory | str:
    """`method`'s memory on model `name` at micro-batch `micro`, in a fresh process; "failed" (why on stderr)."""
    command = [sys.executable, __file__, name, method, str(micro), "--size", str(args.size), "--volume",
               str(args.volume), "--threads", str(args.memory_threads), "--device", args.device,
               "--allocator", args.allocator]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=os.environ.copy())
    except subprocess.TimeoutExpired:
        print(f"note: {name} {method} micro-batch {micro}: memory run over {timeout:.0f} s", file=sys.stderr)
        return "failed"
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        print(f"note: {name} {method} micro-batch {micro} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return "failed"
    return Memory(**json.loads(lines[-1]))


def median_memory(runs: list[Memory | str]) -> Memory | str:
    """Each figure's median over the runs of one configuration (the lower middle one of an even number: a figure one
    run measured), each run's peak kept beside it; "failed" if a run failed (a crash is no noise to take a median
    of)."""
    if any(isinstance(r, str) for r in runs):
        return "failed"
    ran = " / ".join(dict.fromkeys(r.ran for r in runs if r.ran))  # each schedule that ran, once
    return Memory(*(statistics.median_low(figures) for figures in list(zip(*runs))[:3]), tuple(r.peak for r in runs),
                  ran)


def measure_runs(name: str, methods: list[str], micro: int, args: argparse.Namespace, timeout: float,
                 measure: Callable[..., Memory | str] = measure_in_child) -> dict[str, Memory | str]:
    """Each method's memory on model `name` at micro-batch `micro` in --peak-runs fresh processes each, the methods
    interleaved run by run so that what drifts over the runs (the machine's other jobs, the page cache) hits all
    alike, and the median of each figure (`median_memory`). A method stops at its first failed run."""
    runs: dict[str, list[Memory | str]] = {m: [] for m in methods}
    for _ in range(args.peak_runs):
        for m in methods:
            if "failed" not in runs[m]:
                runs[m].append(measure(name, m, micro, args, timeout))
    return {m: median_memory(r) for m, r in runs.items()}


def main(argv: list[str] | None = None) -> None:
    from _methods import method, schedule_of
    from _models import MODELS
    from _steps import prepare

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", choices=list(MODELS))
    p.add_argument("method", help="plain, whole, a floor, or an exact schedule with its settings (recompute:c=4)")
    p.add_argument("micro", type=int, help="samples per micro-batch")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--volume", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--allocator", choices=("keep", "mmap", "glibc"), default="keep")
    args = p.parse_args(argv)
    use_allocator(args.allocator)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    step = method(args.method)
    # passes runs the micro-batches' shapes only, plain's warm-up readies them at a fraction of the cost
    warm_up = method("plain") if schedule_of(args.method) == "passes" else step
    prepared = prepare(args.model, args.size, args.volume, device)
    if prepared is None:
        sys.exit(1)
    model, batch = prepared
    case = MODELS[args.model]
    warm_up(model, batch, args.micro, case)
    model.zero_grad(set_to_none=True)
    memory = measure(lambda: step(model, batch, args.micro, case), device)
    print(json.dumps(memory._replace(ran=ran(model))._asdict()))


def ran(model: nn.Module) -> str:
    """The schedule the model's last exact step ran and its setting, as "auto" names them ("" for none)."""
    choice = accumnorm.last_schedule(model)
    return "" if choice is None else choice.label


if __name__ == "__main__":
    main()
