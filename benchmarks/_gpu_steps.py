"""What gpu_check.py's checks share: the table's rows, the models and batches, the float64 oracle, and one step
taken each way (the whole batch in torch, plain accumulation, accumnorm.backward) at a precision."""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import accumnorm

SCALE = 1024.0  # the GradScaler scale of the finite fp16 steps: far from overflow on resnet18
FLOOR = {"float32": 1e-4, "bf16": 2e-2, "fp16": 1e-2}  # the least error each precision is allowed
AUTOCAST = {"float32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Row(NamedTuple):
    check: str
    case: str
    measured: str
    limit: str
    status: str  # PASS, FAIL, INFO or SKIP


def verdict(check: str, case: str, value: float, limit: float, fmt: str = ".1e") -> Row:
    return Row(check, case, f"{value:{fmt}}", f"<= {limit:{fmt}}", "PASS" if value <= limit else "FAIL")


def truth(check: str, case: str, ok: bool, seen: str) -> Row:
    return Row(check, case, seen, "", "PASS" if ok else "FAIL")


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def resnet(name: str, device: torch.device) -> nn.Module:
    import torchvision

    torch.manual_seed(0)
    return getattr(torchvision.models, name)(num_classes=10).to(device)


def study_net(device: torch.device) -> nn.Module:
    """The study's VGG-like net: conv 32-64-128-256, each + BatchNorm + ReLU, max-pool between."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    c0 = 3
    for i, c in enumerate((32, 64, 128, 256)):
        layers += [nn.Conv2d(c0, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU()] + ([nn.MaxPool2d(2)] if i < 3 else [])
        c0 = c
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c0, 10)).to(device)


def batch_of(n: int, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, size, size, generator=g).to(device), torch.randint(0, 10, (n,), generator=g).to(device)


def state_of(model: nn.Module, base: nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient of `model`, and how far each floating-point running statistic moved from `base`'s, in float64."""
    state = {f"grad {n}": p.grad.double() for n, p in model.named_parameters()}
    before = dict(base.named_buffers())
    state.update({f"update {n}": b.double() - before[n].double() for n, b in model.named_buffers()
                  if b.is_floating_point()})
    return state


def worst_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The worst tensor's |got - want| / |want| (L2), over the tensors of `want` not zero up to rounding."""
    largest = max(float(v.norm()) for v in want.values())
    return max(float((got[k] - v).norm() / v.norm()) for k, v in want.items() if v.norm() > 1e-6 * largest)


def oracle(base: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One forward/backward of the whole batch in float64: the gradients and running statistics to match."""
    model = copy.deepcopy(base).double()
    x, y = batch
    loss_fn(model, (x.double(), y)).backward()
    return state_of(model, base)


@contextlib.contextmanager
def tf32_off() -> Iterator[None]:
    """float32 as float32: cuDNN's TF32 convolutions (on by default) round to 10 bits."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


Backward = Callable[[nn.Module, Any, "torch.amp.GradScaler | None"], Any]


def whole_batch(model: nn.Module, batch: Any, scaler: torch.amp.GradScaler | None) -> None:
    loss = loss_fn(model, batch)
    (scaler.scale(loss) if scaler is not None else loss).backward()


def plain_accumulation(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], micro: int) -> None:
    """Plain accumulation in torch alone: loss * b / B, backward, once per micro-batch of `micro` samples."""
    x, y = batch
    for xs, ys in zip(x.split(micro), y.split(micro)):
        (loss_fn(model, (xs, ys)) * len(xs) / len(x)).backward()


def accumulated(**kwargs: Any) -> Backward:
    return lambda model, batch, scaler: accumnorm.backward(model, batch, loss_fn, grad_scaler=scaler, **kwargs)


def one_step(base: nn.Module, batch: Any, precision: str, backward: Backward) -> dict[str, torch.Tensor]:
    """The gradients (unscaled, as GradScaler.unscale_ leaves them) and statistics of one step of a copy of `base`."""
    model = copy.deepcopy(base)
    device = next(model.parameters()).device
    scaler = torch.amp.GradScaler(device.type, init_scale=SCALE) if precision == "fp16" else None
    dtype = AUTOCAST[precision]
    with torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext():
        backward(model, batch, scaler)
    if scaler is not None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        scaler.unscale_(optimizer)  # the true gradient; inf/nan found here makes step() skip and update() back off
        scaler.step(optimizer)
        scaler.update()
        if scaler.get_scale() != SCALE:
            raise AssertionError(f"GradScaler found inf/nan in a step that should be finite (scale now "
                                 f"{scaler.get_scale()})")
    return state_of(model, base)
