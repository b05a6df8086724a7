"""Cost of exact BatchNorm under accumulation: plain PyTorch accumulation against both exact schedules.

For each model and each accumulation config BxK (micro-batch B, K micro-batches, one optimizer step's
gradient over B*K samples), it times side by side, interleaved round by round so that machine noise
hits all alike:
  plain      the loop people write: torch BatchNorm, loss / K, backward, K times
  layerwise  accumnorm.backward(schedule="layerwise"): micro-batches in lockstep, whole-batch BatchNorm
  passes     accumnorm.backward(schedule="passes"): 2L + 1 passes for L BatchNorm calls
and prints the median ms per step and the ratio to plain. Memory, from one extra untimed step each: the
peak bytes of autograd's saved tensors held by the step (saved-tensor hooks; the layerwise schedule runs
its forwards in worker threads, which inherit the caller's hooks; parameters are not counted), which on
the CPU includes the layerwise store (the model's device by default); on CUDA also the device peak
(torch.cuda.max_memory_allocated above the model) and the peak of pinned host memory (the layerwise
store's default home there).

A method whose first (warm-up) step takes more than --budget / --rounds seconds gets fewer timed rounds
(at least one: its warm-up time when a single step exceeds --budget): passes on resnet50 costs about
a hundred passes per step. Not a test: the machine's load moves the numbers; run it on a quiet machine.

    python benchmarks/bench_backward.py [--quick] [--models resnet18,resnet50] [--configs 4x4,2x8]
                                        [--rounds 5] [--threads 2] [--size 32] [--device cpu]
"""
from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import accumnorm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from helpers import SavedBytes  # noqa: E402 - the tests' saved-tensor meter, not a second copy of it

DATA = ROOT.parent / "shared" / "data" / "mnist-mini"
MODELS = ("study", "resnet18", "resnet50", "mobilenet_v3_small", "efficientnet_b0")
METHODS = ("plain", "layerwise", "passes")
MB = 2**20


def build(name: str, size: int) -> tuple[nn.Module, tuple[int, ...]]:
    """A model with torch's BatchNorm (unconverted: exact mode needs no conversion) and one sample's shape."""
    if name == "study":
        from accumnorm.study.model import SimpleModel

        return SimpleModel(nn.BatchNorm2d), (1, 28, 28)
    import torchvision

    return torchvision.models.get_model(name, weights=None, num_classes=10), (3, size, size)


def inputs(name: str, shape: tuple[int, ...], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST digits for the study net when ../shared has them, else noise (timing does not depend on pixels)."""
    if name == "study":
        try:
            from torchvision.datasets import MNIST

            ds = MNIST(str(DATA), train=True, download=False)
            return ds.data[:n].unsqueeze(1).float() / 255, ds.targets[:n]
        except Exception:  # torchvision or the data missing
            pass
    return torch.randn(n, *shape), torch.randint(0, 10, (n,))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def plain_step(model: nn.Module, batch, micro: int) -> None:
    """What people write today: each micro-batch's loss divided by K, backward, K times."""
    x, y = batch
    k = math.ceil(len(x) / micro)
    for xb, yb in zip(x.split(micro), y.split(micro)):
        (loss_fn(model, (xb, yb)) / k).backward()


def steps(model: nn.Module, batch, micro: int) -> tuple[dict[str, Callable[[], None]], dict[str, nn.Module]]:
    """One optimizer step's gradient by each method, each on its own copy of the model (same weights)."""
    copies = {m: copy.deepcopy(model) for m in METHODS}

    def exact(schedule: str) -> Callable[[], None]:
        m = copies[schedule]
        return lambda: accumnorm.backward(m, batch, loss_fn, micro_batch_size=micro, schedule=schedule)

    def zeroed(fn: Callable[[], None], m: nn.Module) -> Callable[[], None]:
        def step() -> None:
            m.zero_grad(set_to_none=True)
            fn()
        return step

    fns = {"plain": lambda: plain_step(copies["plain"], batch, micro), "layerwise": exact("layerwise"),
           "passes": exact("passes")}
    return {name: zeroed(fn, copies[name]) for name, fn in fns.items()}, copies


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], None], device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def time_steps(fns: dict[str, Callable[[], None]], rounds: int, budget: float,
               device: torch.device) -> dict[str, tuple[float, int]]:
    """Median seconds per step of each method and the number of rounds it got, interleaved round-robin."""
    warm = {name: timed(fn, device) for name, fn in fns.items()}  # warm-up, and what a step costs
    times: dict[str, list[float]] = {name: [] for name in fns}
    want = {name: min(rounds, max(1, int(budget / w))) for name, w in warm.items()}
    for name, w in warm.items():
        if w > budget:  # one step is over the budget: its warm-up is the measurement
            times[name].append(w)
    for _ in range(rounds):
        for name, fn in fns.items():
            if len(times[name]) < want[name]:
                times[name].append(timed(fn, device))
    return {name: (statistics.median(ts), len(ts)) for name, ts in times.items()}


def memory(fns: dict[str, Callable[[], None]], copies: dict[str, nn.Module],
           device: torch.device) -> dict[str, dict[str, int]]:
    """Per method, from one untimed step: peak saved-tensor bytes; on CUDA device and pinned-host peaks."""
    out = {}
    for name, fn in fns.items():
        model = copies[name]
        model.zero_grad(set_to_none=True)
        row = {}
        if device.type == "cuda":
            sync(device)
            base = torch.cuda.memory_allocated(device)  # weights and the batch: held whatever the step does
            torch.cuda.reset_peak_memory_stats(device)
            torch.cuda.reset_peak_host_memory_stats()
        with SavedBytes(model.parameters()) as saved:  # weights are saved by reference: not the step's
            fn()
        row["saved"] = saved.peak
        if device.type == "cuda":
            sync(device)
            row["device"] = torch.cuda.max_memory_allocated(device) - base
            row["pinned"] = torch.cuda.host_memory_stats().get("active_bytes.peak", 0)
        out[name] = row
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    p.add_argument("--configs", default="4x4,2x8", help="micro-batch x micro-batches per step, e.g. 4x4,2x8")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per method (fewer for slow ones)")
    p.add_argument("--budget", type=float, default=20.0, help="seconds of timed steps per method and config")
    p.add_argument("--size", type=int, default=32, help="input height and width of the torchvision models")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads; 0 keeps the default")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--no-memory", action="store_true", help="skip the untimed memory steps")
    p.add_argument("--quick", action="store_true", help="study net and resnet18, 4x4, 2 rounds: a smoke run")
    a = p.parse_args()
    if a.quick:
        a.models, a.configs, a.rounds, a.budget = "study,resnet18", "4x4", 2, 5.0
    names = a.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {', '.join(unknown)}: expected some of {', '.join(MODELS)}")
    try:
        configs = [tuple(int(v) for v in c.lower().split("x")) for c in a.configs.split(",")]
    except ValueError:
        p.error(f"--configs must look like 4x4,2x8 (micro-batch x micro-batches), got {a.configs!r}")
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    print(f"{device.type}, {torch.get_num_threads()} threads, torch {torch.__version__}, inputs {a.size}x{a.size} "
          f"(study net: 28x28 digits), median of up to {a.rounds} interleaved rounds, BxK = micro-batch x count")
    header = f"{'model':20s} {'BN':>3s} {'BxK':>5s} | " + " | ".join(f"{m:>9s} ms" for m in METHODS) \
        + " | layerwise/plain  passes/plain | rounds"
    if not a.no_memory:
        header += " | saved MB " + "/".join(METHODS)
        if device.type == "cuda":
            header += " | device MB, pinned MB " + "/".join(METHODS)
    print(header)
    t_start = time.perf_counter()
    for name in names:
        torch.manual_seed(0)
        model, shape = build(name, a.size)
        model = model.to(device)
        layers = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        for micro, count in configs:
            batch = tuple(t.to(device) for t in inputs(name, shape, micro * count))
            fns, copies = steps(model, batch, micro)
            t = time_steps(fns, a.rounds, a.budget, device)
            plain = t["plain"][0]
            line = (f"{name:20s} {layers:3d} {micro:>2d}x{count:<2d} | "
                    + " | ".join(f"{t[m][0] * 1e3:12.1f}" for m in METHODS)
                    + f" | {t['layerwise'][0] / plain:14.2f}x {t['passes'][0] / plain:12.2f}x | "
                    + "/".join(str(t[m][1]) for m in METHODS))
            if not a.no_memory:
                mem = memory(fns, copies, device)
                line += " | " + "/".join(f"{mem[m]['saved'] / MB:.1f}" for m in METHODS)
                if device.type == "cuda":
                    line += " | " + "/".join(f"{mem[m]['device'] / MB:.0f}, {mem[m]['pinned'] / MB:.0f}"
                                             for m in METHODS)
            print(line, flush=True)
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
