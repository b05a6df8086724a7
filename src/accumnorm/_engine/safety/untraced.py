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
callbacks) would be compiled as frames of their own when that code is compiled: they run untraced too (`wrap`).

Dynamo traces a `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` call of compiled code as a
higher-order op, whose body it traces without the step's mode: a batch-statistics call there would be fused into
the graph, one micro-batch's statistics, unseen. It knows that function by its identity, looked up when it
traces; for a step's length (`checkpoint_calls_untraced`) `torch.utils.checkpoint.checkpoint` is a function
that calls it, so dynamo finds a function it must not trace and runs the checkpoint call uncompiled, as the
step's own code makes it exact, and graphs compiled in a step (under its mode, on which dynamo guards) keep
that graph break.

A `torch.compiler.nested_compile_region` function calls `invoke_subgraph_placeholder`, which dynamo traces as a
higher-order op (invoke_subgraph) whose body it traces without the step's mode, as for a checkpoint: a bare
batch-statistics call there would be fused, a BatchNorm layer's untraced forward would be dynamo's error. Dynamo
knows the placeholder by its identity, looked up when it traces; for a step's length (`compile_regions_as_code`) the
region's placeholder is a function calling the region, and dynamo's check for the placeholder
(`torch._dynamo.variables.builder.is_invoke_subgraph`) matches nothing: dynamo traces the region as ordinary code,
under the step's mode, and breaks its graph at the region's BatchNorm calls as anywhere else. A graph compiled
outside a step, with the region's higher-order op, is never run inside one (dynamo guards on the mode stack).

The other higher-order ops (torch.cond, while_loop, map, scan, ...) cannot be traced as ordinary code: a cond's
predicate may be data, and no graph break can happen inside their bodies, which dynamo traces without the step's mode
in a compiled model and in an eager one alike (they compile their bodies to run them). A batch-statistics call there
cannot meet the other micro-batches, and is refused before the step ends. For a step's length
(`norms_in_bodies_refused`) dynamo's two functions that trace such a body into a graph of its own
(`speculate_subgraph`, `speculate_subgraph_with_auto_output_flattening`) scan the graph for the calls the mode would
hand to the schedule (`calls.batch_statistics_call`); a BatchNorm layer's untraced forward fails there first. Either
way dynamo is told that it cannot trace the body: an op that may fall back to eager does (a custom autograd.Function,
whose forward the mode then sees and refuses as in eager), the others fail with dynamo's error around this one, which
the step, once rolled back, raises as a ValueError (`refused_in`).

`untraced` registers a function; `prepare()`, at each step's start, makes the disabled versions once dynamo
is imported (importing it costs a second: a process that never compiles never pays it); `call(fn)` is what
code that may be compiled calls instead of `fn`.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from types import CodeType
from typing import Any, TypeVar

import torch
import torch.utils.checkpoint

from .shared import WhileStepsRun

__all__ = ["call", "checkpoint_calls_untraced", "compile_regions_as_code", "norms_in_bodies_refused", "prepare",
           "refused_in", "skip_frames", "untraced", "wrap"]

F = TypeVar("F", bound=Callable[..., Any])

_REGISTERED: list[Callable[..., Any]] = []
_SKIPPED: set[CodeType] = set()
_DISABLED: dict[Callable[..., Any], Callable[..., Any]] = {}  # each registered function, disabled, once prepared
_prepared = False
# What dynamo says at a graph break on one of them (an error under fullgraph=True, where it cannot break).
_REASON = ("accumnorm's exact step runs each BatchNorm call outside dynamo's graph, where the micro-batches meet: "
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
        _DISABLED[fn] = torch.compiler.disable(fn, reason=_REASON)
    _prepared = True


def call(fn: F) -> F:
    """`fn` as code that may be compiled calls it: untraced, once prepared (else as it is)."""
    return _DISABLED.get(fn, fn)


def wrap(fn: F) -> F:
    """`fn`, made now to run untraced (once prepared): for a callback torch calls from any code (module doc)."""
    return torch.compiler.disable(fn, reason=_REASON) if _prepared else fn


@skip_frames
def _checkpoint(*args: Any, **kwargs: Any) -> Any:
    """`torch.utils.checkpoint.checkpoint` during a step: torch's, under another identity and name (dynamo knows
    torch's by both)."""
    return _CHECKPOINT_CALLS.before(*args, **kwargs)


def _torchs_checkpoint() -> Callable[..., Any]:
    """`torch.utils.checkpoint.checkpoint` now; torch's, where a loop that kept `_checkpoint` during a step put that
    back since (its call would call itself)."""
    found = torch.utils.checkpoint.checkpoint
    return _CHECKPOINT_CALLS.before if found is _checkpoint else found


_CHECKPOINT_CALLS = WhileStepsRun(_torchs_checkpoint, lambda f: setattr(torch.utils.checkpoint, "checkpoint", f),
                                  lambda torchs: _checkpoint)


def checkpoint_calls_untraced() -> AbstractContextManager[None]:
    """For the block, `torch.utils.checkpoint.checkpoint` as a function calling torch's, once prepared (module doc);
    steps on several threads share one swap."""
    return _CHECKPOINT_CALLS.held() if _prepared else nullcontext()


@skip_frames
def _region(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`invoke_subgraph_placeholder` during a step: the region's function, called as any function is."""
    return func(*args, **kwargs)


def _never(obj: object) -> bool:
    """Dynamo's check for `invoke_subgraph_placeholder` during a step: nothing is it."""
    return False


def _torchs_regions() -> tuple[Callable[..., Any], Callable[[object], bool]]:
    """(torch's placeholder, dynamo's check for it) now; torch's, where a loop that kept the step's during a step put
    them back since."""
    found = (sys.modules["torch._higher_order_ops.invoke_subgraph"].invoke_subgraph_placeholder,
             torch._dynamo.variables.builder.is_invoke_subgraph)
    return _REGION_CALLS.before if found[0] is _region else found


def _set_regions(pair: tuple[Callable[..., Any], Callable[[object], bool]]) -> None:
    sys.modules["torch._higher_order_ops.invoke_subgraph"].invoke_subgraph_placeholder = pair[0]
    torch._dynamo.variables.builder.is_invoke_subgraph = pair[1]


_REGION_CALLS = WhileStepsRun(_torchs_regions, _set_regions, lambda torchs: (_region, _never))


def compile_regions_as_code() -> AbstractContextManager[None]:
    """For the block, `torch.compiler.nested_compile_region` functions traced by dynamo as ordinary code, once
    prepared (module doc); steps on several threads share one swap."""
    return _REGION_CALLS.held() if _prepared else nullcontext()


def _scanned(speculate: Callable[..., Any]) -> Callable[..., Any]:
    """Dynamo's `speculate` (which traces a higher-order op's body into a graph of its own) during a step: the same,
    refusing a body with a batch-statistics norm (module doc)."""
    def scanned(tx: Any, f: Any, sub_args: Any, sub_kwargs: Any, description: str, *args: Any, **kwargs: Any) -> Any:
        from ..intercept.calls import batch_statistics_call

        try:
            traced = speculate(tx, f, sub_args, sub_kwargs, description, *args, **kwargs)
        except torch._dynamo.exc.Unsupported as e:
            if _REASON not in str(e):  # not a BatchNorm layer's step forward
                raise
            _refuse_body(description, "a BatchNorm layer's call")
        for node in traced[1].nodes:
            if node.op == "call_function" and batch_statistics_call(node.target, node.args, node.kwargs):
                _refuse_body(description, f"a {torch.overrides.resolve_name(node.target) or node.target} call")
        return traced

    scanned.torchs = speculate
    return scanned


def _refuse_body(description: str, what: str) -> None:
    """Tell dynamo it cannot trace the body: a higher-order op that may run uncompiled does (and the step's mode sees
    the call), the others fail with dynamo's error around this one (`refused_in`)."""
    raise torch._dynamo.exc.Unsupported(
        f"bn='exact' found {what} with batch statistics inside the body of {description}, which dynamo traces as a "
        "graph of its own, even in an uncompiled model: the micro-batches cannot meet there, and the call would "
        "normalize each micro-batch alone. Nothing was changed. Call the norm outside the body (before or after "
        f"{description}, or in a plain Python if/loop), or pass bn='micro'", gb_type=_REFUSED)


_REFUSED = "accumnorm: a batch-statistics norm in a higher-order op's body"


def refused_in(error: BaseException) -> ValueError | None:
    """The refusal of a norm in a higher-order op's body (`_refuse_body`) that `error` (dynamo's) was raised around,
    as a ValueError with `error`'s notes (which micro-batch); None if there is none."""
    found: BaseException | None = error
    for _ in range(8):  # dynamo's own wrappers, each around the next
        if found is None or getattr(found, "gb_type", None) == _REFUSED:
            break
        found = found.__cause__ or found.__context__
    if found is None or getattr(found, "gb_type", None) != _REFUSED:
        return None
    refused = ValueError(found.msg)
    for note in getattr(error, "__notes__", ()):
        refused.add_note(note)
    return refused


def _torchs_speculates() -> tuple[Callable[..., Any], ...]:
    """Dynamo's two functions that trace a higher-order op's body, now; torch's, where a loop that kept the step's
    during a step put them back since."""
    hops = torch._dynamo.variables.higher_order_ops
    return tuple(getattr(f, "torchs", f) for f in (hops.speculate_subgraph,
                                                   hops.speculate_subgraph_with_auto_output_flattening))


def _set_speculates(pair: tuple[Callable[..., Any], ...]) -> None:
    hops = torch._dynamo.variables.higher_order_ops
    hops.speculate_subgraph, hops.speculate_subgraph_with_auto_output_flattening = pair


_SPECULATES = WhileStepsRun(_torchs_speculates, _set_speculates, lambda torchs: tuple(map(_scanned, torchs)))


def norms_in_bodies_refused() -> AbstractContextManager[None]:
    """For the block, dynamo's tracing of a higher-order op's body refuses a batch-statistics norm there, once
    prepared (module doc); steps on several threads share one swap."""
    return _SPECULATES.held() if _prepared else nullcontext()
