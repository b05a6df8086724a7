"""Higher-order ops during a step: functions whose bodies dynamo traces as graphs of their own, out of the mode's sight.

Dynamo traces a `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` call and a
`torch.compiler.nested_compile_region` function's call (of `invoke_subgraph_placeholder`) as higher-order ops,
whose bodies it traces without the step's mode: a batch-statistics call there would be fused into the graph, one
micro-batch's statistics, unseen, and a BatchNorm layer's untraced forward would be dynamo's error. Dynamo knows
both functions by their identity, looked up when it traces (`torch._dynamo.variables.builder.is_utils_checkpoint`
and `is_invoke_subgraph`). For a step's length (`higher_order_ops_in_step`) both checks match nothing, and the
placeholder is a function that calls the region: dynamo calls torch's checkpoint as any function it does not trace
(a graph break, the call uncompiled, where the step makes it exact), and traces the region as ordinary code, under
the step's mode, breaking its graph at the region's BatchNorm calls as anywhere else. Only the checks change, not
the functions the user's code finds: a check that matched a function of the step's would trace it as torch's and
fail, and dynamo would then run the whole calling frame uncompiled, in the step and after it. A graph compiled
outside a step, with a higher-order op, is never run inside one (dynamo guards on the mode stack).

The other higher-order ops (torch.cond, while_loop, map, scan, ...) cannot be traced as ordinary code: a cond's
predicate may be data, and no graph break can happen inside their bodies, which dynamo traces without the step's mode
in a compiled model and in an eager one alike (they compile their bodies to run them). A batch-statistics call there
cannot meet the other micro-batches, and is refused before the step ends. For a step's length
(`higher_order_ops_in_step`) dynamo's functions that trace such a body into a graph of its own (`speculate_subgraph`,
and `speculate_subgraph_with_auto_output_flattening` where torch has it) scan the graph for the calls the mode would
hand to the schedule (`calls.batch_statistics_call`); a BatchNorm layer's untraced forward fails there first. Either
way dynamo is told that it cannot trace the body: an op that may fall back to eager does (a custom autograd.Function,
whose forward the mode then sees and refuses as in eager), the others fail with dynamo's error around this one, which
the step, once rolled back, raises as a ValueError (`refused_in`).

The first two swaps and the scan are held together (`higher_order_ops_in_step`), each shared by the steps that run
on any thread (`safety.shared.WhileStepsRun`) and put back however they end. They exist once dynamo is imported
(`untraced.prepared`). What they swap is process-wide, but dynamo traces a step's forwards on the step's own thread:
on any other thread (one in no step, compiling or running its own code) each acts as torch's.
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..safety import untraced
from ..safety.shared import WhileStepsRun
from .calls import batch_statistics_call

__all__ = ["higher_order_ops_in_step", "refused_in"]


_THIS_THREAD = threading.local()  # `steps`: how many steps run on this thread now


def _in_step() -> bool:
    """Whether a step runs on this thread: the swaps act as the step's here, and as torch's anywhere else."""
    return getattr(_THIS_THREAD, "steps", 0) > 0


@contextmanager
def _on_this_thread() -> Iterator[None]:
    _THIS_THREAD.steps = getattr(_THIS_THREAD, "steps", 0) + 1
    try:
        yield
    finally:
        _THIS_THREAD.steps -= 1


@untraced.skip_frames
def _region(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`invoke_subgraph_placeholder` during a step: the region's function, called as any function is."""
    if _in_step():
        return func(*args, **kwargs)
    return _HIGHER_ORDER_CALLS.before[0](func, *args, **kwargs)


def _is_invoke_subgraph(obj: object) -> bool:
    """Dynamo's check for a nested compile region's placeholder during a step: nothing is it on the step's thread;
    elsewhere torch's, which `_region` stands for."""
    return not _in_step() and (obj is _region or _HIGHER_ORDER_CALLS.before[1](obj))


def _is_utils_checkpoint(obj: object) -> bool:
    """Dynamo's check for torch's checkpoint during a step: nothing is it on the step's thread; elsewhere torch's."""
    return not _in_step() and _HIGHER_ORDER_CALLS.before[2](obj)


# what `_higher_order_calls` holds while steps run, in its order
_DURING = (_region, _is_invoke_subgraph, _is_utils_checkpoint)


def _higher_order_calls() -> tuple[Any, ...]:
    """(torch's `invoke_subgraph_placeholder`, dynamo's check for it, dynamo's check for torch's checkpoint) now;
    torch's, where a loop that kept the step's during a step put one back since."""
    builder = torch._dynamo.variables.builder
    found = (sys.modules["torch._higher_order_ops.invoke_subgraph"].invoke_subgraph_placeholder,
             builder.is_invoke_subgraph, builder.is_utils_checkpoint)
    before = _HIGHER_ORDER_CALLS.before or found
    return tuple(torchs if now is ours else now for now, ours, torchs in zip(found, _DURING, before))


def _set_higher_order_calls(calls: tuple[Any, ...]) -> None:
    sys.modules["torch._higher_order_ops.invoke_subgraph"].invoke_subgraph_placeholder = calls[0]
    torch._dynamo.variables.builder.is_invoke_subgraph, torch._dynamo.variables.builder.is_utils_checkpoint = calls[1:]


_HIGHER_ORDER_CALLS = WhileStepsRun(_higher_order_calls, _set_higher_order_calls, lambda torchs: _DURING)


def _scanned(speculate: Callable[..., Any]) -> Callable[..., Any]:
    """Dynamo's `speculate` (which traces a higher-order op's body into a graph of its own) during a step: the same,
    refusing a body with a batch-statistics norm (module doc)."""
    def scanned(tx: Any, f: Any, sub_args: Any, sub_kwargs: Any, description: str, *args: Any, **kwargs: Any) -> Any:
        if not _in_step():  # another thread's tracing, in no step
            return speculate(tx, f, sub_args, sub_kwargs, description, *args, **kwargs)
        try:
            traced = speculate(tx, f, sub_args, sub_kwargs, description, *args, **kwargs)
        except torch._dynamo.exc.Unsupported as e:
            if untraced.REASON not in str(e):  # not a BatchNorm layer's step forward
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
    message = (
        f"bn='exact' found {what} with batch statistics inside the body of {description}, which dynamo traces as a "
        "graph of its own, even in an uncompiled model: the micro-batches cannot meet there, and the call would "
        "normalize each micro-batch alone. Nothing was changed. Call the norm outside the body (before or after "
        f"{description}, or in a plain Python if/loop), or pass bn='micro'")
    try:
        refusal = torch._dynamo.exc.Unsupported(message, gb_type=_REFUSED)
    except TypeError:  # torch 2.8's takes no graph-break type: the refusal is marked by hand
        refusal = torch._dynamo.exc.Unsupported(message)
        refusal.gb_type = _REFUSED
    raise refusal


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


# Dynamo's functions that trace a higher-order op's body; torch 2.8 has the first only.
_SPECULATE_NAMES = ("speculate_subgraph", "speculate_subgraph_with_auto_output_flattening")


def _speculate_names() -> list[str]:
    hops = torch._dynamo.variables.higher_order_ops
    return [name for name in _SPECULATE_NAMES if hasattr(hops, name)]


def _torchs_speculates() -> tuple[Callable[..., Any], ...]:
    """Dynamo's functions that trace a higher-order op's body, now; torch's, where a loop that kept the step's
    during a step put them back since."""
    hops = torch._dynamo.variables.higher_order_ops
    return tuple(getattr(f, "torchs", f) for f in (getattr(hops, name) for name in _speculate_names()))


def _set_speculates(functions: tuple[Callable[..., Any], ...]) -> None:
    hops = torch._dynamo.variables.higher_order_ops
    for name, function in zip(_speculate_names(), functions, strict=True):
        setattr(hops, name, function)


_SPECULATES = WhileStepsRun(_torchs_speculates, _set_speculates, lambda torchs: tuple(map(_scanned, torchs)))


@contextmanager
def higher_order_ops_in_step() -> Iterator[None]:
    """For the block, once dynamo is imported: no higher-order op for torch's checkpoint or a nested compile region,
    and a batch-statistics norm in any other's body refused (module doc), on this thread. Steps on several threads
    share the swaps."""
    if not untraced.prepared():
        yield
        return
    with _HIGHER_ORDER_CALLS.held(), _SPECULATES.held(), _on_this_thread():
        yield
