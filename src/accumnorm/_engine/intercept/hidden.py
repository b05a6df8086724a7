"""Batch norms below F.batch_norm: the ops F.batch_norm's own call reaches (`torch.native_batch_norm`, ...), and
torch's aten batch-norm ops, which a forward may call directly.

The step meets the micro-batches at F.batch_norm and `torch.batch_norm`, whose arguments it knows; a call of one
of these ops normalizes with one micro-batch's statistics. In eager code the graph check finds its node after the
forwards (`graphs`), but a torch.compile'd graph holds its nodes inside one compiled node that no walk can look
into: the step's mode, which dynamo traces as it compiles, refuses each call where it sees it, eager or compiled,
before the step changes anything.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["HIDDEN", "refuse_batch_statistics"]

# The ops whose batch statistics come from their input, where `training` (or, without that argument, the op itself)
# says so: torch's `_batch_norm_with_update` always, `_batch_norm_no_update` and the no-training variant never.
# `torch.ops.aten.batch_norm` is `torch.batch_norm`'s op, whose call the step meets; called through torch.ops it runs
# inside a pybind11 call, where the step cannot pause the micro-batch (pybind11 aborts the process): refused too.
_OPS = ("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
        "_batch_norm_impl_index", "cudnn_batch_norm", "miopen_batch_norm", "_batch_norm_with_update",
        "_batch_norm_with_update_functional", "batch_norm")


def _schemas() -> dict[Any, list[Any]]:
    """Each op by every name a forward may call it by (`torch.<op>`, `torch.ops.aten.<op>`, each overload), with the
    schemas its arguments bind to."""
    table: dict[Any, list[Any]] = {}
    for name in _OPS:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        overloads = [getattr(packet, overload) for overload in packet.overloads()]
        table[packet] = [o._schema for o in overloads]
        table.update({o: [o._schema] for o in overloads})
        if hasattr(torch, name) and name != "batch_norm":
            table[getattr(torch, name)] = table[packet]
    return table


HIDDEN = _schemas()


def refuse_batch_statistics(func: Any, args: tuple, kwargs: dict) -> None:
    """Refuse a call of one of the ops (`func`, a key of HIDDEN) that normalizes with its input's statistics."""
    if _uses_batch_statistics(func, args, kwargs):
        raise ValueError(f"bn='exact' met {_name(func)}, a batch norm with batch statistics below F.batch_norm, whose "
                         "micro-batches the step cannot meet: it would normalize each with its own statistics. "
                         "Nothing was changed. Call F.batch_norm or a BatchNorm layer, or pass bn='micro'")


def _name(func: Any) -> str:
    """An op as a forward calls it: torch.native_batch_norm, aten.native_batch_norm.default, ..."""
    return str(func) if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) else (
        f"torch.{func.__name__}")


def _uses_batch_statistics(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a call of one of the ops (`func`, a key of HIDDEN) normalizes with its input's statistics."""
    given = len(args) + len(kwargs)
    for schema in HIDDEN[func]:
        arguments = schema.arguments
        required = sum(not a.has_default_value() and not a.kwarg_only for a in arguments)
        if not required <= given <= len(arguments) or any(k not in {a.name for a in arguments} for k in kwargs):
            continue
        names = [a.name for a in arguments]
        if "training" not in names:
            return "with_update" in schema.name
        i = names.index("training")
        return bool(kwargs["training"] if "training" in kwargs else args[i] if i < len(args) else False)
    return True  # arguments no schema takes: torch's own call will fail; refused as one with batch statistics
