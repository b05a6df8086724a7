"""The study's network, its normalizations, and several runs of it packed into one wide model.

The runs of one grid cell differ only in their seed. At micro-batch 1 a step is dominated by
fixed per-call cost, so instead of R small models we train one model R times as wide, in
which run r owns channel block r of every layer:

- each conv becomes a grouped conv (groups=R): block r of the output sees only block r of the
  input, through run r's own weights;
- BatchNorm, InstanceNorm and the per-channel alternatives (Batch Renormalization, stale
  statistics, FRN) normalize each channel on its own, so they work unchanged on R*C channels;
  GroupNorm(G, C) becomes GroupNorm(R*G, R*C) and EvoNorm-S0 likewise, whose groups never
  straddle two runs; ReLU and max-pool act per channel;
- the linear head becomes a grouped 1x1 conv.

The loss is the sum over runs of each run's mean loss, so every run's parameters get exactly
the gradient they would get alone, and Adam, being elementwise, steps each block as R
separate Adams would. A norm that mixes channels (a channels-first LayerNorm) cannot be
packed this way; `stackable` says so and the runner then trains such runs one at a time.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

import accumnorm
from accumnorm.layers import BatchRenorm2d, EvoNorm2dS0, FilterResponseNorm2d, StaleBatchNorm2d

__all__ = ["SimpleModel", "StackedModel", "StackedConv2d", "SingleRun", "norm_fn", "stackable", "STUDY_NORMS",
           "EXACT_BN", "NormFn"]

NormFn = Callable[[int], nn.Module]

# The study's own normalizations, as its loop builds them (torch modules, torch defaults).
STUDY_NORMS: dict[str, NormFn | None] = {
    "bn": nn.BatchNorm2d,
    "gn4": lambda c: nn.GroupNorm(4, c),
    "gn16": lambda c: nn.GroupNorm(16, c),
    "in": nn.InstanceNorm2d,
    "none": None,
}
EXACT_BN = "bn-exact"  # accumnorm's BatchNorm, trained with accumnorm.backward(bn="exact")

# Layers whose computation splits per channel, or per group of channels, with no other mixing.
_PER_CHANNEL = (nn.ReLU, nn.MaxPool2d, nn.Identity)
_PER_CHANNEL_NORMS = (_BatchNorm, _InstanceNorm, nn.GroupNorm, BatchRenorm2d, StaleBatchNorm2d, FilterResponseNorm2d,
                      EvoNorm2dS0)


def norm_fn(name: str) -> NormFn | None:
    """The normalization `name` builds, as a function of the channel count.

    The study's names (bn, gn4, gn16, in, none) keep the study's torch modules so that its
    numbers are reproduced; `bn-exact` is accumnorm's BatchNorm; any other name goes to
    `accumnorm.norm_layer`, which validates the name without building a layer.
    """
    if name in STUDY_NORMS:
        return STUDY_NORMS[name]
    if name == EXACT_BN:
        return accumnorm.BatchNorm2d
    try:
        return accumnorm.norm_layer(name)
    except (ValueError, TypeError) as err:
        raise ValueError(f"unknown norm {name!r}: expected one of the study's {', '.join([*STUDY_NORMS, EXACT_BN])} "
                         f"or an accumnorm.norm name ({err})") from err


class SimpleModel(nn.Module):
    """The study's VGG-like network, layer for layer as its loop builds it (same init order)."""

    def __init__(self, norm: NormFn | None = None, channels: Sequence[int] = (32, 64, 128, 256),
                 in_channels: int = 1, num_classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = []
        prev = in_channels
        for i, c in enumerate(channels):
            layers.append(nn.Conv2d(prev, c, 3, padding=1))
            if norm is not None:
                layers.append(norm(c))
            layers.append(nn.ReLU())
            if i < len(channels) - 1:
                layers.append(nn.MaxPool2d(2))
            prev = c
        self.features = nn.Sequential(*layers)
        self.dense = nn.Linear(prev, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(self.features(x).mean((2, 3)))  # global average pool


def stackable(model: SimpleModel) -> bool:
    """Whether R copies of `model` can be packed into one StackedModel without mixing runs."""
    return all(isinstance(m, _PER_CHANNEL + (nn.Conv2d,) + _PER_CHANNEL_NORMS) for m in model.features)


class _DeferWeightGrad(torch.autograd.Function):
    """A conv whose backward returns the input gradient now and leaves (input, output gradient) for later."""

    @staticmethod
    def forward(ctx, x, weight, bias, conv):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.conv = conv
        return F.conv2d(x, weight, bias, conv.stride, conv.padding, conv.dilation, conv.groups)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        conv = ctx.conv
        conv.pending.append((x, dy))
        dx = None
        if ctx.needs_input_grad[0]:
            dx = torch.ops.aten.convolution_backward(dy, x, weight, None, conv.stride, conv.padding, conv.dilation,
                                                     False, [0, 0], conv.groups, [True, False, False])[0]
        return dx, None, None, None


class StackedConv2d(nn.Conv2d):
    """The grouped conv of a StackedModel, optionally computing its weight gradient once per step.

    At micro-batch 1 on CPU most of a step goes into writing and adding up a full weight gradient
    per micro-batch (for the study's 128->256 conv on 3x3 maps that is 16 writes of 1.2 MB per run
    for 9 positions each). With `defer=True` the backward keeps each micro-batch's input and output
    gradient instead, and `flush()` computes the weight gradient of all of them in one call: the
    same sum, the same per-micro-batch forward and backward, a fraction of the memory traffic. It
    needs every micro-batch's backward to run exactly once (plain accumulation, bn="micro").
    """

    def __init__(self, *args, defer: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.defer = defer
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.defer and torch.is_grad_enabled():
            return _DeferWeightGrad.apply(x, self.weight, self.bias, self)
        return super().forward(x)

    @torch.no_grad()
    def flush(self) -> None:
        """Add the weight (and bias) gradient of every pending micro-batch to .grad."""
        if not self.pending:
            return
        xs, dys = zip(*self.pending)
        self.pending = []
        bias = self.bias is not None
        _, gw, gb = torch.ops.aten.convolution_backward(
            torch.cat(dys), torch.cat(xs), self.weight, [self.out_channels] if bias else None, self.stride,
            self.padding, self.dilation, False, [0, 0], self.groups, [False, True, bias])
        for param, grad in ((self.weight, gw), (self.bias, gb)):
            if param is not None:
                param.grad = grad if param.grad is None else param.grad.add_(grad)


class StackedModel(nn.Module):
    """R SimpleModels (same architecture, own weights) trained as one: run r owns block r.

    Input (N, R, C, H, W): sample n of every run, one image per run. Output (N, R, classes).
    """

    def __init__(self, models: Sequence[SimpleModel], defer_weight_grads: bool = False):
        super().__init__()
        if not all(stackable(m) for m in models):
            raise ValueError("these models mix channels (e.g. a channels-first LayerNorm) and cannot be stacked")
        self.runs = len(models)
        depth = len(models[0].features)
        self.features = nn.Sequential(*(_stack([m.features[i] for m in models]) for i in range(depth)))
        self.dense = _stack([m.dense for m in models])
        for conv in self.modules():
            if isinstance(conv, StackedConv2d):
                conv.defer = defer_weight_grads

    def flush_weight_grads(self) -> None:
        """Compute the deferred conv weight gradients of this step (see StackedConv2d); call before stepping."""
        for conv in self.modules():
            if isinstance(conv, StackedConv2d):
                conv.flush()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x.flatten(1, 2))  # (N, R*C, H, W): run r's image in channel block r
        return self.dense(h.mean((2, 3), keepdim=True)).view(x.shape[0], self.runs, -1)


class SingleRun(nn.Module):
    """One SimpleModel behind StackedModel's interface (R = 1), for runs that cannot be stacked."""

    def __init__(self, model: SimpleModel):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.squeeze(1)).unsqueeze(1)


def _stack(layers: list[nn.Module]) -> nn.Module:
    """One wide layer doing the work of `layers` (one per run) side by side on channel blocks."""
    first, runs = layers[0], len(layers)
    if isinstance(first, _PER_CHANNEL):
        return first  # stateless and per channel: one instance serves every block
    if isinstance(first, nn.Conv2d):
        wide = StackedConv2d(runs * first.in_channels, runs * first.out_channels, first.kernel_size,
                             first.stride, first.padding, groups=runs, bias=first.bias is not None)
    elif isinstance(first, nn.Linear):  # a grouped 1x1 conv applies each run's own matrix
        wide = StackedConv2d(runs * first.in_features, runs * first.out_features, 1, groups=runs,
                             bias=first.bias is not None)
    else:  # a per-channel norm: same module (class, eps, momentum...), R times the channels
        wide = copy.deepcopy(first)
        for attr in ("num_features", "num_groups", "num_channels"):
            if hasattr(wide, attr):
                setattr(wide, attr, runs * getattr(wide, attr))
    # Replace every per-channel tensor by the runs' tensors laid end to end along dim 0; 0-dim
    # buffers (BatchNorm's num_batches_tracked) count steps, which all runs share.
    for name, tensor in [*wide.named_parameters(recurse=False), *wide.named_buffers(recurse=False)]:
        if tensor.dim() == 0:
            continue
        blocks = torch.cat([getattr(layer, name).detach().reshape(-1, *tensor.shape[1:]) for layer in layers])
        setattr(wide, name, nn.Parameter(blocks) if isinstance(tensor, nn.Parameter) else blocks)
    return wide
