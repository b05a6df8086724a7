"""gpu_check.py's cost checks: peak memory and time of a step each way, side by side, eager and compiled."""
from __future__ import annotations

import copy
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from _gpu_steps import Row, accumulated, batch_of, loss_fn, plain_accumulation, resnet, truth, whole_batch
from _methods import refusal

import accumnorm


def check_memory(device: torch.device) -> list[Row]:
    name, b, k = "memory", 8, 8
    base, batch = resnet("resnet18", device), batch_of(b * k, 112, device)
    steps = {
        f"plain accumulation, micro-batch {b}": accumulated(micro_batch_size=b, bn="micro"),
        f"exact {b} x {k}, store=None (pinned host)": accumulated(micro_batch_size=b),
        f"exact {b} x {k}, store='cuda'": accumulated(micro_batch_size=b, store="cuda"),
        f"whole batch of {b * k} in torch": whole_batch,
    }
    peaks = {}
    for case, backward in steps.items():
        model = copy.deepcopy(base)
        backward(model, batch, None)  # warm-up: cuDNN's algorithms and the host allocator's first blocks
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        backward(model, batch, None)
        torch.cuda.synchronize()
        peaks[case] = (torch.cuda.max_memory_allocated() - start) / 2**20
    plain, pinned, on_gpu, whole = peaks.values()
    rows = [Row(name, case, f"{mib:.0f} MiB ({mib / plain:.2f}x plain, {mib / whole:.2f}x whole)", "", "INFO")
            for case, mib in peaks.items()]
    rows.append(truth(name, "pinned store below store='cuda' and the whole batch", pinned < min(on_gpu, whole),
                      f"{pinned:.0f} < min({on_gpu:.0f}, {whole:.0f}) MiB"))
    return rows


class Interleaved:
    """Steps timed side by side under bf16 autocast: `steps[case](model)` on each case's own model. A case that
    runs out of memory is an INFO row, one that raises a FAIL row (`failed`), and the others go on."""

    def __init__(self, name: str, steps: dict[str, Callable[[nn.Module], Any]], models: dict[str, nn.Module],
                 device: torch.device) -> None:
        self.name, self.steps, self.models, self.device = name, steps, models, device
        self.times: dict[str, list[float | None]] = {case: [] for case in steps}
        self.failed: dict[str, Row] = {}

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def step(self, case: str) -> float:
        """The seconds of one step of `case`."""
        self.models[case].zero_grad(set_to_none=True)
        self.sync()
        start = time.perf_counter()
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            self.steps[case](self.models[case])
        self.sync()
        return time.perf_counter() - start

    def peak(self, case: str) -> float:
        """The MiB one step of `case` allocates above the level before it (CUDA)."""
        self.models[case].zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        self.step(case)
        return (torch.cuda.max_memory_allocated() - before) / 2**20

    def attempt(self, case: str, measure: Callable[[str], float]) -> float | None:
        if case in self.failed:
            return None
        try:
            return measure(case)
        except torch.OutOfMemoryError:
            self.failed[case] = Row(self.name, f"{case}: out of memory", "", "", "INFO")
        except Exception as err:  # this case fails; the others go on
            traceback.print_exc()
            self.failed[case] = Row(self.name, f"{case}: raised", f"{type(err).__name__}: {err}"[:200], "", "FAIL")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return None

    def rounds(self, n: int) -> None:
        """n timed rounds, interleaved so that the machine's drift hits every case alike, every other in reverse
        order so that no case gains from its place in the round."""
        order = list(self.steps)
        for r in range(n):
            for case in order if r % 2 == 0 else order[::-1]:
                self.times[case].append(self.attempt(case, self.step))

    def median(self, case: str) -> float:
        timed = [t for t in self.times[case] if t is not None]
        return statistics.median(timed) if timed else float("nan")

    def ratio(self, case: str, over: str) -> float:
        """The median of each round's time of `case` over `over`'s (a ratio within one round cancels drift); nan if
        they share no timed round."""
        ratios = [t / b for t, b in zip(self.times[case], self.times[over]) if t is not None and b is not None]
        return statistics.median(ratios) if ratios else float("nan")


def check_cost(device: torch.device) -> list[Row]:
    """Peak memory and time of one step against plain accumulation's: resnet50 at 224 px, 32 x 8, bf16 autocast."""
    name, b, k, rounds = "cost bf16", 32, 8, 3
    base, batch = resnet("resnet50", device), batch_of(b * k, 224, device)
    backwards = {"plain (bn='micro')": accumulated(micro_batch_size=b, bn="micro"),
                 "layerwise, store=None (pinned host)": accumulated(micro_batch_size=b, schedule="layerwise"),
                 "layerwise, store='cuda'": accumulated(micro_batch_size=b, schedule="layerwise", store="cuda")}
    if refusal("recompute") is None:
        backwards["recompute"] = accumulated(micro_batch_size=b, schedule="recompute")
    for keep_every in (1, 2):  # every region's arguments kept, and one region's in two
        if refusal(f"segments:keep_every={keep_every}") is None:
            backwards[f"segments, keep_every={keep_every}"] = accumulated(micro_batch_size=b, schedule="segments",
                                                                        keep_every=keep_every)
    backwards[f"whole batch of {b * k} in torch"] = whole_batch
    runs = Interleaved(name, {case: lambda model, f=f: f(model, batch, None) for case, f in backwards.items()},
                       {case: copy.deepcopy(base) for case in backwards}, device)
    peaks: dict[str, float] = {}
    for case in backwards:  # a warm-up step (cuDNN's algorithms, the host allocator's first blocks), then the peak
        if runs.attempt(case, runs.step) is not None:
            peaks[case] = runs.attempt(case, runs.peak)
    runs.rounds(rounds)
    plain = "plain (bn='micro')"
    rows = []
    for case in backwards:
        if case in runs.failed:
            rows.append(runs.failed[case])
            continue
        rows.append(Row(name, f"resnet50 224 px {b} x {k}: {case}",
                        f"{peaks[case]:.0f} MiB ({peaks[case] / peaks[plain]:.2f}x plain), "
                        f"{runs.median(case) * 1e3:.0f} ms ({runs.ratio(case, plain):.2f}x plain)", "", "INFO"))
    return rows


def check_compile(device: torch.device) -> list[Row]:
    """One step's time on torch.compile'd copies of resnet18 (inductor, bf16 autocast, 224 px, 32 x 4): exact
    (layerwise) and the compiled floor (plain accumulation with a graph break at each BatchNorm call, as exact mode
    breaks the graph) against compiled plain accumulation, exact against the floor, and each one's first step,
    which compiles it. On a CPU, for working on this script: aot_eager at 16 px, 4 x 4."""
    from _steps import break_at_batch_norms, compiling_apart, first_step

    name, rounds = "compile bf16", 3
    backend, size, b, k = ("inductor", 224, 32, 4) if device.type == "cuda" else ("aot_eager", 16, 4, 4)
    base, batch = resnet("resnet18", device), batch_of(b * k, size, device)
    plain, floor, exact = "compiled plain", "compiled floor", "compiled exact (layerwise)"
    runs = Interleaved(name, {
        plain: lambda model: plain_accumulation(model, batch, b),
        floor: lambda model: plain_accumulation(model, batch, b),
        exact: lambda model: accumnorm.backward(model, batch, loss_fn, micro_batch_size=b, schedule="layerwise"),
    }, {case: torch.compile(break_at_batch_norms(copy.deepcopy(base)) if case == floor else copy.deepcopy(base),
                            backend=backend) for case in (plain, floor, exact)}, device)
    first = {}
    with compiling_apart(len(runs.steps)):
        for case in runs.steps:  # the step that compiles, from empty caches; untimed in the rounds
            with first_step(case):
                first[case] = runs.attempt(case, runs.step)
        runs.rounds(rounds)
    rows = []
    for case in runs.steps:
        if case in runs.failed:
            rows.append(runs.failed[case])
            continue
        seen = f"{runs.median(case) * 1e3:.0f} ms ({runs.ratio(case, plain):.2f}x compiled plain"
        seen += f", {runs.ratio(case, floor):.2f}x the floor)" if case == exact else ")"
        rows.append(Row(name, f"resnet18 {size} px {b} x {k}, {backend}: {case}",
                        f"{seen}, first step {first[case]:.0f} s", "", "INFO"))
    return rows
