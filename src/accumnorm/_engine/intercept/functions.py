"""Which custom `autograd.Function`'s forward a call runs in, found from the Python frames below it.

torch turns grad mode off for a Function's forward, so a BatchNorm call there may be one whose backward is the
Function's own, which the step cannot make exact (`calls.NormCalls` refuses it, naming the Function). Python keeps
no link from a frame to the class whose method it runs, so the frames' code objects are matched: the `ctx` of an
old-style forward, the class a `setup_context`-style forward's qualified name gives, or any Function subclass whose
forward is that code. What a code object turned out to be is remembered.
"""
from __future__ import annotations

from types import CodeType, FrameType

import torch

__all__ = ["autograd_function_around"]

_function_forwards: dict[CodeType, bool] = {}  # code object -> whether it is a custom autograd.Function's forward


def autograd_function_around(frame: FrameType | None, stop: CodeType) -> str | None:
    """The name of the custom autograd.Function whose forward is running below `frame`, if any."""
    while frame is not None and frame.f_code is not stop:
        code = frame.f_code
        if code.co_name == "forward" and _function_forwards.get(code, True):
            cls = _function_class(frame)
            _function_forwards[code] = cls is not None
            if cls is not None:
                return cls.__name__
        frame = frame.f_back
    return None


def _function_class(frame: FrameType) -> type | None:
    """The autograd.Function class of a frame running a method named forward, or None."""
    code = frame.f_code
    if code.co_argcount:  # old style, forward(ctx, ...): ctx is the node of the Function being applied
        ctx = frame.f_locals.get(code.co_varnames[0])
        if isinstance(ctx, torch.autograd.function.FunctionCtx):
            return getattr(type(ctx), "_forward_cls", type(ctx))
    owner = frame.f_globals.get(getattr(code, "co_qualname", "").rpartition(".")[0])  # setup_context style
    if isinstance(owner, type) and issubclass(owner, torch.autograd.Function):
        return owner
    return _function_with_forward(code)  # one defined inside a function, which no module global names


def _function_with_forward(code: CodeType) -> type | None:
    """The custom autograd.Function class (any that exists now) whose forward runs `code`, or None."""
    stack = [torch.autograd.Function]
    while stack:
        cls = stack.pop()
        forward = vars(cls).get("forward")
        if getattr(getattr(forward, "__func__", forward), "__code__", None) is code:
            return cls
        stack.extend(cls.__subclasses__())
    return None
