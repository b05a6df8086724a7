"""The networks bench_backward.py measures: name -> Case(build, batch, loss), all built from their configs.

No weights are downloaded and nothing reaches the network. torchvision, ultralytics, MONAI and
segmentation_models_pytorch are benchmark extras, imported inside the builders: a missing one raises
ImportError at build time, and the benchmark skips that model with a note.

Every batch is BATCH samples made from real MNIST digits (../shared/data/mnist-mini; noise of the same
shape if it is missing: the timing does not depend on pixel values), and every loss is the mean over
the samples it is given, as accumnorm.backward and the plain loop's loss * b / B expect.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "mnist-mini")
BATCH = 32

Batch = Any  # a tensor, or a tuple of tensors


@dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]  # the model, in train mode, from its config
    batch: Callable[[int, int], Batch]  # (image size, volume size) -> BATCH samples on the CPU
    loss: Callable[[nn.Module, Batch], torch.Tensor]  # mean loss over the samples of one (micro-)batch
    # A loss that couples the batch's samples: accumnorm.backward's whole-batch form runs `forward` per micro-batch
    # and `batch_loss` once over all outputs; `loss` is then each micro-batch's own, plain accumulation's
    forward: Callable[[nn.Module, Batch], Any] | None = None
    batch_loss: Callable[[Any, Any], torch.Tensor] | None = None

    @property
    def micro_forward(self) -> Callable[[nn.Module, Batch], Any]:
        """What accumnorm.backward runs per micro-batch: the loss, or with a whole-batch loss the outputs."""
        return self.loss if self.batch_loss is None else self.forward


# --- data --------------------------------------------------------------------------------------------------------


def _mnist(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BATCH digits in [0, 1] at size x size, one channel, and their labels."""
    try:
        from torchvision.datasets import MNIST

        ds = MNIST(DATA, train=True, download=False)
        x, y = ds.data[:BATCH].unsqueeze(1).float() / 255, ds.targets[:BATCH]
    except Exception:
        x, y = torch.rand(BATCH, 1, 28, 28), torch.randint(0, 10, (BATCH,))
    return F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False), y


def _normalize(x: torch.Tensor) -> torch.Tensor:
    return (x - 0.1307) / 0.3081


def digits(size: int, volume: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Classification: 3-channel digits and their labels."""
    x, y = _mnist(size)
    return _normalize(x).repeat(1, 3, 1, 1), y


def small_digits(size: int, volume: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`digits` at 8x8, whatever the image size asked for (tiny_deep's input)."""
    return digits(8, volume)


def images(size: int, volume: int) -> torch.Tensor:
    """3-channel digits alone (a batch that is one tensor)."""
    return digits(size, volume)[0]


def digit_masks(size: int, volume: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Segmentation: 3-channel digits and each pixel's class (0 background, 1 ink)."""
    x, _ = _mnist(size)
    return _normalize(x).repeat(1, 3, 1, 1), (x[:, 0] > 0.3).long()


def digit_volumes(size: int, volume: int) -> tuple[torch.Tensor, torch.Tensor]:
    """3D segmentation: each digit at volume^2, extruded over volume slices with a bump-shaped depth profile
    (a coin with the digit in relief), one channel, and each voxel's class (0 background, 1 ink)."""
    x, _ = _mnist(volume)
    depth = torch.sin(torch.linspace(0, torch.pi, volume)).view(1, 1, volume, 1, 1)
    v = x.unsqueeze(2) * depth  # (B, 1, D, H, W)
    return _normalize(v), (v[:, 0] > 0.3).long()


def two_views(size: int, volume: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SimCLR: two random augmentations of each 28x28 digit, as `accumnorm study --task simclr` draws them."""
    from accumnorm.study import two_views as views

    x, _ = _mnist(28)
    return views(x, torch.Generator().manual_seed(0))


# --- losses ------------------------------------------------------------------------------------------------------


def cross_entropy(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Per sample, per pixel or per voxel: (B, C, ...) logits against (B, ...) classes, mean over all."""
    x, y = batch
    return F.cross_entropy(model(x), y)


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    return [t for o in out for t in _tensors(o)] if isinstance(out, (list, tuple)) else []


def mean_squares(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The sum over the model's output tensors (a detector's maps, however it nests them) of each one's mean square."""
    return sum(t.float().square().mean() for t in _tensors(model(x)))


def nt_xent(outputs: tuple[torch.Tensor, torch.Tensor], targets: None = None) -> torch.Tensor:
    """SimCLR's NT-Xent at the study's temperature, over every view the projections hold."""
    from accumnorm.study import nt_xent as loss

    return loss(*outputs, 0.5)


def project(model: nn.Module, views: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    from accumnorm.study import project as both

    return both(model, views)


def micro_nt_xent(model: nn.Module, views: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """NT-Xent over one micro-batch's own views: what plain accumulation takes."""
    return nt_xent(project(model, views))


# --- models ------------------------------------------------------------------------------------------------------


def study_net() -> nn.Module:
    """The study's VGG-like net: conv 32-64-128-256, each + BatchNorm + ReLU, max-pool between."""
    layers: list[nn.Module] = []
    c0 = 3
    for i, c in enumerate((32, 64, 128, 256)):
        layers += [nn.Conv2d(c0, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU()] + ([nn.MaxPool2d(2)] if i < 3 else [])
        c0 = c
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c0, 10))


def simclr_net() -> nn.Module:
    """The contrastive study's encoder (3 ResNet-like stages, BatchNorm) and BatchNorm projection head."""
    from accumnorm.study import SimCLRNet

    return SimCLRNet("bn")


def torchvision_model(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision

        return getattr(torchvision.models, name)(num_classes=10, **kwargs)
    return build


def yolov8n() -> nn.Module:
    """ultralytics' YOLOv8n detector from its yaml, 10 classes; in train mode its forward returns the raw maps."""
    os.environ.setdefault("YOLO_OFFLINE", "1")  # else ultralytics looks up DNS names when imported
    from ultralytics.nn.tasks import DetectionModel
    from ultralytics.utils import LOGGER

    level = LOGGER.level
    LOGGER.setLevel("WARNING")  # "Overriding model.yaml nc=80 with nc=10" would land in the table
    try:
        return DetectionModel("yolov8n.yaml", nc=10, verbose=False).train()
    finally:
        LOGGER.setLevel(level)


def monai_unet3d() -> nn.Module:
    """MONAI's 3D UNet with BatchNorm3d: 16-32-64-128 channels, two residual units per level, 2 classes."""
    from monai.networks.nets import UNet

    return UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(16, 32, 64, 128), strides=(2, 2, 2),
                num_res_units=2, norm="batch")


def smp_unet() -> nn.Module:
    """segmentation_models_pytorch's Unet on a resnet18 encoder, random weights, 2 classes."""
    import segmentation_models_pytorch as smp

    return smp.Unet(encoder_name="resnet18", encoder_weights=None, in_channels=3, classes=2)


def conv_bn(c_in: int, c_out: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())


def tiny_deep() -> nn.Module:
    """48 blocks of conv3x3 (8 -> 8 channels) + BatchNorm + ReLU on 8x8 digits, then a linear head.

    The host-bound regime: its tensors are so small that the kernels cost next to nothing and a step is the
    Python and dispatcher work around them, as on a GPU with a small micro-batch. It measures what each
    BatchNorm call and each op cost a schedule on the host. Its input is 8x8 whatever --size says.
    """
    blocks = [conv_bn(3, 8)] + [conv_bn(8, 8) for _ in range(47)]
    return nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


class DynamicNet(nn.Module):
    """Conv-BN blocks under Python control flow that torch.fx cannot trace. Each stage applies its block once per
    live gate, ReZero-style (x + gate * block(x)), where pruned gates are zeros at the end of the stage's row: the
    loop's count is the .item() of a tensor computed from a parameter (a Proxy under fx). Residual or a plain
    stack is a branch on a module attribute. Both are the same for every micro-batch, as exactness needs."""

    def __init__(self, widths: tuple[int, ...] = (32, 64, 128), classes: int = 10) -> None:
        super().__init__()
        self.downs = nn.ModuleList(conv_bn(c_in, c, 2) for c_in, c in zip((3,) + widths, widths))
        self.blocks = nn.ModuleList(nn.Sequential(conv_bn(c, c), conv_bn(c, c)) for c in widths)
        self.gates = nn.Parameter(torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]][: len(widths)]))
        self.residual = True
        self.head = nn.Linear(widths[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage, (down, block) in enumerate(zip(self.downs, self.blocks)):
            x = down(x)
            gates = self.gates[stage]
            for i in range(int(gates.count_nonzero().item())):
                x = x + gates[i] * block(x) if self.residual else block(x)
        return self.head(x.mean((2, 3)))


MODELS: dict[str, Case] = {
    "study": Case(study_net, digits, cross_entropy),
    **{n: Case(torchvision_model(n), digits, cross_entropy)
       for n in ("resnet18", "resnet50", "mobilenet_v3_small", "efficientnet_b0")},
    "yolov8n": Case(yolov8n, images, mean_squares),
    "monai_unet3d": Case(monai_unet3d, digit_volumes, cross_entropy),
    "smp_unet": Case(smp_unet, digit_masks, cross_entropy),
    "dynamic": Case(DynamicNet, digits, cross_entropy),
    # host-bound: 48 tiny conv-BN-ReLU blocks, where a step is all host work
    "tiny_deep": Case(tiny_deep, small_digits, cross_entropy),
    # its dense layers' bottleneck (BatchNorm, ReLU, conv) inside checkpoint(use_reentrant=False); the plain loop's
    # recomputation updates those BatchNorms' running statistics a second time, accumnorm's does not
    "densenet121_ckpt": Case(torchvision_model("densenet121", memory_efficient=True), digits, cross_entropy),
    # NT-Xent over both views of the whole batch: exact takes it once over all projections, plain per micro-batch
    "simclr": Case(simclr_net, two_views, micro_nt_xent, forward=project, batch_loss=nt_xent),
}
