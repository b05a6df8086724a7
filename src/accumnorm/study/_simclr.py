"""SimCLR under gradient accumulation: the study's second task (`accumnorm study --task simclr`).

A contrastive loss couples the samples of a batch twice: through BatchNorm, and through the loss itself
(NT-Xent takes every other view in the batch as a negative). Plain accumulation splits both; this task
measures what that costs, against the methods that keep one or both whole:

- ``bn-whole``: the whole batch in one forward/backward of plain torch, the reference (the split does not
  apply: it trains once per effective batch size and stands in every column of that size);
- ``bn``: plain accumulation, BatchNorm and NT-Xent per micro-batch (`accumnorm.backward(..., loss_fn,
  bn="micro")`, NT-Xent over each micro-batch's pairs);
- ``bn-gradcache``: BatchNorm per micro-batch, NT-Xent over the whole batch (GradCache's scheme:
  `forward_fn`/`batch_loss_fn` with `bn="micro"`);
- ``bn-exact``: both whole, the gradient of bn-whole (`forward_fn`/`batch_loss_fn`, `bn="exact"`);
- ``gn``: GroupNorm instead of BatchNorm, NT-Xent over the whole batch (exact at any split).

The protocol: a small ResNet-like encoder (3 residual stages, 16-32-64 channels, global average pool to a
64-d representation) and SimCLR's projection head (Linear, norm, ReLU, Linear to 32-d); two views of each
image (random resized crop with a small rotation, then Gaussian noise), both views of a micro-batch in one
forward so that BatchNorm sees all of them; NT-Xent at `temperature`; Adam. Run r seeds the weights with
seed + r, and draws its data order and views from generators of its own, so every method of run r starts
from the same weights and sees the same views at every step. An evaluation is a linear probe: the encoder
frozen (eval mode), a logistic regression trained on the training images' features, its accuracy on the
validation images (results.csv's valid_acc). train_loss is the loss each method minimizes, so plain
accumulation's (NT-Xent over a micro-batch, fewer negatives) is lower and not comparable with the others'.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import accumnorm

from ._data import Dataset
from ._settings import WHOLE, SimCLRSettings, parse_config, whole_cell
from ._simclr_report import write_report
from ._tasks import data_order

__all__ = ["SimCLRNet", "SIMCLR", "two_views", "nt_xent", "project", "train_step", "linear_probe"]

PROBE_STEPS = 300  # full-batch Adam steps of the linear probe: its accuracy changes by < 0.002 past ~200 here
_VIEW_SEED = 0x5EED  # views come from a generator seeded seed + r + this, apart from the data order's


class _Block(nn.Module):
    """A basic residual block: conv-norm-ReLU-conv-norm, plus the input (projected when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.conv1, self.norm1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), norm(cout)
        self.conv2, self.norm2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), norm(cout)
        self.shortcut = (nn.Identity() if stride == 1 and cin == cout
                         else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), norm(cout)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm2(self.conv2(F.relu(self.norm1(self.conv1(x)))))
        return F.relu(y + self.shortcut(x))


class SimCLRNet(nn.Module):
    """Encoder (a 3-stage ResNet-like net to a 64-d representation) and SimCLR's projection head.

    `norm`: "bn" (torch's BatchNorm2d/1d) or "gn" (GroupNorm of 8 groups, in the head too).
    """

    def __init__(self, norm: str = "bn", in_channels: int = 1, widths: Sequence[int] = (16, 32, 64),
                 projection: int = 32) -> None:
        super().__init__()
        if norm == "bn":
            norm2d, norm1d = nn.BatchNorm2d, nn.BatchNorm1d
        elif norm == "gn":
            norm2d = norm1d = lambda c: nn.GroupNorm(8, c)  # noqa: E731
        else:
            raise ValueError(f"norm must be 'bn' or 'gn', got {norm!r}")
        stages, prev = [], widths[0]
        for width in widths:
            stages.append(_Block(prev, width, 2, norm2d))
            prev = width
        self.encoder = nn.Sequential(nn.Conv2d(in_channels, widths[0], 3, 2, 1, bias=False), norm2d(widths[0]),
                                     nn.ReLU(), *stages, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Sequential(nn.Linear(prev, prev, bias=False), norm1d(prev), nn.ReLU(),
                                  nn.Linear(prev, projection))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def _augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One random view of each image: a crop of 35-100% of its area (aspect 3/4 to 4/3) anywhere in it, rotated
    by up to 15 degrees and resized back, plus Gaussian noise of std 0.1. Parameters from `gen` (CPU)."""
    n = len(x)

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return torch.rand(n, generator=gen, dtype=torch.float64) * (hi - lo) + lo

    area, ratio = uniform(0.35, 1.0), uniform(math.log(3 / 4), math.log(4 / 3)).exp()
    sx, sy = (area * ratio).sqrt().clamp(max=1), (area / ratio).sqrt().clamp(max=1)  # crop side / image side
    angle = uniform(-math.pi / 12, math.pi / 12)
    tx, ty = uniform(-1, 1) * (1 - sx), uniform(-1, 1) * (1 - sy)
    cos, sin = angle.cos(), angle.sin()
    theta = torch.stack([torch.stack([sx * cos, -sy * sin, tx], 1), torch.stack([sx * sin, sy * cos, ty], 1)], 1)
    grid = F.affine_grid(theta.to(x), list(x.shape), align_corners=False)
    noise = torch.randn(x.shape, generator=gen).to(x)
    return F.grid_sample(x, grid, align_corners=False) + 0.1 * noise


def two_views(x: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent random views of each image of `x` (N, C, H, W), drawn from `gen`."""
    return _augment(x, gen), _augment(x, gen)


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, temperature: float) -> torch.Tensor:
    """SimCLR's NT-Xent: each of the 2N views must pick its other view among the 2N - 1 others, by cosine
    similarity over `temperature`; the mean over the 2N views."""
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    n = len(z1)
    sim = (z @ z.T / temperature).fill_diagonal_(float("-inf"))
    targets = torch.arange(2 * n, device=z.device).roll(n)  # view i's other view is i + n, and i - n
    return F.cross_entropy(sim, targets)


def project(model: nn.Module, views: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Both views of a (micro-)batch through `model` in one forward, so that BatchNorm sees every view of it;
    returns the projections of the first and second views, one row per image."""
    v1, v2 = views
    z = model(torch.cat([v1, v2]))
    return z[:len(v1)], z[len(v1):]


def train_step(method: str, model: nn.Module, views: tuple[torch.Tensor, torch.Tensor], micro_batch_size: int,
               temperature: float) -> torch.Tensor:
    """Add to .grad the gradient that `method` (a key of METHODS) takes for this batch of views; return the loss
    it minimizes (detached)."""
    def batch_loss(outputs: tuple[torch.Tensor, torch.Tensor], targets: Any = None) -> torch.Tensor:
        return nt_xent(*outputs, temperature)

    if method == WHOLE:
        loss = batch_loss(project(model, views))
        loss.backward()
        return loss.detach()
    if method == "bn":
        return accumnorm.backward(model, views, lambda m, micro: batch_loss(project(m, micro)),
                                  micro_batch_size=micro_batch_size, bn="micro")
    return accumnorm.backward(model, views, micro_batch_size=micro_batch_size, forward_fn=project,
                              batch_loss_fn=batch_loss, bn="micro" if method == "bn-gradcache" else "exact")


@torch.no_grad()
def _features(encoder: nn.Module, x: torch.Tensor, batch: int = 500) -> torch.Tensor:
    return torch.cat([encoder(xb) for xb in x.split(batch)])


def linear_probe(encoder: nn.Module, data: Dataset, steps: int = PROBE_STEPS) -> float:
    """Validation accuracy of a linear classifier on the frozen encoder's features.

    The encoder runs in eval mode (BatchNorm's running statistics, as a deployed encoder would); the features
    are standardized with the training set's mean and std; the classifier starts at zero and takes `steps`
    full-batch Adam steps of cross-entropy on the training images. Nothing here draws random numbers.
    """
    was_training = encoder.training
    encoder.eval()
    try:
        train_f, valid_f = _features(encoder, data.train_x), _features(encoder, data.valid_x)
    finally:
        encoder.train(was_training)
    mean, std = train_f.mean(0), train_f.std(0).clamp_min(1e-6)
    train_f, valid_f = (train_f - mean) / std, (valid_f - mean) / std
    weight = torch.zeros(train_f.shape[1], data.num_classes, device=train_f.device, requires_grad=True)
    bias = torch.zeros(data.num_classes, device=train_f.device, requires_grad=True)
    optimizer = torch.optim.Adam([weight, bias], lr=0.01)
    with torch.enable_grad():
        for _ in range(steps):
            optimizer.zero_grad()
            F.cross_entropy(train_f @ weight + bias, data.train_y).backward()
            optimizer.step()
    with torch.no_grad():
        return float(((valid_f @ weight + bias).argmax(1) == data.valid_y).float().mean())


def train(name: str, b: int, k: int, runs: Sequence[int], data: Dataset, settings: SimCLRSettings,
          on_step: Callable[[int], None]) -> list[dict[str, Any]]:
    """Train each of `runs` of cell (method `name`, B=b, K=k) in turn; one row per run per evaluation."""
    rows = []
    for r in runs:
        rows += _train_run(name, b, k, r, data, settings, on_step)
    return rows


def _train_run(name: str, b: int, k: int, run: int, data: Dataset, settings: SimCLRSettings,
               on_step: Callable[[int], None]) -> list[dict[str, Any]]:
    device = data.train_x.device
    torch.manual_seed(settings.seed + run)  # every method of run r starts from the same weights
    model = SimCLRNet("gn" if name == "gn" else "bn", in_channels=data.train_x.shape[1]).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
    order = data_order(len(data.train_x), settings.iterations, b * k, [settings.seed + run])[0].to(device)
    views = torch.Generator().manual_seed((settings.seed + run + _VIEW_SEED) % 2**64)
    loss_sum, steps = torch.zeros((), device=device), 0
    rows, start = [], time.perf_counter()
    for it in range(1, settings.iterations + 1):
        loss_sum += train_step(name, model, two_views(data.train_x[order[it - 1]], views), b, settings.temperature)
        steps += 1
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        on_step(1)
        if it % settings.eval_every == 0:
            rows.append(dict(norm=name, batch_size=b, num_accum=k, run=run, iter=it,
                             train_loss=float(loss_sum) / steps, valid_acc=linear_probe(model.encoder, data),
                             seconds=round(time.perf_counter() - start, 3)))
            loss_sum, steps = torch.zeros_like(loss_sum), 0
    return rows


class _SimCLRTask:
    """SimCLR as the runner's task (see tasks.StudyTask)."""

    def cells(self, settings: SimCLRSettings) -> list[tuple[str, int, int]]:
        cells = [whole_cell(name, *parse_config(c)) for name in settings.methods for c in settings.configs]
        return list(dict.fromkeys(cells))  # bn-whole once per effective batch size

    def groups(self, name: str, runs: tuple[int, ...]) -> list[tuple[int, ...]]:
        return [(r,) for r in runs]  # one run per task: the worker processes share out the runs

    def train(self, *args: Any) -> list[dict[str, Any]]:
        return train(*args)

    def report(self, out: Path, settings: SimCLRSettings, rows: list[dict[str, Any]],
               failures: dict[tuple[str, int, int], str], **info: Any) -> None:
        write_report(out, settings, rows, failures, **info)


SIMCLR = _SimCLRTask()
