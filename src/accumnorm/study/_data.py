"""Datasets of the study, loaded once as tensors.

The study's own loop reads PIL images through a DataLoader, one tiny batch at a time; at
micro-batch 1 that per-call cost is a large part of a step. Here every image is converted
once, the way `transforms.ToTensor()` does (pixels scaled to [0, 1], no normalization), and
the whole dataset sits on the training device, so a micro-batch is one index into a tensor.
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["Dataset", "load_dataset", "DATASETS", "OFFLINE", "DEFAULT_DATA_DIR"]

DATASETS = ("digits", "digits16", "mnist", "fashion-mnist", "cifar10")
OFFLINE = ("digits", "digits16")  # bundled with scikit-learn: no data_dir
DEFAULT_DATA_DIR = Path.home() / ".cache" / "accumnorm" / "data"


class Dataset(NamedTuple):
    """Images (N, C, H, W) float in [0, 1] and labels (N,) int64, for training and validation."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    valid_x: torch.Tensor
    valid_y: torch.Tensor

    @property
    def num_classes(self) -> int:
        return int(self.train_y.max()) + 1

    def to(self, device: torch.device | str) -> Dataset:
        return Dataset(*(t.to(device) for t in self))


def load_dataset(name: str, data_dir: str | Path | None = None) -> Dataset:
    """Load `name` (one of DATASETS) as tensors on the CPU.

    `digits` is scikit-learn's bundled 8x8 handwritten digits (offline; the first 1,437 images
    train, the last 360 validate); `digits16` the same upscaled to 16x16 (bilinear), so that the
    study's net, which halves the size three times, ends on 2x2 feature maps instead of 1x1. The
    others come from torchvision: read from `data_dir` in torchvision's layout, downloaded there
    only when missing.
    """
    if name == "digits":
        return _digits()
    if name == "digits16":
        return Dataset(*(_upscale(t) if t.is_floating_point() else t for t in _digits()))
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; expected one of {', '.join(DATASETS)}")
    return _torchvision(name, Path(data_dir) if data_dir is not None else DEFAULT_DATA_DIR)


def _digits() -> Dataset:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).div(16.0).unsqueeze(1)  # pixels are 0..16
    y = torch.tensor(digits.target, dtype=torch.int64)
    split = 1437  # 80 / 20, a fixed cut so every run of every cell sees the same split
    return Dataset(x[:split], y[:split], x[split:], y[split:])


def _upscale(x: torch.Tensor) -> torch.Tensor:
    """8x8 images to 16x16, bilinear, still in [0, 1]."""
    return F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False).clamp_(0, 1)


def _torchvision(name: str, root: Path) -> Dataset:
    from torchvision import datasets

    cls = {"mnist": datasets.MNIST, "fashion-mnist": datasets.FashionMNIST, "cifar10": datasets.CIFAR10}[name]
    try:
        splits = [cls(str(root), train=train, download=False) for train in (True, False)]
    except RuntimeError:  # torchvision's "Dataset not found": fetch it, which needs the network
        made = [d for d in (*reversed(root.parents), root, root / cls.__name__, root / cls.__name__ / "raw")
                if not d.exists()]  # what the download would create, to take away again if it fails
        try:
            splits = [cls(str(root), train=train, download=True) for train in (True, False)]
        except (OSError, RuntimeError) as err:
            for d in reversed(made):
                if d.is_dir() and not any(d.iterdir()):
                    d.rmdir()
            hint = (f"; {root} looks like the {cls.__name__} folder itself: give the folder above it, {root.parent}"
                    if root.name == cls.__name__ else "")
            raise FileNotFoundError(
                f"dataset {name!r} is not under {root} and downloading it failed ({err}){hint}; put it there in "
                "torchvision's layout or connect to the network"
            ) from err
    return Dataset(*_as_tensors(splits[0]), *_as_tensors(splits[1]))


def _as_tensors(ds) -> tuple[torch.Tensor, torch.Tensor]:
    """A torchvision dataset's raw uint8 images as (N, C, H, W) floats in [0, 1], like ToTensor."""
    x = torch.as_tensor(ds.data)
    x = x.unsqueeze(1) if x.dim() == 3 else x.permute(0, 3, 1, 2)  # MNIST: (N, H, W); CIFAR: (N, H, W, C)
    return x.float().div(255.0), torch.as_tensor(ds.targets, dtype=torch.int64)
