"""Whether the K micro-batches' pieces of a BatchNorm call are pieces of one call of the whole batch.

Call j of micro-batch k must be the k-th piece of call j of the whole batch: the same layer, parameters,
buffers, eps, momentum and modes, and an input that differs only in its batch dimension. `identical` is the
quick test made at every call; `difference` says, for the error message, what differs.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..intercept.calls import BNCall, describe

__all__ = ["identical", "difference"]


def identical(first: BNCall, call: BNCall) -> bool:
    """Whether two pieces are of one call by the quick test: the same arguments, tensors, layer and modes.
    `difference` decides (and says what differs) when this one does not pass."""
    x, x0 = call.input, first.input
    return (x.shape[1:] == x0.shape[1:] and x.dtype == x0.dtype and x.device == x0.device
            and call.module is first.module and call.eps == first.eps and call.momentum == first.momentum
            and call.modes == first.modes and call.running_mean is first.running_mean
            and call.running_var is first.running_var and call.weight is first.weight and call.bias is first.bias
            and call.counted == first.counted)


def difference(first: BNCall | None, call: BNCall | None, names: dict[nn.Module, str]) -> str | None:
    """What differs between two micro-batches' pieces of a BatchNorm call, or None if they are pieces of one call."""
    if call is None:
        return None if first is None else "had ended its forward"
    if first is None:
        return f"made one ({describe(call, names)})"
    x, x0 = call.input, first.input
    checks = [
        ("its input's shape past the batch dimension", tuple(x.shape[1:]), tuple(x0.shape[1:])),
        ("its input's dtype", x.dtype, x0.dtype),
        ("its input's device", x.device, x0.device),
        ("the layer", names.get(call.module, "none"), names.get(first.module, "none")),
        ("eps", call.eps, first.eps),
        ("autocast", call.modes.autocast, first.modes.autocast),
        ("whether the layer's forward made it", call.counted, first.counted),
        ("grad mode", (call.modes.grad, call.modes.fwd_grad), (first.modes.grad, first.modes.fwd_grad)),
    ]
    if not (isinstance(call.module, _BatchNorm) and call.module.momentum is None):  # else momentum counts the calls
        checks.append(("momentum", call.momentum, first.momentum))
    for what, got, expected in checks:
        if got != expected:
            return f"differs in {what} ({got} against {expected})"
    for name in ("running_mean", "running_var", "weight", "bias"):
        got, expected = getattr(call, name), getattr(first, name)
        if got is expected:
            continue
        # A weight computed in each forward (a parametrization, a cast) is the same weight if its values are.
        if name in ("weight", "bias") and got is not None and expected is not None and got.shape == expected.shape \
                and bool(torch.equal(got, expected)):
            continue
        return f"passed another {name} tensor to the call"
    return None
