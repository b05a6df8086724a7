"""What each norm costs per optimizer step relative to torch's BatchNorm, side by side, under accumulation.

One run of the study's net (SimpleModel, MNIST-sized 28x28 inputs) per norm, one optimizer step of K
micro-batches of B through `accumnorm.backward` (bn="exact" for bn-exact, else plain accumulation, the
literal loop for every norm alike), Adam, the same thread count. Rounds interleave the norms so that
the machine's load moves them together; the median of the rounds is printed. Not a test.

  python benchmarks/bench_norms.py --threads 1
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import accumnorm
from accumnorm.study._model import EXACT_BN, SimpleModel, norm_fn

NORMS = ("bn", "bn-exact", "brn", "bn-stale", "frn", "evonorm-s0", "gn16", "in")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--norms", default=",".join(NORMS))
    p.add_argument("--configs", default="1x16,2x8,4x4,16x1")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    norms, configs = a.norms.split(","), [tuple(map(int, c.split("x"))) for c in a.configs.split(",")]

    def loss_fn(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1])

    print(f"ms per optimizer step (median of {a.rounds} rounds), {a.threads} thread(s); in brackets: relative to bn")
    print(f"{'norm':12}" + "".join(f"{f'{b}x{k}':>18}" for b, k in configs))
    times = {}
    for b, k in configs:
        x, y = torch.rand(b * k, 1, 28, 28), torch.randint(0, 10, (b * k,))
        models = {}
        for name in norms:
            torch.manual_seed(0)
            model = SimpleModel(norm_fn(name))
            models[name] = (model, torch.optim.Adam(model.parameters(), lr=1e-3))
        samples = {name: [] for name in norms}
        for _ in range(a.rounds + 1):  # the first round warms up
            for name, (model, opt) in models.items():
                t0 = time.perf_counter()
                mode = "exact" if name == EXACT_BN else "micro"
                accumnorm.backward(model, (x, y), loss_fn, micro_batch_size=b, bn=mode)
                opt.step()
                opt.zero_grad(set_to_none=True)
                samples[name].append(time.perf_counter() - t0)
        for name in norms:
            times[(name, b, k)] = 1000 * statistics.median(samples[name][1:])
    for name in norms:
        cells = [f"{times[(name, b, k)]:7.1f} ({times[(name, b, k)] / times[('bn', b, k)]:4.2f}x)" for b, k in configs]
        print(f"{name:12}" + "".join(f"{c:>18}" for c in cells))


if __name__ == "__main__":
    main()
