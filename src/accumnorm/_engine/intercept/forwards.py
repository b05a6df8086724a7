"""The forwards a step gives some of the model's layers for its length.

The step's TorchFunctionMode (`calls.NormCalls`) costs a round trip through Python on every torch call it
sees, which on a model of many small layers weighs as much as the rest of the step's overhead. Most calls
come from torch's own layers, whose code is known, so for the length of a step:

- torch's plain layers (`_PLAIN_LAYERS`: convolutions, linear layers, activations, pooling, dropout), which
  make no normalization call and run none of the user's code, run with the mode lifted (a convolution through
  the mode's `convolutions`, where it has one);
- torch's BatchNorm layers run `_BatchNorm.forward` with the mode lifted and hand their one call to it
  directly, as F.batch_norm would have through it;
- SyncBatchNorm (and its subclasses) runs as plain BatchNorm, the same way: under an initialized process
  group its own collective kernel would neither see the other micro-batches nor run on CPU; the schedule
  reduces over micro-batches and ranks;
- other subclasses of torch's BatchNorm (timm's BatchNormAct2d) run their own forward under the mode, untraced
  when compiled, for the reason `_batch_norm_forward` gives.

Each forward is a method of the layer's own, bound to it (a deep copy of the layer binds it to the copy),
and checks that the step's mode is the innermost one; if not (a mode of the user's above it, or no step),
the class's forward runs as it would have. Layers of any other class run under the mode; a layer that already
has a forward of its own (a library's wrapper) keeps it, and so does a layer whose class forward is not torch's
code (a library patched the class): its forward is run as a subclass's is, under the mode.
"""
from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from ..safety import untraced
from .calls import NormCalls
from .torchs import torchs_code

__all__ = ["BATCH_NORM_BUFFERS", "CONVOLUTIONS", "TORCH_FORWARD_SHA256", "step_forwards"]

_C = torch._C

# torch's layers whose forward is a functional call or two, none of them a batch or instance norm: exact classes
# only (a subclass's forward is anyone's).
_PLAIN_LAYERS = frozenset({
    nn.Identity, nn.Flatten, nn.Unflatten, nn.Linear, nn.Bilinear, nn.Embedding, nn.LayerNorm, nn.GroupNorm,
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Sigmoid,
    nn.Tanh, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Softplus, nn.Softmax, nn.LogSoftmax,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.Upsample, nn.PixelShuffle,
})
_BATCH_NORM_LAYERS = frozenset({nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d})
# The sha256 of the source of torch's `_BatchNorm.forward` that `_batch_norm_in_step` follows line for line (torch
# has no path that runs it without the F.batch_norm call): a test fails when torch's changes, to read the two again.
TORCH_FORWARD_SHA256 = "42c3a1d2b356ef1662d218b545b94188475d74c27a9c4d8cde5d2289e341a5de"
CONVOLUTIONS = frozenset({nn.Conv1d, nn.Conv2d, nn.Conv3d})  # torch's, exact classes: run through `convolutions`


@contextmanager
def step_forwards(modules: list[nn.Module]) -> Iterator[None]:
    """Give the layers among `modules` their step forwards (module doc) until the block ends."""
    changed = []
    for m in modules:
        attributes = vars(m)  # set directly: Module.__setattr__'s checks find nothing to do for a method
        if "forward" in attributes:
            continue
        cls = type(m)
        if cls in _PLAIN_LAYERS and torchs_code(cls.forward):
            attributes["forward"] = types.MethodType(_plain_forward, m)
        elif (cls in _BATCH_NORM_LAYERS and torchs_code(cls.forward)) or isinstance(m, nn.SyncBatchNorm):
            attributes["forward"] = types.MethodType(_batch_norm_forward, m)
        elif isinstance(m, _BatchNorm):
            attributes["forward"] = types.MethodType(_batch_norm_subclass_forward, m)
        else:
            continue
        changed.append(m)
    try:
        yield
    finally:
        for m in changed:
            vars(m).pop("forward", None)


@untraced.skip_frames
def _step_mode() -> NormCalls | None:
    """The step's mode, when it is the innermost one on this thread."""
    depth = _C._len_torch_function_stack()
    mode = _C._get_function_stack_at(depth - 1) if depth else None
    return mode if isinstance(mode, NormCalls) else None


@untraced.skip_frames
def _plain_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = type(self).forward
    if torch.compiler.is_compiling() or _step_mode() is None:  # dynamo traces through the mode (`untraced`)
        return forward(self, *args, **kwargs)
    mode = _C._pop_torch_function_stack()
    try:
        if mode.convolutions is not None and type(self) in CONVOLUTIONS:
            return untraced.call(_convolution)(mode, self, forward, args, kwargs)
        return forward(self, *args, **kwargs)
    finally:
        _C._push_on_torch_function_stack(mode)


@untraced.untraced
def _convolution(mode: NormCalls, layer: nn.Module, forward: Any, args: tuple, kwargs: dict) -> Tensor:
    """A convolution layer's call through the mode's `convolutions`: the step's code, which dynamo never traces."""
    return mode.convolutions(layer, forward, args, kwargs)


@untraced.skip_frames
def _batch_norm_forward(self: _BatchNorm, input: Tensor) -> Tensor:  # noqa: A002 - torch's name
    """A BatchNorm layer's forward in a step: untraced (`_batch_norm_in_step`), so that a compiled forward breaks its
    graph at the layer's call; in eval with running statistics, which needs no meeting, traced as the class's.

    Inside a higher-order op's body (`torch.cond`'s, ...), which dynamo traces without the step's mode, the untraced
    call cannot be traced: it fails there, and `higher_order` refuses the step, naming the op."""
    if torch.compiler.is_compiling() and _no_batch_statistics(self):
        return _BatchNorm.forward(self, input)
    return untraced.call(_batch_norm_in_step)(self, input)


def _no_batch_statistics(layer: _BatchNorm) -> bool:
    """In eval with running statistics: nothing to meet, so dynamo may trace the layer's forward into its graph."""
    return not layer.training and layer.running_mean is not None


@untraced.skip_frames
def _batch_norm_subclass_forward(self: _BatchNorm, *args: Any, **kwargs: Any) -> Any:
    """A BatchNorm subclass's own forward in a step: as it is, its calls reaching the mode; compiled, untraced like
    `_batch_norm_forward` (but in eval with running statistics)."""
    forward = type(self).forward
    if torch.compiler.is_compiling() and not _no_batch_statistics(self):
        return untraced.call(_subclass_in_step)(forward, self, args, kwargs)
    return forward(self, *args, **kwargs)


@untraced.untraced
def _subclass_in_step(forward: Any, layer: nn.Module, args: tuple, kwargs: dict) -> Any:
    """A BatchNorm subclass's forward, which dynamo never traces: its BatchNorm call meets under the step's mode."""
    return forward(layer, *args, **kwargs)


@untraced.untraced
def _batch_norm_in_step(self: _BatchNorm, input: Tensor) -> Tensor:  # noqa: A002 - torch's name
    """`_BatchNorm.forward`, line for line, but for its F.batch_norm call in training, which goes to the mode."""
    mode = _step_mode()
    if mode is None or not self.training:  # eval: running statistics, or batch ones through the mode as usual
        return _BatchNorm.forward(self, input)
    running_mean, running_var, num_batches_tracked, weight, bias = _tensors(self)
    _C._pop_torch_function_stack()
    try:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and num_batches_tracked is not None:
            num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(num_batches_tracked)
        tracked = self.track_running_stats
        return mode.batch_norm(input, running_mean if tracked else None, running_var if tracked else None,
                               weight, bias, factor, self.eps)
    finally:
        _C._push_on_torch_function_stack(mode)


def _tensors(layer: _BatchNorm) -> tuple[Any, ...]:
    """The layer's running_mean, running_var, num_batches_tracked, weight and bias, as `layer.<name>` gives them.

    Read from the module's tables, where torch's BatchNorm registers all five (None when off): each `layer.<name>`
    is a call of Module.__getattr__, which at every BatchNorm call of every micro-batch weighs on a model of small
    layers. A layer that lost one (`del layer.running_mean`) reads them as torch's forward does, buffers only when
    it tracks running statistics."""
    buffers, parameters = layer._buffers, layer._parameters
    try:
        return (buffers["running_mean"], buffers["running_var"], buffers["num_batches_tracked"],
                parameters["weight"], parameters["bias"])
    except KeyError:
        tracked = layer.track_running_stats
        return (*(getattr(layer, name) if tracked else None for name in BATCH_NORM_BUFFERS), layer.weight, layer.bias)


# a BatchNorm layer's buffers: its running statistics and counter, which an exact step updates itself
BATCH_NORM_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")
