"""Every normalization call of a step that couples the samples of a batch, whoever makes it.

torch's BatchNorm1d/2d/3d, SyncBatchNorm (run as BatchNorm during a step), subclasses such as timm's
`BatchNormAct2d`, accumnorm's layers and plain user code all end in
`F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)`. Under a
`torch.overrides.TorchFunctionMode` that call reaches the mode before it runs, so exact mode needs no
conversion of the model: `NormCalls` hands each batch-statistics call, as a `BNCall`, to the schedule,
which returns its output. InstanceNorm couples nothing in its output, but one that tracks running
statistics updates them once per call: its calls go to the schedule too (`INCall`), to be updated
once per step. Everything else runs untouched. (`forwards` spares the plain layers of torch the
mode's cost, and hands torch's BatchNorm layers' calls to it directly.) Every mode of one step shares a `Watch`:
whose buffers are whose, and the counts of the calls it saw.

A call the schedule could not make exact is refused here: under inference mode or a torch.func
transform, and inside the forward of a custom `autograd.Function` (`checkpoint(use_reentrant=True)`
among them), whose backward is its own.
"""
from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ...functional import Moments
from ..safety import untraced
from ..safety.graphs import Graphs
from ..safety.threadstate import Modes
from .functions import autograd_function_around
from .hidden import HIDDEN, refuse_batch_statistics
from .torchs import refuse_replaced_norm_function

__all__ = ["BNCall", "INCall", "NormCalls", "StopPass", "Watch", "batch_statistics_call", "describe", "describe_layer"]

_BATCH_NORM = {  # the batch-norm functions and their argument order
    F.batch_norm: ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"),
    torch.batch_norm: ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps"),
}
_INSTANCE_NORM = {
    F.instance_norm: ("input", "running_mean", "running_var", "weight", "bias", "use_input_stats", "momentum", "eps"),
    torch.instance_norm: ("input", "weight", "bias", "running_mean", "running_var", "use_input_stats", "momentum",
                          "eps"),
}
_GRAD = torch.autograd.grad
_REGISTER_HOOK = Tensor.register_hook
_DEFAULTS = {"running_mean": None, "running_var": None, "weight": None, "bias": None, "training": False,
             "use_input_stats": True, "momentum": 0.1, "eps": 1e-5}


class StopPass(BaseException):
    """Ends a forward at a BatchNorm call, where a pass has what it runs for. A BaseException, so that a forward's
    `except Exception` lets it by."""


@dataclass(eq=False)
class BNCall:
    """One `F.batch_norm(..., training=True)` call: its arguments, the module owning its buffers, and its modes."""

    input: Tensor
    running_mean: Tensor | None
    running_var: Tensor | None
    weight: Tensor | None
    bias: Tensor | None
    momentum: float | None
    eps: float
    module: nn.Module | None  # the module whose running_mean this is; None for a call without module buffers
    modes: Modes | None  # None in a region's recomputation, which gives a recorded output again (`replays`)
    # A call of a BatchNorm layer's forward, which counted it in num_batches_tracked (not a direct F.batch_norm
    # call on the layer's tensors, which torch counts nowhere).
    counted: bool = False
    stats: Moments | None = None  # the whole batch's statistics, once the micro-batches have met
    saved_tensor_hooks: tuple[tuple[Any, Any], ...] = ()  # the micro-batch's at the call (set by layerwise)


@dataclass(eq=False)
class INCall:
    """One `F.instance_norm` call with input statistics that updates running statistics."""

    input: Tensor
    running_mean: Tensor
    running_var: Tensor | None
    weight: Tensor | None
    bias: Tensor | None
    momentum: float
    eps: float
    module: nn.Module | None

    def output(self) -> Tensor:
        """The call's output, leaving the running statistics alone."""
        return F.instance_norm(self.input, None, None, self.weight, self.bias, True, self.momentum, self.eps)


@dataclass(eq=False)
class Watch:
    """What every mode of one step shares (`NormCalls`).

    `owners` maps `id(running_mean)` to the module holding it; `seen` counts the batch-statistics calls of each
    BatchNorm layer's forward (each bumps its num_batches_tracked: `versions` holds the counter's version at the
    last call seen); `graphs` learns of the instance norms seen. `stop` is the code object of the function that
    calls loss_fn: the search for an enclosing custom autograd.Function ends there.
    """

    owners: dict[int, nn.Module]
    stop: CodeType
    seen: Counter[nn.Module]
    versions: dict[nn.Module, int]
    graphs: Graphs
    tensor_hooks: bool = False  # whether a forward registered a hook on a tensor (`guards.backward_hooked`)


def describe(call: BNCall | INCall, names: dict[nn.Module, str]) -> str:
    """`BatchNorm2d layer1.0.bn1 over 64 channels`, for error messages."""
    return describe_layer(call.module, call.input.shape[1], names)


def describe_layer(module: nn.Module | None, channels: int, names: dict[nn.Module, str]) -> str:
    """`describe` of a call of `module` (None: no module's buffers) over `channels` channels."""
    if module is None:
        return f"a F.batch_norm call over {channels} channels"
    return f"{type(module).__name__} {names.get(module, '(outside the model)')} over {channels} channels"


class NormCalls(TorchFunctionMode):
    """Sends every batch-statistics `F.batch_norm` call to `on_batch_norm(BNCall) -> Tensor`, and every
    `F.instance_norm` call that updates running statistics to `on_instance_norm(INCall) -> Tensor`.

    `watch`: what the step's modes share (`Watch`).
    """

    def __init__(self, on_batch_norm: Callable[[BNCall], Tensor], on_instance_norm: Callable[[INCall], Tensor],
                 watch: Watch, gradients: bool = False, replays: bool = False) -> None:
        super().__init__()
        self.on_batch_norm, self.on_instance_norm = on_batch_norm, on_instance_norm
        # Read at every call: attributes of the mode's own rather than the watch's.
        self.owners, self.stop, self.seen = watch.owners, watch.stop, watch.seen
        self.versions, self.graphs, self.watch = watch.versions, watch.graphs, watch
        # Whether torch.autograd.grad with respect to the parameters is the whole batch's under this mode: one
        # micro-batch, whose forward runs once with its graph.
        self.gradients = gradients
        # Whether this mode runs a region's recomputation, whose calls give their recorded outputs again: they meet
        # nothing, so their modes are not read (each read is some 35 getters, at every call).
        self.replays = replays
        # `convolutions(layer, forward, args, kwargs)`, where set: how torch's convolution layers run under this mode
        # (`forwards`), for the recompute schedule's kept outputs (`checkpointing.kept`).
        self.convolutions: Callable[..., Tensor] | None = None

    @untraced.skip_frames
    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: A002 - torch's signature
        kwargs = kwargs or {}
        if func in _BATCH_NORM:
            a = _bind(_BATCH_NORM[func], args, kwargs)
            if a["training"]:
                return untraced.call(NormCalls.batch_norm)(self, a["input"], a["running_mean"], a["running_var"],
                                                           a["weight"], a["bias"], a["momentum"], a["eps"])
        elif func in _INSTANCE_NORM:
            return untraced.call(NormCalls.instance_norm)(self, func, _bind(_INSTANCE_NORM[func], args, kwargs),
                                                          args, kwargs)
        elif func is _GRAD and not self.gradients:
            return untraced.call(NormCalls.gradient)(self, func, args, kwargs)
        elif func is _REGISTER_HOOK:
            self.watch.tensor_hooks = True
        elif func in HIDDEN:
            refuse_batch_statistics(func, args, kwargs)
        elif func is F.batch_norm or func is F.instance_norm:  # a replacement, set since the tables were made
            refuse_replaced_norm_function("batch_norm" if func is F.batch_norm else "instance_norm")
        return func(*args, **kwargs)

    @untraced.untraced
    def gradient(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A torch.autograd.grad call, with this mode off the thread's stack: its gradients, unless refused."""
        inputs = args[1] if len(args) > 1 else kwargs.get("inputs")
        try:  # run first: one through a met call is refused there, saying so
            grads = func(*args, **kwargs)
        except RuntimeError:  # torch's own error (an output without its graph): ours first, where it applies
            self._refuse_gradient_of_parameters(inputs)
            raise
        self._refuse_gradient_of_parameters(inputs)
        return grads

    def _refuse_gradient_of_parameters(self, inputs: Any) -> None:
        """torch.autograd.grad in a micro-batch's forward (or, under passes and one micro-batch at a time, in
        batch_loss_fn), with respect to a parameter of the model: refused, as a .backward() there that reaches the
        parameters is."""
        wanted = {id(t) for t in ((inputs,) if isinstance(inputs, Tensor) else tuple(inputs or ()))}
        name = next((n for n, p in self.graphs.model.named_parameters() if id(p) in wanted), None)
        if name is not None:
            raise ValueError(
                f"bn='exact': torch.autograd.grad with respect to the model's parameter {name} in your function. "
                "The step runs loss_fn and forward_fn once per micro-batch, and a gradient of one micro-batch's loss "
                "is not the whole batch's, so a term made from it (a gradient penalty) would not be the whole "
                "batch's either; the passes schedule also runs batch_loss_fn on outputs without their graph. Nothing "
                "was changed. Take such a term in batch_loss_fn (forward_fn= and batch_loss_fn=), which sees the "
                "whole batch's outputs and their graph under schedule='layerwise'")

    @untraced.untraced
    def instance_norm(self, func: Callable[..., Tensor], a: dict[str, Any], args: tuple, kwargs: dict) -> Tensor:
        """An instance-norm call (`a`: its arguments by name), with this mode off the thread's stack: its output."""
        rm = a["running_mean"]
        if a["use_input_stats"] and rm is not None:
            refuse_replaced_norm_function("instance_norm")  # set by your functions during the step
            out = self.on_instance_norm(INCall(a["input"], rm, a["running_var"], a["weight"], a["bias"],
                                               a["momentum"], a["eps"], self._owner(rm)))
        else:
            out = func(*args, **kwargs)
        self.graphs.instance_norm(out)  # torch makes it a batch norm of one sample: the step saw it
        return out

    @untraced.untraced
    def batch_norm(self, input: Tensor, running_mean: Tensor | None, running_var: Tensor | None,  # noqa: A002
                   weight: Tensor | None, bias: Tensor | None, momentum: float | None, eps: float) -> Tensor:
        """A batch-statistics call, with this mode off the thread's stack (as in `__torch_function__`): its output."""
        refuse_replaced_norm_function("batch_norm")  # set by your functions during the step
        modes = None if self.replays else Modes.current()
        if modes is None:
            self._refuse_where_inexact(torch.is_grad_enabled(), torch._C._is_fwd_grad_enabled())
        else:
            self._refuse_where_inexact(modes.grad, modes.fwd_grad)
        owner = None if running_mean is None else self.owners.get(id(running_mean))
        if running_mean is not None and owner is None:  # at its first call, before the others count it up too
            raise ValueError(
                f"bn='exact' met a F.batch_norm call over {input.shape[1]} channels whose running statistics are not "
                "buffers of the model (a BatchNorm layer outside it, a teacher in train mode?): accumnorm could "
                "neither update them once per step nor restore them on an error. Nothing was changed (but the "
                "layer's own num_batches_tracked, counted up by its forward before this call). Make the layer part "
                "of the model, or put it in eval mode")
        counted = False
        last = self.versions.get(owner)
        if last is not None:  # a BatchNorm layer's: counted if its forward bumped num_batches_tracked
            version = owner._buffers["num_batches_tracked"]._version  # the buffer, without Module.__getattr__
            counted = version != last
            self.versions[owner] = version
            if counted:
                self.seen[owner] += 1
                if owner.momentum is None:
                    _refuse_own_average(owner, momentum)
        return self.on_batch_norm(BNCall(input, running_mean, running_var, weight, bias, momentum, eps, owner, modes,
                                         counted=counted))

    def _owner(self, running_mean: Tensor | None) -> nn.Module | None:
        return self.owners.get(id(running_mean)) if running_mean is not None else None

    def _refuse_where_inexact(self, grad: bool, fwd_grad: bool) -> None:
        if torch.is_inference_mode_enabled():
            raise ValueError("bn='exact' met a BatchNorm call with batch statistics under torch.inference_mode, "
                             "whose tensors the step cannot meet the other micro-batches with. Nothing was changed. "
                             "Use torch.no_grad() there instead (a teacher, say), or put the layer in eval mode with "
                             "running statistics (one without them, track_running_stats=False, normalizes with the "
                             "batch's even in eval mode)")
        if torch._C._are_functorch_transforms_active():
            raise ValueError("bn='exact' cannot see the whole batch inside a torch.func transform (vmap, grad, ...) "
                             "around a BatchNorm call; use bn='micro' or call the model outside the transform")
        # torch turns grad and forward-mode AD off for a custom Function's forward, which may turn grad back on:
        # with both on, none is running (unless it also turned forward-mode AD back on, through torch's private
        # `_set_fwd_grad_enabled`); else the frames say whose forward this is.
        if grad and fwd_grad:
            return
        name = autograd_function_around(sys._getframe(2), self.stop)
        if name is not None:
            if name == "CheckpointFunction":
                raise ValueError(
                    "bn='exact' cannot make a BatchNorm call inside torch.utils.checkpoint(..., use_reentrant=True) "
                    "exact: its backward recomputes the forward outside accumnorm's step, with this micro-batch's "
                    "statistics alone. Use torch.utils.checkpoint(..., use_reentrant=False), which accumnorm makes "
                    "exact (Hugging Face: gradient_checkpointing_kwargs={'use_reentrant': False})")
            raise ValueError(
                f"bn='exact' cannot make a BatchNorm call inside the forward of the custom autograd.Function "
                f"{name} exact: its backward is its own, and cannot use the whole batch's BatchNorm sums. Nothing was "
                "changed. Call the BatchNorm layer outside the Function, or use bn='micro'")


def _refuse_own_average(layer: nn.Module, factor: float | None) -> None:
    """A layer with momentum=None runs a cumulative average: the step gives it the whole batch's, 1 over the calls
    counted so far, as torch's forward computes it. A forward that computes another factor is refused: the step
    cannot know what it would compute for the whole batch."""
    torchs = 1.0 / float(layer.num_batches_tracked)
    if factor != torchs:
        raise ValueError(
            f"bn='exact': {type(layer).__name__} has momentum=None, but its forward moved the running statistics by "
            f"{factor} where torch's BatchNorm moves them by 1/num_batches_tracked ({torchs}). The step gives a "
            "momentum=None layer the whole batch's cumulative average and cannot know the factor your forward would "
            "compute for the whole batch. Nothing was changed. Give the layer a momentum, or compute the factor as "
            "torch's BatchNorm does")


def batch_statistics_call(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a call of `func` (its arguments as a graph holds them: constants, or nodes whose value is unknown) is
    one the mode hands to the schedule: a batch norm that may use batch statistics, an instance norm that may update
    running statistics."""
    if func in _BATCH_NORM:
        return _may_be_true(_bind(_BATCH_NORM[func], args, kwargs)["training"])
    if func in _INSTANCE_NORM:
        a = _bind(_INSTANCE_NORM[func], args, kwargs)
        return _may_be_true(a["use_input_stats"]) and a["running_mean"] is not None
    return False


def _may_be_true(flag: Any) -> bool:
    return not isinstance(flag, (bool, int, float)) or bool(flag)


def _bind(names: tuple[str, ...], args: tuple, kwargs: dict) -> dict[str, Any]:
    return {**_DEFAULTS, **dict(zip(names, args)), **kwargs}
