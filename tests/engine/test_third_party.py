"""Third-party models as their libraries build them, exact against whole-batch torch in float64.

ultralytics' YOLOv8n detection model, MONAI's 3D UNet with BatchNorm, segmentation_models_pytorch's Unet on a
resnet18 encoder, and a user's wrapper (Python control flow) around torchvision's resnet18: each built from its
config with no pretrained weights and no network access (a fixture makes any connection attempt fail the test),
in float64. Each takes two steps of 7 samples in micro-batches of 3 (3, 3, 1: the last uneven, alone in its
BatchNorm), gradients zeroed between them, running statistics carried on, and between the steps something the
forward uses changes (a submodule put in eval mode, an attribute): the loss, every gradient and every buffer
(running statistics, num_batches_tracked) of each step must match whole-batch torch on a twin given the same
change, to 1e-9 (`helpers.compare`). A library that is not installed skips its test.
"""
from __future__ import annotations

import copy
import socket
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

import accumnorm
from helpers import ce_loss, compare, rel_err, whole_batch
from models import data

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # one thread: see conftest.py

N, MICRO = 7, 3  # micro-batches of 3, 3 and 1


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No test here may touch the network: building a model must not download anything. Each attempt fails, and
    fails the test at its end even if the library caught the error."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError(f"network access during the test: {args}")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    yield
    assert not attempts, f"network access attempted: {attempts}"


def bn_count(model: nn.Module, training: bool | None = None) -> int:
    return sum(isinstance(m, _BatchNorm) and training in (None, m.training) for m in model.modules())


def two_steps_match_whole_batch(model: nn.Module, batches, loss_fn: Callable, schedule: str,
                                change: Callable[[nn.Module], None]) -> None:
    """Step 1 on `batches[0]`; `change` on both models and zeroed gradients; step 2 on `batches[1]`. After each
    step the loss, every gradient and every buffer of accumnorm's model match whole-batch torch on the twin."""
    ref, ours = model, copy.deepcopy(model)
    for step, batch in enumerate(batches):
        if step:
            for m in (ref, ours):
                m.zero_grad()
                change(m)
        expected = whole_batch(ref, batch, loss_fn)
        loss = accumnorm.backward(ours, batch, loss_fn, micro_batch_size=MICRO, schedule=schedule)
        assert rel_err(loss, expected) < 1e-10, f"step {step}: loss {loss.item()!r}, whole batch {expected.item()!r}"
        compare(ref, ours, 1e-9)


# --- ultralytics YOLOv8n -------------------------------------------------------------------------------------


def yolo_loss(model: nn.Module, batch) -> torch.Tensor:
    """MSE of the raw box and class outputs against fixed random targets, plus the mean square of each feature map
    the head reads."""
    x, boxes, scores = batch
    out = model(x)
    return (F.mse_loss(out["boxes"], boxes) + F.mse_loss(out["scores"], scores)
            + sum(f.square().mean() for f in out["feats"]))


# Layerwise only: YOLOv8n makes 57 BatchNorm calls, so the passes schedule runs 115 passes per micro-batch, about a
# minute per step on this 2-core machine (exact too when tried: worst relative error 1.4e-13).
@pytest.mark.parametrize("schedule", ["layerwise"])
def test_ultralytics_yolov8n_detection_model(monkeypatch, tmp_path, schedule):
    monkeypatch.setenv("YOLO_OFFLINE", "1")  # no online check when ultralytics is first imported
    monkeypatch.setenv("YOLO_CONFIG_DIR", str(tmp_path))  # its settings file, if it writes one
    tasks = pytest.importorskip("ultralytics.nn.tasks")
    model = tasks.DetectionModel("yolov8n.yaml", nc=3, verbose=False).double().train()
    assert bn_count(model) == 57
    with torch.no_grad():
        out = copy.deepcopy(model)(torch.zeros(1, 3, 64, 64, dtype=torch.float64))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(N, 3, 64, 64, generator=g, dtype=torch.float64),
                torch.randn(N, *out["boxes"].shape[1:], generator=g, dtype=torch.float64),
                torch.randn(N, *out["scores"].shape[1:], generator=g, dtype=torch.float64)) for _ in range(2)]

    def change(m):  # a C2f block of the backbone normalizes with the running statistics step 1 left
        m.model[4].eval()
        assert 0 < bn_count(m, training=False) < bn_count(m)

    two_steps_match_whole_batch(model, batches, yolo_loss, schedule, change)


# --- MONAI 3D UNet -------------------------------------------------------------------------------------------


def test_monai_3d_unet_with_batchnorm(schedule):
    nets = pytest.importorskip("monai.networks.nets")
    torch.manual_seed(0)
    model = nets.UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(4, 8, 16), strides=(2, 2),
                      num_res_units=1, norm="batch").double()
    assert bn_count(model) == 6
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(N, 1, 12, 12, 12, generator=g, dtype=torch.float64),
                torch.randint(0, 2, (N, 12, 12, 12), generator=g)) for _ in range(2)]

    def change(m):  # the bottom residual unit normalizes with the running statistics step 1 left
        m.model[1].submodule[1].eval()
        assert bn_count(m, training=False) == 1

    two_steps_match_whole_batch(model, batches, ce_loss, schedule, change)


# --- segmentation_models_pytorch Unet --------------------------------------------------------------------------


# Both schedules, though the passes schedule takes about 10 s a step here (30 BatchNorm calls: 61 passes).
def test_smp_unet_resnet18(schedule):
    smp = pytest.importorskip("segmentation_models_pytorch")
    torch.manual_seed(0)
    model = smp.Unet(encoder_name="resnet18", encoder_weights=None, classes=3).double()
    assert bn_count(model) == 30
    g = torch.Generator().manual_seed(0)
    batches = [(data((3, 32, 32), N, torch.float64)[0], torch.randint(0, 3, (N, 32, 32), generator=g))
               for _ in range(2)]

    def change(m):  # an attribute the decoder's forward passes to F.interpolate
        for block in m.decoder.blocks:
            assert block.interpolation_mode == "nearest"
            block.interpolation_mode = "bilinear"

    two_steps_match_whole_batch(model, batches, ce_loss, schedule, change)


# --- a user's wrapper around a library model -------------------------------------------------------------------


class Embedder(nn.Module):
    """A user's module: torchvision's resnet18 as a trunk, a projection head with BatchNorm1d, and Python control
    flow on plain attributes: with `views == 2` the batch goes through twice (the second time mirrored), so every
    BatchNorm is called twice; `temperature` scales the normalized embedding. On 16x16 images, the last
    micro-batch's one sample brings one value per channel to the head's BatchNorm and to layer4's (1x1 maps)."""

    def __init__(self) -> None:
        super().__init__()
        import torchvision

        self.trunk = torchvision.models.resnet18(num_classes=32)
        self.head = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 16))
        self.views, self.temperature = 1, 1.0

    def forward(self, x):
        views = [x, x.flip(3)] if self.views == 2 else [x]
        z = torch.stack([self.head(self.trunk(v)) for v in views]).mean(0)
        return F.normalize(z, dim=1) / self.temperature


def test_user_wrapper_around_torchvision_resnet18(schedule):
    pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = Embedder().double()
    assert bn_count(model) == 21
    batches = [data((3, 16, 16), N, torch.float64) for _ in range(2)]

    def change(m):  # Python control flow: two views (every BatchNorm called twice), another temperature
        m.views, m.temperature = 2, 0.5
        m.trunk.layer1.eval()  # and a library submodule normalizing with the running statistics step 1 left

    two_steps_match_whole_batch(model, batches, ce_loss, schedule, change)
