"""The engine's functions that torch.compile runs as they are: a graph break wherever compiled code calls one.

During a step dynamo traces the step's TorchFunctionMode (`calls.NormCalls`) into the graphs it compiles, as
it traces any mode, so every torch call of a compiled forward is in its graph but for the ones the mode hands
to the schedule: a batch-statistics call meets the other micro-batches there, which no graph can hold. Those
handlers, and a checkpointed region's call (whose recomputation the step drives), run untraced
(`torch.compiler.disable`): the graph breaks at each, and the rest of the forward stays compiled. The step's own
forwards for torch's layers (`forwards`), which a graph break inside a compiled loop leaves dynamo to compile
as frames of their own, are skipped as frames and traced only inline, where they take the class's forward.

Dynamo guards each graph on the mode stack, so the graphs compiled outside a step (with their BatchNorm fused,
normalizing one micro-batch) are never run inside one, and evaluation after a step gets its own fully
compiled graph again.

The step's callbacks that torch calls from whatever code runs (saved-tensor hooks, the SIGINT handler, weakref
callbacks) would be compiled as frames of their own when that code is compiled: they run untraced too (`wrap`;
`forgetting`, for the weakref callbacks made at every region call, without a wrapper made for each).

`untraced` registers a function; `prepare()`, at each step's start, makes the disabled versions once dynamo
is imported (importing it costs a second: a process that never compiles never pays it); `call(fn)` is what
code that may be compiled calls instead of `fn`.
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import CodeType
from typing import Any, TypeVar

import torch

__all__ = ["REASON", "call", "forgetting", "prepared", "skip_frames", "untraced", "wrap"]

F = TypeVar("F", bound=Callable[..., Any])

_eval_frame_callback = torch._C._dynamo.eval_frame.get_eval_frame_callback
_REGISTERED: list[Callable[..., Any]] = []
_SKIPPED: set[CodeType] = set()
_DISABLED: dict[Callable[..., Any], Callable[..., Any]] = {}  # each registered function, disabled, once prepared
_prepared = False
# What dynamo says at a graph break on one of them (an error under fullgraph=True, where it cannot break).
REASON = ("accumnorm's exact step runs each BatchNorm call outside dynamo's graph, where the micro-batches meet: "
          "compile with fullgraph=False (the default), or pass bn='micro'")


def untraced(fn: F) -> F:
    """Register `fn` to run untraced when it is called through `call(fn)`."""
    _REGISTERED.append(fn)
    return fn


def skip_frames(fn: F) -> F:
    """Register `fn` (or a closure of its code) as a function dynamo never compiles as a frame of its own: it still
    traces it inline, in the frame it compiles."""
    code = fn.__code__
    if code not in _SKIPPED:
        _SKIPPED.add(code)
        if _prepared:
            torch._dynamo.eval_frame.skip_code(code)
    return fn


def prepare() -> None:
    """Make the registered functions' disabled versions and skip the frames, once dynamo is imported."""
    global _prepared
    if _prepared or "torch._dynamo" not in sys.modules:
        return
    for code in _SKIPPED:
        torch._dynamo.eval_frame.skip_code(code)
    for fn in _REGISTERED:
        _DISABLED[fn] = torch.compiler.disable(fn, reason=REASON)
    _prepared = True


def prepared() -> bool:
    """Whether dynamo is imported and the step's code prepared for it (`prepare`)."""
    return _prepared


@skip_frames
def call(fn: F) -> F:
    """`fn` as code that may be compiled calls it: untraced, once prepared, where dynamo traces the caller or a
    compiled frame's callback is set; as it is in eager code outside any compiled frame, where the disabled
    version's wrapper would switch off nothing and only cost a hot path its time."""
    if not torch.compiler.is_compiling() and _eval_frame_callback() is None:
        return fn
    return _DISABLED.get(fn, fn)


def wrap(fn: F) -> F:
    """`fn`, made now to run untraced (once prepared): for a callback torch calls from any code (module doc)."""
    return torch.compiler.disable(fn, reason=REASON) if _prepared else fn


@untraced
def _forget(mapping: dict[Any, Any], key: Any, _ref: Any) -> None:
    mapping.pop(key, None)


def forgetting(mapping: dict[Any, Any], key: Any) -> Callable[[Any], None]:
    """A weakref callback that takes `key` out of `mapping` when the referent goes, untraced (module doc): the one
    disabled function, given its arguments, rather than a disabled wrapper made for each callback."""
    return functools.partial(_DISABLED.get(_forget, _forget), mapping, key)
