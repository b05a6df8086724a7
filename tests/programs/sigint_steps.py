"""Real SIGINTs at random moments of accumnorm.backward steps: after each, the model is either as it was (the step
was interrupted and rolled back) or as the uninterrupted step leaves it, and nothing of the step is alive.

    python tests/programs/sigint_steps.py --mid-step 10   # prints one line per path, exits 1 on any violation

Each path is interrupted until `--mid-step` signals have landed inside a step, however slow the machine: each moment
is drawn over the time the last whole step took, and the kernel's interval timer fires it, not a thread, which a
loaded machine may schedule after the step is over: SIGALRM's handler calls SIGINT's handler (accumnorm's, during
a step) as Python would for a SIGINT landing at that bytecode. `--max-tries` only guards against an interrupt
that never lands inside a step.
"""
from __future__ import annotations

import argparse
import copy
import gc
import random
import signal
import sys
import time
from traceback import walk_tb as traceback_frames

import greenlet
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import accumnorm

PATHS = {"layerwise": dict(schedule="layerwise"), "recompute": dict(schedule="recompute"),
         "passes": dict(schedule="passes"), "micro": dict(bn="micro"),
         # The segments schedule at two settings: every region's arguments kept, or every other one's recomputed
         # (segments runs no BatchNorm inside a checkpoint of the user's: `Chain`, not `Net`)
         "segments": dict(schedule="segments", keep_every=1), "segments-2": dict(schedule="segments", keep_every=2),
         # A loss over the whole batch: the micro-batches meet at the loss too; and, on a model without norm
         # statistics, "auto"'s one micro-batch at a time (GradCache's scheme).
         "whole-layerwise": dict(schedule="layerwise", whole=True),
         "whole-gradcache": dict(schedule="auto", whole=True),
         # torch.compile'd (aot_eager): graph breaks at each BatchNorm call, the checkpointed region run eagerly
         "compiled-layerwise": dict(schedule="layerwise", compiled=True)}


class Net(nn.Module):
    """BatchNorm in and out of a checkpointed region, dropout, an InstanceNorm with running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Tanh(), nn.Dropout(0.2))
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Tanh(),
                                   nn.InstanceNorm2d(8, track_running_stats=True))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 8 * 8, 10), nn.BatchNorm1d(10))

    def forward(self, x):
        x = self.stem(x)
        return self.head(checkpoint(self.block, x, use_reentrant=False))


class Chain(Net):
    """`Net`'s layers without the user's checkpoint, with one block more: a chain of regions for segments."""

    def __init__(self) -> None:
        super().__init__()
        self.block2 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Tanh())

    def forward(self, x):
        return self.head(self.block2(self.block(self.stem(x))))


class Plain(nn.Module):
    """No norm with batch statistics: "auto" runs a whole-batch loss one micro-batch at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.Tanh(), nn.Dropout(0.2), nn.Flatten(),
                                  nn.Linear(8 * 8 * 8, 10))

    def forward(self, x):
        return self.body(x)


def forward_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def batch_loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, targets)


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in (*(p.grad for p in model.parameters()), *model.buffers())]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def live_coroutines() -> int:
    gc.collect()
    return sum(issubclass(type(o), greenlet.greenlet) and not o.dead and o is not greenlet.getcurrent()
               for o in gc.get_objects())


def _sigint(signum: int, frame) -> None:
    """SIGALRM's handler: SIGINT's handler, called as Python calls it for a SIGINT that lands here (with the frame the
    signal interrupted; a SIGINT sent from this handler would find the handler's own frame instead)."""
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)


def _land_the_alarm() -> None:
    """Wait until the try's alarm has fired (its SIGINT lands here if not during the step), then a moment more for the
    SIGINT's handler to run."""
    while signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        time.sleep(signal.getitimer(signal.ITIMER_REAL)[0])
    time.sleep(0.001)


def run_path(name: str, kwargs: dict, mid_step: int, min_tries: int, max_tries: int, rng: random.Random) -> list[str]:
    torch.manual_seed(0)
    kwargs = dict(kwargs)
    whole, compiled = kwargs.pop("whole", False), kwargs.pop("compiled", False)
    model = {"whole-gradcache": Plain, "segments": Chain, "segments-2": Chain}.get(name, Net)()
    batch = torch.randn(12, 1, 8, 8), torch.randint(0, 10, (12,))
    compiled_copies: dict[int, nn.Module] = {}  # each model's compiled module, made at its first step

    def step(model: nn.Module) -> None:
        if compiled:
            model = compiled_copies.setdefault(id(model), torch.compile(model, backend="aot_eager"))
        if whole:
            accumnorm.backward(model, batch[0], micro_batch_size=3, forward_fn=forward_fn, batch_loss_fn=batch_loss_fn,
                               targets=batch[1], **kwargs)
        else:
            accumnorm.backward(model, batch, loss_fn, micro_batch_size=3, **kwargs)

    step(model)  # gradients and statistics to keep
    before, rng_before = state(model), torch.random.get_rng_state()
    done = copy.deepcopy(model)  # deepcopy leaves .grad behind
    for p, q in zip(model.parameters(), done.parameters()):
        q.grad = p.grad.clone()
    start = time.perf_counter()
    step(done)
    step_s = time.perf_counter() - start
    torch.random.set_rng_state(rng_before)
    after, rng_after = state(done), None
    problems, tries, interrupted, rolled_back, late = [], 0, 0, 0, 0
    while (rolled_back < mid_step or tries < min_tries) and tries < max_tries:
        i, tries = tries, tries + 1
        torch.random.set_rng_state(rng_before)
        # Every other moment near the step's end, where it commits and returns.
        moment = rng.uniform(1e-6, 1.2 * step_s) if i % 2 else rng.uniform(0.8, 1.1) * step_s
        raised = False
        try:
            try:
                start = time.perf_counter()
                signal.setitimer(signal.ITIMER_REAL, moment)
                step(model)
                step_s = time.perf_counter() - start  # a whole step: the next moment is drawn over its time
            finally:
                _land_the_alarm()
        except KeyboardInterrupt as e:
            interrupted += 1
            # Raised inside the step, not by the alarm landing after it returned.
            raised = any(frame.f_globals.get("__name__", "").startswith("accumnorm.")
                         for frame, _ in traceback_frames(e.__traceback__))
        except Exception as e:  # an interrupt must come out as itself
            problems.append(f"{name} try {i}: the interrupt came out as {type(e).__name__}: {e}")
        now = state(model)
        if rng_after is None and same(now, after):
            rng_after = torch.random.get_rng_state()
        rolled_back += same(now, before)
        if raised and not same(now, before):
            late += 1
            problems.append(f"{name} try {i}: a KeyboardInterrupt reached the caller after the step's changes were "
                            "made")
        if not (same(now, before) or same(now, after)):
            names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
            differ = [n for n, x, y, z in zip(names, now, before, after)
                      if not (torch.equal(x, y) or torch.equal(x, z))]
            problems.append(f"{name} try {i}: the model is neither as it was nor as the step leaves it: {differ[:4]}")
        if live_coroutines():
            problems.append(f"{name} try {i}: a coroutine of the step is still alive")
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        thread_state = (torch.is_grad_enabled(), torch._C._len_torch_function_stack(),
                        torch._C._len_torch_dispatch_stack(), hooks)
        if thread_state != (True, 0, 0, None):
            problems.append(f"{name} try {i}: the thread's torch state changed: grad mode, function modes, "
                            f"dispatch modes, saved-tensor hooks = {thread_state}")
            return problems
        # Back to the starting point for the next try.
        with torch.no_grad():
            for t, saved in zip((*(p.grad for p in model.parameters()), *model.buffers()), before):
                t.copy_(saved)
    if rolled_back < mid_step:
        problems.append(f"{name}: only {rolled_back} of {tries} interrupts landed inside a step, {mid_step} wanted")
    print(f"{name}: {tries} tries, {interrupted} interrupted ({rolled_back} during the step, rolled back), "
          f"{late} late, {len(problems)} problems", flush=True)
    return problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mid-step", type=int, default=10, help="interrupts that must land inside a step, per path")
    p.add_argument("--min-tries", type=int, default=0, help="per path: tries at least this many")
    p.add_argument("--paths", default=",".join(PATHS), help="comma-separated, of: " + ", ".join(PATHS))
    p.add_argument("--max-tries", type=int, default=1000, help="per path: the guard against an interrupt that never "
                   "lands inside a step")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job starts with SIGINT ignored
    signal.signal(signal.SIGALRM, _sigint)
    rng = random.Random(args.seed)
    problems = [msg for name in args.paths.split(",")
                for msg in run_path(name, PATHS[name], args.mid_step, args.min_tries, args.max_tries, rng)]
    for msg in problems[:20]:
        print(msg)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
