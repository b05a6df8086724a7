"""Cost of exact BatchNorm under accumulation, measured side by side with plain PyTorch accumulation.

For the study's net (conv 32-64-128-256, each + BatchNorm + ReLU, max-pool between) at micro-batch
1 x 16 on MNIST digits, it times one optimizer step's gradient three ways, interleaved round by round
so that machine noise hits all alike:
  plain  torch.nn.BatchNorm2d, the usual loop: loss / K, backward, K times
  micro  accumnorm.backward(bn="micro") (same maths as plain, through accumnorm)
  exact  accumnorm.backward(bn="exact") (whole-batch BatchNorm, 2L + 1 passes)
then how exact/plain grows with the number of BN layers (extra conv+BN blocks at the last stage).

    python benchmarks/bench_backward.py [--rounds 20] [--depths 4,8,16] [--threads 0]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import accumnorm

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "mnist-mini")


def study_net(norm: type[nn.Module], depth: int = 4) -> nn.Sequential:
    """The study's VGG-like net; depth > 4 repeats conv(256)+norm+ReLU blocks at the last stage."""
    layers: list[nn.Module] = []
    widths = [32, 64, 128] + [256] * (depth - 3)
    c0 = 1
    for i, c in enumerate(widths):
        layers += [nn.Conv2d(c0, c, 3, padding=1), norm(c), nn.ReLU()]
        if i < 3:
            layers.append(nn.MaxPool2d(2))
        c0 = c
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c0, 10))


def digits(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n real MNIST digits when ../shared/data/mnist-mini is there, else noise of the same shape."""
    try:
        from torchvision.datasets import MNIST

        ds = MNIST(DATA, train=True, download=False)
        return ds.data[:n].unsqueeze(1).float() / 255, ds.targets[:n]
    except Exception:  # torchvision or the data missing: the timing does not depend on pixel values
        return torch.rand(n, 1, 28, 28), torch.randint(0, 10, (n,))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def plain_step(model: nn.Module, batch, micro: int) -> None:
    """What people write today: each micro-batch's loss divided by K, backward, K times."""
    x, y = batch
    k = len(x) // micro
    for xb, yb in zip(x.split(micro), y.split(micro)):
        (loss_fn(model, (xb, yb)) / k).backward()


def time_steps(fns: dict, rounds: int) -> dict[str, float]:
    """Median seconds per call of each fn, run round-robin so that noise is shared."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--micro", type=int, default=1, help="micro-batch size")
    p.add_argument("--accum", type=int, default=16, help="micro-batches per step")
    p.add_argument("--depths", default="4,8,16", help="numbers of BN layers for the scaling table")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads; 0 keeps the default")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    batch = digits(a.micro * a.accum)
    print(f"micro-batch {a.micro} x {a.accum} accumulation = batch {a.micro * a.accum}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, {a.rounds} rounds (median)")

    print("\nstudy net (4 BN layers), seconds per optimizer step:")
    base = study_net(nn.BatchNorm2d)
    ours = accumnorm.convert(study_net(nn.BatchNorm2d))
    ours.load_state_dict(base.state_dict())
    fns = {
        "plain": lambda: plain_step(base, batch, a.micro),
        "micro": lambda: accumnorm.backward(ours, batch, loss_fn, micro_batch_size=a.micro, bn="micro"),
        "exact": lambda: accumnorm.backward(ours, batch, loss_fn, micro_batch_size=a.micro, bn="exact"),
    }
    t = time_steps(fns, a.rounds)
    for name, s in t.items():
        print(f"  {name:6s} {s * 1e3:8.1f} ms   {s / t['plain']:.2f}x plain")

    print("\nexact / plain as the net gets deeper:")
    print("  BN layers   plain ms   exact ms   ratio")
    for depth in (int(d) for d in a.depths.split(",")):
        base, ours = study_net(nn.BatchNorm2d, depth), accumnorm.convert(study_net(nn.BatchNorm2d, depth))
        t = time_steps({
            "plain": lambda: plain_step(base, batch, a.micro),
            "exact": lambda: accumnorm.backward(ours, batch, loss_fn, micro_batch_size=a.micro, bn="exact"),
        }, max(3, a.rounds // 2))
        print(f"  {depth:9d} {t['plain'] * 1e3:10.1f} {t['exact'] * 1e3:10.1f} {t['exact'] / t['plain']:7.2f}x")


if __name__ == "__main__":
    main()
