"""Exact BatchNorm under accumulation against plain PyTorch accumulation, side by side, on real networks.

For each model and split (micro-batch b x K accumulation steps = a batch of 16), one optimizer step's
gradient is made three ways, interleaved round by round so that machine noise hits all alike:

  plain      the models' own torch BatchNorm, the usual loop: loss * b / B, backward, K times
  layerwise  accumnorm.backward(schedule="layerwise"): micro-batches in lockstep, one joint node per BN call
  passes     accumnorm.backward(schedule="passes"): 2L + 1 passes for L BN calls

and prints the median milliseconds per step, each schedule's ratio to plain, and the memory each holds:
the peak bytes of autograd's saved tensors during the step (each storage counted once), which for the
layerwise schedule on a CPU is its store (the whole batch's saved tensors), and on CUDA the peak of
torch.cuda.max_memory_allocated (the store then lives in pinned host memory). Inputs are real MNIST
digits from ../shared/data/mnist-mini, upscaled to --size and repeated over 3 channels.

    python benchmarks/bench_backward.py                    # every model, 64x64, 4x4 and 2x8, 2 threads
    python benchmarks/bench_backward.py --models resnet18 --splits 4x4 --rounds 3 --passes-rounds 1
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import accumnorm

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "mnist-mini")
BATCH = 16


def study_net() -> nn.Module:
    """The study's VGG-like net: conv 32-64-128-256, each + BatchNorm + ReLU, max-pool between."""
    layers: list[nn.Module] = []
    c0 = 3
    for i, c in enumerate((32, 64, 128, 256)):
        layers += [nn.Conv2d(c0, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU()] + ([nn.MaxPool2d(2)] if i < 3 else [])
        c0 = c
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c0, 10))


def torchvision_model(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision

        model = getattr(torchvision.models, name)(num_classes=10)
        for m in model.modules():  # dropout would make the three runs differ; timing does not need it
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        return model
    return build


MODELS = {"study": study_net, **{n: torchvision_model(n) for n in
                                 ("resnet18", "resnet50", "mobilenet_v3_small", "efficientnet_b0")}}


def digits(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BATCH real MNIST digits at size x size, 3 channels (noise of that shape if the data is missing)."""
    try:
        from torchvision.datasets import MNIST

        ds = MNIST(DATA, train=True, download=False)
        x, y = ds.data[:BATCH].unsqueeze(1).float() / 255, ds.targets[:BATCH]
    except Exception:  # the timing does not depend on pixel values
        x, y = torch.rand(BATCH, 1, 28, 28), torch.randint(0, 10, (BATCH,))
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    return (x - 0.1307) / 0.3081, y


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def plain_step(model: nn.Module, batch, micro: int) -> None:
    x, y = batch
    for xb, yb in zip(x.split(micro), y.split(micro)):
        (loss_fn(model, (xb, yb)) * len(xb) / len(x)).backward()


def schedule_step(schedule: str) -> Callable[[nn.Module, tuple, int], None]:
    def step(model: nn.Module, batch, micro: int) -> None:
        accumnorm.backward(model, batch, loss_fn, micro_batch_size=micro, schedule=schedule)
    return step


METHODS = {"plain": plain_step, "layerwise": schedule_step("layerwise"), "passes": schedule_step("passes")}


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

        return t, Held()

    @staticmethod
    def unpack(packed) -> torch.Tensor:
        return packed[0]


def memory(model: nn.Module, batch, micro: int, method: Callable, device: torch.device) -> int:
    """Peak bytes held by one step: saved tensors on a CPU, max_memory_allocated on CUDA."""
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        method(model, batch, micro)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    saved = SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        method(model, batch, micro)
    return saved.peak


def timed(model: nn.Module, batch, micro: int, method: Callable, device: torch.device) -> float:
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    method(model, batch, micro)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def bench(name: str, micro: int, args: argparse.Namespace, device: torch.device) -> dict[str, tuple[float, int]]:
    torch.manual_seed(0)
    base = MODELS[name]().to(device)
    x, y = digits(args.size)
    batch = (x.to(device), y.to(device))
    models = {m: copy.deepcopy(base) for m in METHODS}  # same weights; each its own running statistics
    # The memory run is also the warm-up (allocator, first-call costs): it is not timed.
    peaks = {m: memory(model, batch, micro, METHODS[m], device) for m, model in models.items()}
    peaks["whole batch"] = memory(copy.deepcopy(base), batch, BATCH, plain_step, device)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for r in range(args.rounds):
        for method, model in models.items():
            if method != "passes" or r < args.passes_rounds:
                times[method].append(timed(model, batch, micro, METHODS[method], device))
    return {m: (statistics.median(times[m]) if times.get(m) else float("nan"), peak) for m, peak in peaks.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--splits", default="4x4,2x8", help="micro-batch x accumulation steps, each making 16")
    p.add_argument("--size", type=int, default=64, help="input height and width (default 64)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds of plain and layerwise (median)")
    p.add_argument("--passes-rounds", type=int, default=1, help="timed rounds of passes (slow on deep nets)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (0: torch's default)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
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
    mem = "peak MiB of saved tensors" if device.type == "cpu" else "peak MiB allocated on the device"
    print(f"batch {BATCH} at {args.size}x{args.size}, {device}, {torch.get_num_threads()} threads, "
          f"median of {args.rounds} interleaved rounds ({args.passes_rounds} for passes); memory: {mem}")
    print(f"{'model':<20}{'split':>6}{'BN':>5}{'plain ms':>10}{'layerwise':>17}{'passes':>18}"
          f"{'mem plain':>11}{'layerwise':>11}{'passes':>9}{'whole':>8}")
    for name in names:
        n_bn = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in MODELS[name]().modules())
        for micro in splits:
            r = bench(name, micro, args, device)
            t0 = r["plain"][0]
            cols = [f"{r[m][0] * 1e3:8.0f} ({r[m][0] / t0:4.2f}x)" for m in ("layerwise", "passes")]
            mib = [f"{r[m][1] / 2**20:9.1f}" for m in ("plain", "layerwise", "passes", "whole batch")]
            print(f"{name:<20}{f'{micro}x{BATCH // micro}':>6}{n_bn:>5}{t0 * 1e3:>10.0f}{cols[0]:>17}{cols[1]:>18}"
                  f"{mib[0]:>11}{mib[1]:>11}{mib[2]:>9}{mib[3]:>8}", flush=True)


if __name__ == "__main__":
    main()
