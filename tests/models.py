"""Small models for the oracle tests, built with torch's norms: the oracle runs them as they are, accumnorm
runs a copy (converted or not)."""
from __future__ import annotations

import functools
import random
from collections.abc import Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import accumnorm
from helpers import ce_loss, sgd_halving

Act = Callable[[], nn.Module]


def vgg(act: Act = nn.ReLU, widths=(8, 16, 16, 32), norm=nn.BatchNorm2d) -> nn.Module:
    """The study's VGG-like net, narrower: conv 3x3 + norm + act, max-pool between, avg-pool, linear."""
    layers, c0 = [], 1
    for i, c in enumerate(widths):
        layers += [nn.Conv2d(c0, c, 3, padding=1), norm(c), act()]
        if i < len(widths) - 1:
            layers.append(nn.MaxPool2d(2))
        c0 = c
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c0, 10))


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, act: Act) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.act = act()
        self.down = None
        if stride != 1 or cin != cout:  # a BatchNorm on the skip path too
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.act(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.act(out + (x if self.down is None else self.down(x)))


def resnet(act: Act = nn.ReLU) -> nn.Module:
    """A residual net: skip connections, BatchNorm on the downsample path."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), act(),
        Block(8, 8, 1, act), Block(8, 16, 2, act),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )


def mlp(act: Act = nn.Tanh) -> nn.Module:
    """MLP with BatchNorm1d on 2D inputs (N, C)."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(64, 32), nn.BatchNorm1d(32), act(),
        nn.Linear(32, 16), nn.BatchNorm1d(16), act(), nn.Linear(16, 10),
    )


class SeqNet(nn.Module):
    """BatchNorm1d on 3D inputs (N, C, L): a small 1D conv net over sequences."""

    def __init__(self, act: Act = nn.GELU) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv1d(4, 8, 3, padding=1), nn.BatchNorm1d(8), act(),
            nn.Conv1d(8, 8, 3, padding=1), nn.BatchNorm1d(8, affine=False), act(),
        )
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.body(x).mean(-1))


def conv3d(act: Act = nn.Tanh) -> nn.Module:
    """Conv3d net with BatchNorm3d."""
    return nn.Sequential(
        nn.Conv3d(1, 4, 3, padding=1), nn.BatchNorm3d(4), act(), nn.MaxPool3d(2),
        nn.Conv3d(4, 8, 3, padding=1), nn.BatchNorm3d(8, momentum=None), act(),
        nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(8, 10),
    )


def mixed(act: Act = nn.Tanh) -> nn.Module:
    """BatchNorm mixed with GroupNorm, InstanceNorm, LayerNorm (channels first) and no norm."""

    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), act(),
        nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(4, 8), act(),
        nn.Conv2d(8, 8, 3, padding=1), nn.InstanceNorm2d(8, affine=True), act(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), accumnorm.LayerNorm(16), act(),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), act(),
        nn.Conv2d(16, 16, 3, padding=1), act(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )


def no_bn() -> nn.Module:
    """Per-sample norms only: plain accumulation is already exact."""
    return vgg(nn.Tanh, norm=lambda c: nn.GroupNorm(4, c))


class Shared(nn.Module):
    """One BatchNorm layer called twice in a forward, on different tensors (running stats updated twice)."""

    def __init__(self, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 6, 3, padding=1), nn.Conv2d(6, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6, momentum=momentum)
        self.head = nn.Linear(6, 10)

    def forward(self, x):
        x = torch.tanh(self.bn(self.conv1(x)))
        x = torch.tanh(self.bn(self.conv2(x)))
        return self.head(x.mean((2, 3)))


class FunctionalBN(nn.Module):
    """BatchNorm through direct `F.batch_norm(..., training=True)` calls on the module's own tensors.

    The first call keeps running statistics in plain buffers (updated by F.batch_norm itself, with the
    momentum passed in); the second keeps none and has no affine parameters.
    """

    def __init__(self, act: Act = nn.Tanh) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.weight, self.bias = nn.Parameter(1 + 0.1 * torch.randn(8)), nn.Parameter(0.1 * torch.randn(8))
        self.register_buffer("running_mean", torch.zeros(8))
        self.register_buffer("running_var", torch.ones(8))
        self.act = act()
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        x = self.act(F.batch_norm(self.conv1(x), self.running_mean, self.running_var, self.weight, self.bias,
                                  training=True, momentum=0.3, eps=1e-4))
        x = self.act(F.batch_norm(self.conv2(x), None, None, training=True))
        return self.head(x.mean((2, 3)))


# Piecewise-linear activations and their smooth stand-ins: kinks (ReLU's at 0, where max-pool then sees
# ties between exact zeros) let rounding flip a gradient path, so tight float64 oracles use smooth ones.
SMOOTH = {nn.ReLU: nn.SiLU, nn.ReLU6: nn.SiLU, nn.Hardswish: nn.SiLU, nn.Hardsigmoid: nn.Sigmoid}


# The families with smooth activations (no ReLU kink, no max-pool ties), for float64 comparisons to 1e-9.
SMOOTH_FAMILIES = {"vgg": lambda: vgg(nn.Tanh), "resnet": lambda: resnet(nn.Tanh), "mlp": mlp, "seq": SeqNet,
                   "conv3d": conv3d, "mixed": mixed}


def smooth(model: nn.Module) -> nn.Module:
    """Swap every ReLU/ReLU6/Hardswish/Hardsigmoid module of `model` for SiLU/Sigmoid, in place."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) in SMOOTH:
                setattr(parent, name, SMOOTH[type(child)]())
    return model


def torchvision_model(name: str) -> nn.Module:
    """A torchvision classifier (torch's BatchNorm2d, unconverted), 10 classes, random weights."""
    import torchvision

    return torchvision.models.get_model(name, weights=None, num_classes=10)


def timm_model(name: str = "lcnet_035") -> nn.Module:
    """A timm classifier whose norms are timm's BatchNormAct2d (BatchNorm2d subclass + activation)."""
    import timm  # a test extra: accumnorm[dev] pulls accumnorm[timm]

    return timm.create_model(name, pretrained=False, num_classes=10)


# name -> (builder, input shape of one sample)
MODELS = {
    "vgg": (vgg, (1, 16, 16)),
    "resnet": (resnet, (1, 12, 12)),
    "mlp": (mlp, (64,)),
    "seq": (SeqNet, (4, 10)),
    "conv3d": (conv3d, (1, 6, 6, 6)),
    "mixed": (mixed, (1, 12, 12)),
}


def wide_first() -> nn.Sequential:
    """A VGG-like stack whose first BatchNorm call is wide (32 channels at full size) and everything after it small:
    at that call a lockstep holds the whole batch's wide input and output at once."""
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.Tanh(), nn.AvgPool2d(4),
                         nn.Conv2d(32, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Tanh(), nn.AvgPool2d(8),
                         nn.Flatten(), nn.Linear(4, 10)).double()


def wide_inside(width: int = 32) -> nn.Sequential:
    """A VGG-like stack whose first region makes one wide tensor of `width` channels (a convolution and its tanh) with
    no BatchNorm call on it, everything after it small: a lockstep's meeting at each BatchNorm call holds little,
    recompute's backward the first region's recomputation of the whole batch, the wide tensor included, and segments'
    backward one micro-batch's."""
    return nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.Tanh(), nn.Conv2d(width, 4, 3, padding=1),
                         nn.BatchNorm2d(4), nn.Tanh(), nn.AvgPool2d(4), nn.Conv2d(4, 4, 3, padding=1),
                         nn.BatchNorm2d(4), nn.Tanh(), nn.AvgPool2d(8), nn.Flatten(), nn.Linear(4, 10)).double()


def data(shape, n: int, dtype=torch.float32):
    return torch.randn(n, *shape, dtype=dtype), torch.randint(0, 10, (n,))


def tiny_bn(dtype: torch.dtype = torch.float64) -> nn.Module:
    """Conv-BN-Tanh twice and a BatchNorm1d head on (1, 8, 8) inputs, the same every call: small enough for
    tests that start a training framework. Tanh, not ReLU, and no conv bias before BN (its true gradient is
    0): float64 results agree with the whole-batch oracle to 1e-9, with no kink to fall on either side of."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.Tanh(), nn.AvgPool2d(2),
        nn.Conv2d(4, 8, 3, bias=False), nn.BatchNorm2d(8), nn.Tanh(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 10),
    ).to(dtype)


class TinyUnrolled(nn.Module):
    """`tiny_bn`'s layers called one by one in a forward of its own, for tests that torch.compile a model: dynamo
    compiles the code between the BatchNorm calls of this forward, where a graph break inside nn.Sequential's loop
    over its layers leaves a Sequential's forward uncompiled in a step."""

    def __init__(self, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.net = tiny_bn(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.net
        x = n[3](n[2](n[1](n[0](x))))
        x = n[8](n[7](n[6](n[5](n[4](x)))))
        return n[12](n[11](n[10](n[9](x))))


def tiny_dataset(n: int, dtype: torch.dtype = torch.float64) -> torch.utils.data.TensorDataset:
    """n samples for `tiny_bn`, the same every call (every rank of a test builds the same set)."""
    torch.manual_seed(1)
    return torch.utils.data.TensorDataset(*data((1, 8, 8), n, dtype))


def small_penalty(module: nn.Module) -> torch.Tensor:
    """A term a LightningModule's training_step adds to the loss it returns: 0.01 times the squared weights."""
    return 0.01 * sum(p.pow(2).sum() for p in module.parameters())


@functools.cache
def lit_classifier() -> type:
    """A LightningModule class around a classifier `net`, with accumnorm's ExactAccumulation: the optimizer
    of `helpers.sgd_halving` stepping its schedule every step, the loss logged as train_loss. Made on
    first use, as importing lightning takes seconds."""
    import lightning.pytorch as pl

    from accumnorm.integrations.lightning import ExactAccumulation

    class LitClassifier(ExactAccumulation, pl.LightningModule):
        def __init__(self, net: nn.Module, **options) -> None:
            super().__init__(**options)
            self.net = net

        def training_loss(self, batch):
            return ce_loss(self.net, batch)

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            optimizer, scheduler = sgd_halving(self.parameters())
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return LitClassifier


# ---------------------------------------------------------------- tests/trainer/test_trainer.py and its resume program
def small_net() -> nn.Module:
    """Conv-BN-ReLU, max-pool, dropout, Linear-BN1d-ReLU, 3 classes on (1, 8, 8) inputs, the same every call."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Dropout(0.2), nn.Linear(6 * 4 * 4, 16), nn.BatchNorm1d(16), nn.ReLU(),
                         nn.Linear(16, 3))


class NoisyDigits(torch.utils.data.Dataset):
    """Samples for `small_net` with noise from numpy's and python's RNGs, so a resume must restore those too."""

    def __init__(self, n: int = 44):
        g = torch.Generator().manual_seed(3)
        self.x, self.y = torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        noise = np.random.standard_normal((1, 8, 8)).astype(np.float32) * 0.1 + random.random() * 0.1
        return self.x[i] + torch.from_numpy(noise), self.y[i]


# ------------------------------------------------------- tests/engine/test_distributed.py and its ranks' program
def ranks_net() -> nn.Module:
    """Three BatchNorms (2d, 2d, 1d), 4 classes on (3, 8, 8) inputs, the same every call (on every rank)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def ranks_batches(sizes) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global batches of these sizes for `ranks_net`, the same every call (each rank takes its shard)."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g)) for n in sizes]


def ranks_sgd(model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer of `ranks_net`'s runs: SGD with momentum, a constant learning rate."""
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


class AffineHalves(nn.Module):
    """Direct `F.batch_norm` calls, with their own statistics, of a bias without a weight and of a weight
    without a bias."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 10)
        self.bias = nn.Parameter(torch.randn(8))
        self.weight = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        h = torch.tanh(F.batch_norm(self.lin1(x), None, None, None, self.bias, True))
        return self.head(torch.tanh(F.batch_norm(self.lin2(h), None, None, self.weight, None, True)))


def _seeded(cls: type[nn.Module]) -> nn.Module:
    """`cls()` in float64, the same every call (on every rank)."""
    torch.manual_seed(0)
    return cls().double()


def affine_net() -> nn.Module:
    return _seeded(AffineHalves)


class Blocks(nn.Sequential):
    """Four linear-BatchNorm-tanh blocks and a head: regions for recompute and segments, on `affine_batch`."""

    def __init__(self) -> None:
        super().__init__(*[nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Tanh()) for _ in range(4)],
                         nn.Linear(6, 10))


def blocks_net() -> nn.Module:
    return _seeded(Blocks)


class ReadsRunning(nn.Module):
    """A BatchNorm layer, then an eval-mode call on its running statistics (which its training call moved)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn, self.head = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 10)

    def forward(self, x):
        h = self.lin(x)
        bn = self.bn
        y = bn(h) + 0.5 * F.batch_norm(h, bn.running_mean, bn.running_var, bn.weight, bn.bias, False)
        return self.head(torch.tanh(y))


def reads_running_net() -> nn.Module:
    return _seeded(ReadsRunning)


class Residual(nn.Module):
    """Four residual blocks of Linear, BatchNorm, ReLU, Linear: regions for the recompute schedule."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(5, 6), nn.Linear(6, 3)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 6))
                                    for _ in range(4))

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def residual_net() -> nn.Module:
    return _seeded(Residual)


def residual_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of 10 for `residual_net`, the same every call."""
    g = torch.Generator().manual_seed(2)
    return torch.randn(10, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (10,), generator=g)


def affine_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of 8 for `affine_net`, the same every call."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randint(0, 10, (8,), generator=g)


class Compiled(nn.Module):
    """`body` and torch.compile's wrapper of it (a module with no forward of its own, whose child is `body`); the
    forward calls the wrapper: `body` runs in a frame torch.compile evaluates, and the module tree reaches it twice."""

    def __init__(self, body: nn.Module, backend: str = "eager") -> None:
        super().__init__()
        self.body = body
        self.compiled = torch.compile(body, backend=backend)

    def forward(self, x):
        return self.compiled(x)


class KeywordClassifier(nn.Module):
    """`net` as the Hugging Face Trainer calls a model: keyword inputs, a dict with `logits` and, given labels,
    `loss` (mean cross-entropy over the labels that are not -100)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.net(pixel_values)
        return {"logits": logits} if labels is None else {"logits": logits, "loss": F.cross_entropy(logits, labels)}


def keyword_samples(dataset) -> list[dict[str, torch.Tensor]]:
    """The (x, y) samples of a TensorDataset as the dicts a Hugging Face Trainer's collator stacks."""
    return [{"pixel_values": x, "labels": y} for x, y in dataset]


@functools.cache
def mm_classifier() -> type:
    """An mmengine BaseModel class around a classifier `net`: `loss` mode the mean cross-entropy of the batch
    (data samples carry `gt_label`), or with `count_normalized` a loss divided by a count over the batch, as
    detection heads divide by their positives: the cross-entropy summed over the samples whose label is not -1,
    over how many they are. `loss_by_feat` takes the logits of a whole batch. Made on first use."""
    from mmengine.model import BaseModel

    class MMClassifier(BaseModel):
        def __init__(self, net: nn.Module, count_normalized: bool = False) -> None:
            super().__init__()
            self.net, self.count_normalized = net, count_normalized

        def forward(self, inputs, data_samples=None, mode: str = "tensor"):
            logits = self.net(inputs)
            return self.loss_by_feat(logits, data_samples) if mode == "loss" else logits

        def loss_by_feat(self, logits, data_samples) -> dict[str, torch.Tensor]:
            labels = torch.stack([s.gt_label for s in data_samples])
            if not self.count_normalized:
                return {"loss_cls": F.cross_entropy(logits, labels)}
            counted = labels >= 0
            summed = F.cross_entropy(logits, labels.clamp(min=0), reduction="none")[counted].sum()
            return {"loss_cls": summed / counted.sum().clamp(min=1)}

    return MMClassifier


def mm_samples(dataset) -> list[dict]:
    """The (x, y) samples of a TensorDataset as mmengine dataset items: inputs and a data sample with gt_label."""
    from mmengine.structures import BaseDataElement

    return [{"inputs": x, "data_samples": BaseDataElement(gt_label=y)} for x, y in dataset]
