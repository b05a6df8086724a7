"""A step's own checkpointed regions: the chosen modules' forwards run checkpointed for the step.

For the length of a step (`checkpointed`), each region (`regions`: a module, or a run of an `nn.Sequential`'s
children) runs its forward in a `recomputation.RegionFrame`, which keeps only the region's inputs and recomputes
the rest when the backward reaches it, as `torch.utils.checkpoint.checkpoint(..., use_reentrant=False,
preserve_rng_state=True)` does. A module region's forward is its class's, checkpointed; a run's is its
Sequential's, torch's own loop over the children with the run's children called in one frame. A region called
inside a region the user already checkpointed, or without grad, runs as it is. Each region call measures what its
forward saved, for the next steps' choice of regions (`regions.record_saved`).

A region is exact only if running its forward twice gives the same result: `RegionState` finds a forward that
changed a region module's Python attributes or buffers (other than the BatchNorm state the step itself keeps),
before the backward runs, and a forward that changed its arguments in place raises `RegionStateChanged` at once,
so that the step can start over without regions.
"""
from __future__ import annotations

import functools
import math
import types
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import tree_unflatten

from ..intercept.forwards import BATCH_NORM_BUFFERS
from ..safety import untraced
from ..safety.attributes import differs
from ..safety.flatten import flatten
from ..safety.threadstate import saved_tensor_hooks
from .again import RegionStateChanged
from .frames import in_recomputation, in_region
from .handoff import Handoffs
from .recomputation import Metadata, RegionFrame
from .regions import Region, Run, record_saved, region_modules

__all__ = ["RegionCall", "RegionState", "RegionStateChanged", "checkpointed", "patched"]


Own = Callable[[Any, "Region"], None]  # told of each region call's checkpoint frame in the forward


def _parameter_shapes(region: Region) -> Counter[tuple[int, ...]]:
    """The shapes of a region's parameters, each as many times as it has parameters of that shape."""
    return Counter(tuple(p.shape) for m in region_modules(region) for p in m.parameters())


def _saved_bytes(frame: RegionFrame, parameter_shapes: Counter[tuple[int, ...]], rows: int) -> float:
    """The bytes per sample a region's forward saved (its frame's metadata of each saved tensor), its modules'
    parameters left out: one saved tensor of each of `parameter_shapes`, in whatever dtype it was saved (under
    autocast a weight is saved as its reduced-precision copy)."""
    params = parameter_shapes.copy()
    saved = 0
    for shape, dtype, _ in frame.metadata:
        shape = tuple(shape)
        if params[shape] > 0:
            params[shape] -= 1
        else:
            saved += math.prod(shape) * dtype.itemsize
    return saved / max(1, rows)


def _region_call(region: Region, forward: Callable[..., Any], args: tuple, kwargs: dict[str, Any], *,
                 own: Own, cpu_state: Callable[[], Tensor], parameter_shapes: dict[Region, Counter[tuple[int, ...]]],
                 metadata: dict[Metadata, Metadata], handoffs: Handoffs) -> Any:
    """`forward(*args, **kwargs)` in a checkpointed region (`recomputation.RegionFrame`). The arguments go in as
    their tensors, which the region keeps, and a structure built afresh around them: a list the caller appends to
    after the call (DenseNet's features) is recomputed as the forward saw it. A forward that changes its tensors or
    containers in place is refused. `own(frame, region)` learns of each forward's call: the region's frame, in which
    convolutions may keep their outputs. `cpu_state()`: the CPU generator's state for the frame to begin its
    recomputation with. `parameter_shapes`: each region's (`_parameter_shapes`), read once a step; `metadata`: the
    step's frames' saved-tensor metadata, each once (`RegionFrame`); `handoffs`: the step's region outputs, which a
    later region call may take as its input."""
    hooks = saved_tensor_hooks()
    # Inside a region of the user's, in its forward or in its recomputation in the backward: as it is, both times.
    if not torch.is_grad_enabled() or in_region(hooks) or in_recomputation(hooks):
        return forward(*args, **kwargs)
    # The step's own bookkeeping around the forward, outside every torch-function mode: none of theirs to see.
    with torch._C.DisableTorchFunction():
        leaves, spec = flatten((args, kwargs))
        tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
        versions = [leaves[i]._version for i in tensors]
        given: list[Any] = [None]  # the arguments the forward (not a recomputation) was given
        # The arguments but their tensors, which the frame keeps through the hooks below it (the host store's copy).
        others = [None if isinstance(leaf, Tensor) else leaf for leaf in leaves]

        def run(*inputs: Tensor) -> Any:
            filled = list(others)
            for i, t in zip(tensors, inputs):
                filled[i] = t
            a, kw = tree_unflatten(filled, spec)
            if given[0] is None:
                given[0] = (a, kw)
            return forward(*a, **kw)

        inputs = [leaves[i] for i in tensors]
        frame = RegionFrame(run, inputs, cpu_state(), metadata)
        handoffs.took(frame, inputs)
        own(frame, region)
    out = frame.forward(run, inputs, handoffs.later(region))
    handoffs.gave(frame, region, out)
    with torch._C.DisableTorchFunction():
        if region not in parameter_shapes:  # after its first forward, which makes a lazy layer's parameters
            parameter_shapes[region] = _parameter_shapes(region)
        rows = inputs[0].shape[0] if inputs and inputs[0].dim() else 1
        record_saved(region, _saved_bytes(frame, parameter_shapes[region], rows))
        (after, after_spec), given[0] = flatten(given[0]), False
        if after_spec != spec or [leaves[i]._version for i in tensors] != versions or any(
                a is not b for i, (a, b) in enumerate(zip(after, leaves)) if i not in tensors):
            raise RegionStateChanged(f"the recompute schedule runs a region's forward again in the backward, but the "
                                     f"forward of {type(region_modules(region)[0]).__name__} changed its arguments in "
                                     "place: its recomputation would not be exact")
    return out


RegionCall = Callable[["Region", Callable[..., Any], tuple, dict], Any]  # (region, its forward, args, kwargs)


@untraced.untraced
def _run(call: RegionCall, region: Region, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """A region's call, which code that may be compiled makes untraced."""
    return call(region, forward, args, kwargs)


def _module_forward(call: RegionCall) -> Callable[..., Any]:
    """A module region's forward: its class's, run by `call`."""
    @untraced.skip_frames
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return untraced.call(_run)(call, self, types.MethodType(type(self).forward, self), args, kwargs)
    return forward


def _sequential_forward(runs: list[Run], call: RegionCall) -> Callable[..., Any]:
    """torch's `nn.Sequential.forward` with `runs` of its children each run by one `call`: every child is called as
    torch calls it (its hooks run), on the output of the one before."""
    @untraced.skip_frames
    def forward(self: nn.Sequential, input: Any) -> Any:  # noqa: A002 - torch's name
        children = list(self._modules.values())
        done = 0
        for run in runs:
            for child in children[done:run.start]:
                input = child(input)
            input = untraced.call(_run)(call, run, functools.partial(_call_in_turn, run.children()), (input,), {})
            done = run.stop
        for child in children[done:]:
            input = child(input)
        return input
    return forward


def _call_in_turn(children: list[nn.Module], input: Any) -> Any:
    for child in children:
        input = child(input)
    return input


def checkpointed(regions: list[Region], own: Own, handoffs: Handoffs,
                 cpu_state: Callable[[], Tensor] = torch.get_rng_state) -> AbstractContextManager[None]:
    """The regions' forwards checkpointed until the block ends: a module region's own forward, and the forward of
    the `nn.Sequential` that holds a run. `own(frame, region)` learns of each checkpoint frame they make;
    `handoffs` follows their outputs, and is settled once the forwards end (`Handoffs.settle`); `cpu_state()` gives
    the CPU generator's state each frame's recomputation begins with. Default: read anew."""
    return patched(regions, functools.partial(_region_call, own=own, cpu_state=cpu_state, parameter_shapes={},
                                              metadata={}, handoffs=handoffs))


@contextmanager
def patched(regions: list[Region], call: RegionCall) -> Iterator[None]:
    """Each region's forward run by `call(region, forward, args, kwargs)` until the block ends: a module region's
    own forward, and the forward of the `nn.Sequential` that holds a run."""
    runs: dict[nn.Sequential, list[Run]] = {}
    for r in regions:
        if isinstance(r, Run):
            runs.setdefault(r.parent, []).append(r)
    modules = [m for m in regions if isinstance(m, nn.Module)] + list(runs)
    for m in regions:
        if isinstance(m, nn.Module):
            m.forward = types.MethodType(_module_forward(call), m)
    for seq, its_runs in runs.items():
        seq.forward = types.MethodType(_sequential_forward(sorted(its_runs, key=lambda r: r.start), call), seq)
    try:
        yield
    finally:
        for m in modules:
            vars(m).pop("forward", None)


class RegionState:
    """What a forward must leave alone in the regions' modules: their attributes and their buffers' versions, as
    the step found them, at the forwards' end and at each region call (the recomputation runs with them as they are
    at the end: a `training` flag switched off around one call and back would run that call otherwise)."""

    def __init__(self, regions: list[Region],
                 written: Callable[[list[nn.Module]], tuple[nn.Module, str] | None]) -> None:
        self.regions = {r: list(dict.fromkeys(d for m in region_modules(r) for d in m.modules())) for r in regions}
        modules = list(dict.fromkeys(m for ms in self.regions.values() for m in ms))
        self.attributes = {m: dict(vars(m)) for m in modules}
        # a BatchNorm's running statistics the step writes itself: `written(layers)` (the step's ledger) says whether a
        # forward wrote them too, and which
        self.buffers = [(m, name, b, b._version) for m in modules for name, b in m._buffers.items()
                        if b is not None and not (isinstance(m, _BatchNorm) and name in BATCH_NORM_BUFFERS)]
        self.written, self.norms = written, [m for m in modules if isinstance(m, _BatchNorm)]
        self.called_otherwise: tuple[nn.Module, str] | None = None  # a module and attribute, at a region call

    def called(self, region: Region) -> None:
        """A forward's call of `region`: note it if its modules' attributes are not the step's."""
        if self.called_otherwise is None:
            for m in self.regions[region]:
                key = differs(self.attributes[m], vars(m))
                if key is not None:
                    self.called_otherwise = (m, key)
                    return

    def close(self) -> None:
        """Let go of the attributes copied: they hold the patched forwards, which hold the schedule's region call,
        which may hold this (a cycle that would keep the step for Python's next full collection)."""
        self.attributes = {}

    def changed(self, names: dict[nn.Module, str]) -> str | None:
        for m, before in self.attributes.items():
            key = differs(before, vars(m))
            if key is not None:
                return f"{type(m).__name__} {names.get(m, '')} set its attribute {key!r}"
        for m, name, b, version in self.buffers:
            if m._buffers.get(name) is not b or b._version != version:
                return f"{type(m).__name__} {names.get(m, '')} changed its buffer {name!r}"
        written = self.written(self.norms)
        if written is not None:
            return f"{type(written[0]).__name__} {names.get(written[0], '')} changed its buffer {written[1]!r}"
        if self.called_otherwise is not None:
            m, key = self.called_otherwise
            return (f"{type(m).__name__} {names.get(m, '')} was called with its attribute {key!r} set otherwise than "
                    "it is at the forward's end")
        return None
