"""Whether a function is torch's own code, or a replacement a library set in its place.

The step stands in for torch's code where it knows it: its layers' forwards (`forwards`), and the norm functions
of torch.nn.functional whose calls its mode meets at (`calls`). A library may patch either with a wrapper of its
own (one that casts, clamps or logs around torch's), which keeps torch's name but not its code.
"""
from __future__ import annotations

import os
from typing import Any

import torch.nn as nn
import torch.nn.functional as F

__all__ = ["refuse_replaced_norm_function", "torchs_code"]

# torch.nn's folder as torch's code objects name it (not `__file__`: a frozen or sourceless install names its code
# by where it was compiled), from a method no library replaces
_TORCH_NN = os.path.dirname(os.path.dirname(nn.Module.register_buffer.__code__.co_filename)) + os.sep
_TORCHS: dict[Any, bool] = {}  # each function met: whether it is torch's own code


def torchs_code(function: Any) -> bool:
    """Whether `function` (a layer class's forward, a function of torch.nn.functional) is torch's own code in
    torch.nn, which the step's forwards and mode stand in for: not a patch a library set in its place (a wrapper
    keeps torch's name, not its code)."""
    known = _TORCHS.get(function)
    if known is None:
        code = getattr(function, "__code__", None)
        known = _TORCHS[function] = code is not None and code.co_filename.startswith(_TORCH_NN)
    return known


def refuse_replaced_norm_function(name: str) -> None:
    """Refuse a step while `torch.nn.functional.<name>` ("batch_norm", "instance_norm") is a replacement. torch's
    TorchFunctionMode protocol hands the step's mode the replacement itself, not a norm call it can meet at, and
    which part of it is torch's call, to be made of the whole batch, no step can tell. Checked before a step and at
    each of its norm calls (a replacement your functions set during the step)."""
    function = getattr(F, name)
    if torchs_code(function):
        return
    code = getattr(function, "__code__", None)
    where = f" (from {code.co_filename}, line {code.co_firstlineno})" if code is not None else ""
    raise ValueError(
        f"bn='exact': torch.nn.functional.{name} is not torch's own function but a replacement{where}, which the "
        "step cannot see through: it meets the micro-batches at torch's own norm calls, and cannot tell which part "
        "of a replacement to make of the whole batch. Nothing was changed. Put torch's function back while "
        "accumnorm.backward runs, or pass bn='micro'")
