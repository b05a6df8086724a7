"""The least a schedule that meets the micro-batches at every BatchNorm call holds, beside "auto"'s budget.

layerwise, recompute and segments run the K micro-batches' forwards in lockstep: at each BatchNorm call all K are
paused there, each holding what its forward's frames hold (the call's input, a skip connection's tensor, ...), and
the call's output for the whole batch is made beside them. Summed over the K micro-batches, that is what one
forward of the whole batch without grad holds when the call returns: `forward_bound` measures it, the largest over
the calls. Set beside "auto"'s budget of 1.5x plain accumulation's peak (the median of fresh processes, measured as
bench_backward.py measures it), it says where no schedule but passes, which runs one micro-batch at a time, can fit
that budget, at any setting: the structural bound of docs/cost.md. It is a lower bound: it counts the forward's
meeting alone, not what a schedule keeps for its backward nor the gradients the step makes.

    python benchmarks/lockstep_bound.py --models study,simclr,efficientnet_b0 --ks 16,32 --peak-runs 3
"""
from __future__ import annotations

import argparse
import sys
import weakref
from typing import Any

import torch
import torch.nn as nn
from _memory import measure_runs, use_allocator
from _models import BATCH, MODELS
from _steps import prepare
from _table import mib
from bench_backward import parse_list
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

BUDGET = 1.5  # "auto"'s budget in bench_backward.py's frontier, times plain accumulation's peak


class _LiveTensors(TorchDispatchMode):
    """Every tensor the ops under it make, held weakly: `held()` is the bytes of the storages still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[weakref.ref] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.made += [weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out

    def held(self, own: set[int]) -> int:
        """`own`: the storages of the model's parameters and buffers, which an op in place returns (not counted)."""
        alive = [(ref, t) for ref in self.made if (t := ref()) is not None]
        self.made = [ref for ref, _ in alive]
        storages = {s.data_ptr(): s.nbytes() for s in (t.untyped_storage() for _, t in alive)}  # a view's once
        return sum(n for ptr, n in storages.items() if ptr not in own)


def forward_bound(model: nn.Module, batch: Any, forward: Any) -> tuple[int, int]:
    """The most bytes `forward(model, batch)`, run without grad, holds as one of its BatchNorm layers' calls returns
    (the tensors it made and still holds, the call's output among them; not `batch`, nor the model's parameters and
    buffers, such as the `num_batches_tracked` each call counts up in place), and the calls made."""
    live, calls, most = _LiveTensors(), [0], [0]
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}

    def returned(module: nn.Module, args: Any, output: Any) -> None:
        calls[0] += 1
        most[0] = max(most[0], live.held(own))

    layers = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    handles = [m.register_forward_hook(returned) for m in layers]
    try:
        with torch.no_grad(), live:
            forward(model, batch)
    finally:
        for h in handles:
            h.remove()
    return most[0], calls[0]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated (default: every benchmark model)")
    p.add_argument("--ks", default="16,32", help="numbers of micro-batches, comma-separated (default 16,32)")
    p.add_argument("--peak-runs", type=int, default=3, help="fresh processes for plain's peak, the median (default 3)")
    p.add_argument("--size", type=int, default=64, help="input height and width of 2D models (default 64)")
    p.add_argument("--volume", type=int, default=32, help="input side of 3D models (default 32)")
    p.add_argument("--memory-threads", type=int, default=1, help="threads of the memory runs (default 1)")
    args = p.parse_args(argv)
    models = parse_list(p, "--models", args.models, list(MODELS))
    ks = parse_list(p, "--ks", args.ks, [k for k in range(1, BATCH + 1) if BATCH % k == 0], int)
    if args.peak_runs < 1 or args.memory_threads < 1:
        p.error(f"--peak-runs and --memory-threads must be >= 1, got {args.peak_runs} and {args.memory_threads}")
    args.device, args.allocator = "cpu", "keep"
    use_allocator(args.allocator)
    print(f"batch {BATCH}; plain's peak: the median of {args.peak_runs} fresh processes; budget {BUDGET}x plain's peak")
    print("| model | BN calls | forward bound MiB | K x b | plain peak MiB | budget MiB | bound / budget | "
          "only passes fits |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in models:
        prepared = prepare(name, args.size, args.volume, torch.device("cpu"))
        if prepared is None:
            continue
        bound, calls = forward_bound(*prepared, MODELS[name].micro_forward)
        for k in ks:
            plain = measure_runs(name, ["plain"], BATCH // k, args, timeout=3600)["plain"]
            if isinstance(plain, str):
                print(f"| {name} | {calls} | {mib(bound)} | {k}x{BATCH // k} | failed | | | |")
                continue
            budget = BUDGET * plain.peak
            print(f"| {name} | {calls} | {mib(bound)} | {k}x{BATCH // k} | {mib(plain.peak)} | {mib(int(budget))} | "
                  f"{bound / budget:.2f} | {'yes' if bound > budget else 'no'} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
