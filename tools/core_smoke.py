"""The core alone (`pip install .`: torch and greenlet, no extras): exact accumulation on a small model.

    python tools/core_smoke.py     # exits 1 if an extra got imported or the gradient is not whole-batch torch's

.ci/run runs it in a fresh virtual environment holding only what `pip install .` brings.
"""
from __future__ import annotations

import copy
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import accumnorm

EXTRAS = ("torchvision", "timm", "lightning", "accelerate", "tqdm", "matplotlib", "sklearn", "tensorboard")


def main() -> int:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3),
                          accumnorm.BatchNorm2d(), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 10)).double()
    model(torch.zeros(2, 1, 8, 8, dtype=torch.float64))  # the lazy layer learns its channels
    ref = copy.deepcopy(model)
    x, y = torch.randn(10, 1, 8, 8, dtype=torch.float64), torch.randint(0, 10, (10,))
    expected = F.cross_entropy(ref(x), y)
    expected.backward()
    loss = accumnorm.backward(model, (x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]), micro_batch_size=3)
    err = max(float((p.grad - q.grad).abs().max()) for p, q in zip(ref.parameters(), model.parameters()))
    imported = [name for name in EXTRAS if name in sys.modules]
    expected = expected.detach()
    print(f"accumnorm {accumnorm.__version__}, torch {torch.__version__}: loss {float(loss):.6f} (whole batch "
          f"{float(expected):.6f}), max gradient error {err:.1e}, extras imported: {imported or 'none'}")
    return 0 if err < 1e-10 and abs(float(loss - expected)) < 1e-12 and not imported else 1


if __name__ == "__main__":
    sys.exit(main())
