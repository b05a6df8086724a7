"""bench_backward.py's timing: each method's step timed in interleaved rounds, in this process.

Every method runs on its own copy of the model (the same weights, each its own running statistics), first once
untimed (first-call costs, the kernels' caches for these shapes, a compiled model's compiling; not eager passes,
which runs plain's shapes), then once per round, every other round in reverse order, so that the machine's drift
and a method's place in the round hit all alike.
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from collections.abc import Callable

import torch
import torch.nn as nn
from _methods import schedule_of
from _steps import NoFloor, compiled_model, first_step, is_compiled
from _table import Times


def timed(model: nn.Module, step: Callable[[nn.Module], None], device: torch.device, steps: int = 1) -> float:
    """Seconds per step of `steps` steps, each from fresh gradients (set to None, untimed)."""
    total = 0.0
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(model)
        if device.type == "cuda":
            torch.cuda.synchronize()
        total += time.perf_counter() - start
    return total / steps


def time_methods(steps: dict[str, Callable[[nn.Module], None]], base: nn.Module, args: argparse.Namespace,
                 device: torch.device, label: str) -> Times:
    """Each method's time in each round and in its first, untimed step (`steps` starts with plain); a method that
    raises is "failed" ("n/a": a floor this model has none of) and the others go on. Passes is timed in the first
    --passes-rounds rounds only. A compiled method runs on a compiled copy of its own, compiled in its first step
    from empty caches (`_steps.first_step`)."""
    # the same weights; each its own running statistics
    models = {m: compiled_model(m, copy.deepcopy(base), args.compile) for m in steps}
    times: dict[str, list[float | None]] = {m: [] for m in steps}
    first: dict[str, float] = {}
    failed: dict[str, str] = {}

    def attempt(m: str, repeats: int = 1) -> float | None:
        if m in failed:
            return None
        try:
            return timed(models[m], steps[m], device, repeats)
        except NoFloor as e:
            failed[m] = "n/a"
            print(f"note: {label} {m}: {e}", file=sys.stderr, flush=True)
        except Exception as e:  # reported; the other methods go on
            failed[m] = "failed"
            print(f"note: {label} {m} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return None

    for m in steps:  # warm-up, untimed: first-call costs, the kernels' caches for these shapes, compiling
        if schedule_of(m) != "passes" or is_compiled(m):  # eager passes runs plain's shapes, warmed up already
            with first_step(m):
                t = attempt(m)
            if t is not None:
                first[m] = t
    order = list(steps)
    repeats = steps_per_round(first.get(order[0]), args.min_round_ms)
    for r in range(args.rounds):
        # Every other round in reverse order: a method gains nothing from its place in the round.
        for m in order if r % 2 == 0 else order[::-1]:
            passes = schedule_of(m) == "passes"
            times[m].append(attempt(m, repeats) if not passes or r < args.passes_rounds else None)
    return Times({m: failed.get(m, times[m]) for m in steps}, first)


def steps_per_round(plain_first: float | None, min_round_ms: float) -> int:
    """How many steps each method takes in a round: enough that plain's take --min-round-ms (estimated from its
    first, untimed step), the same for every method. One step of a small model is over before the machine's noise
    averages out; more of them per round steady each round's ratio, and the median over rounds stays unbiased."""
    if plain_first is None or plain_first <= 0:
        return 1
    return max(1, math.ceil(min_round_ms / 1000 / plain_first))
