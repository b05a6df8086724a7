"""The segments schedule's regions: each keeps its arguments alone, and the micro-batches meet at its exit.

For the length of a step (`SegmentedRegions.patched`), each region (`regions`: a module, or a run of an
`nn.Sequential`'s children) runs its forward, in each micro-batch's coroutine, under saved-tensor hooks that keep
nothing. The micro-batches still meet at every BatchNorm call inside it (whole-batch statistics, running statistics
moved once). Of its forward the region keeps only its arguments, the micro-batch's random-stream state and modes at
its entry, and the statistics of the calls it made (`Entry`). At its exit the K micro-batches meet once more
(`RegionExit`): one autograd node over the K joins every micro-batch's arguments to its outputs, and its backward
recomputes each micro-batch's region alone (`region_passes`).

So the step holds the regions' arguments of the whole batch, what runs outside regions, and in the backward one
micro-batch's recomputation of one region, where recompute holds every micro-batch's at once.

A region call runs as it is without grad, inside another region (the step's, or a checkpoint of the user's), and
with one micro-batch. A forward that changes its arguments in place is refused (`RegionStateChanged`), so that the
step can start over under layerwise.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import TreeSpec, tree_unflatten

from ..bn.replay import CallReplay
from ..memory.budget import Meter
from ..memory.heap import release_free_memory
from ..safety.flatten import flatten
from ..safety.graphs import holds_user_functions
from ..safety.threadstate import Modes, saved_tensor_hooks
from .again import RegionStateChanged
from .checkpointed import RegionState, patched
from .frames import in_recomputation, in_region, in_segment, keeping_nothing
from .region_passes import RegionPasses
from .regions import Region, region_modules

__all__ = ["Entry", "RegionExit", "SegmentedRegions"]


@dataclass(eq=False)
class Entry:
    """What one micro-batch's call of a region keeps for its recomputation."""

    region: Region
    forward: Callable[..., Any]
    leaves: list[Any]  # the call's arguments, flattened
    spec: TreeSpec
    tensors: list[int]  # the positions of the tensors among `leaves`
    rng: list[Tensor]  # the micro-batch's random-stream state at the call, per generator
    modes: Modes
    calls: list[CallReplay] = field(default_factory=list)  # the met BatchNorm calls it made, in order
    refusal: Callable[[Any], None] | None = None  # of a backward through its last BatchNorm call (`Step`)
    positions: list[int] = field(default_factory=list)  # which of the outputs' leaves the region's node gives
    # argument position -> (the region before, whose output it is, and which output): what it can be recomputed from
    sources: dict[int, tuple[RegionPasses, int]] = field(default_factory=dict)
    saved: int = 0  # the bytes its forward would have saved: what its recomputation holds
    user_functions: bool = False  # whether its graph holds a custom autograd.Function of yours (micro-batch 0's)

    def __post_init__(self) -> None:
        self.requires_grad = [self.leaves[i].requires_grad for i in self.tensors]

    def arguments(self, given: list[Tensor]) -> tuple[tuple, dict, list[Tensor]]:
        """The call's arguments again, its tensors `given` (one for each of `tensors`) each a new leaf, requiring
        grad where the forward's did: args, kwargs, leaves."""
        leaves, inputs = list(self.leaves), []
        for i, t, grad in zip(self.tensors, given, self.requires_grad):
            leaves[i] = x = t.detach().requires_grad_(grad)
            inputs.append(x)
        args, kwargs = tree_unflatten(leaves, self.spec)
        return args, kwargs, inputs


@dataclass(eq=False)
class RegionExit:
    """A micro-batch at the end of a region's call: its outputs (without their forward's graph), to meet."""

    entry: Entry
    outputs: list[Tensor]


_RECORDS = (Entry, CallReplay)  # what "auto"'s meter opens of a region call's record (`memory.objects`)


class SegmentedRegions:
    """The regions of one segments step (module doc)."""

    def __init__(self, step: Any, regions: list[Region], keep_every: int = 1, meter: Meter | None = None) -> None:
        # step: `step.Step`; meter: "auto"'s, which counts the arguments the regions keep
        self.step, self.regions, self.keep_every, self.meter = step, regions, keep_every, meter
        self.backward_bytes = 0  # the most one region's backward holds beside what the step keeps (`meet`)
        self.open: list[Entry | None] = [None] * len(step.micro_batches)  # each micro-batch's region call, if any
        # Each micro-batch's outputs of the last region node it left, as (the node's passes, weak references to the
        # outputs, their versions then): a region called on one of them, unchanged, can recompute it from there.
        self.last: list[tuple[RegionPasses, list[weakref.ref], list[int]] | None] = [None] * len(step.micro_batches)
        self.node: RegionPasses | None = None  # the last region node made
        self.lockstep: Any = None  # the lockstep that runs the forwards (`attach`)
        self.state: RegionState | None = None
        self.refusal: Callable[[Any], None] | None = None  # the last met call's refusal of a backward through it

    def patched(self) -> Iterator[None]:
        """The regions' forwards run by `call` until the block ends."""
        return patched(self.regions, self.call)

    def attach(self, lockstep: Any) -> None:
        """The lockstep whose micro-batches call the regions: its running micro-batch, and its pause."""
        self.lockstep = lockstep
        self.state = RegionState(self.regions, self.step.ledger.changed_statistics)

    def close(self) -> None:
        """Let go of the lockstep and the last call's refusal, which hold each other and this (a cycle), and of the
        modules' attributes `state` copied, whose patched forwards hold this too."""
        self.lockstep = self.refusal = self.node = self.state = None
        self.last = [None] * len(self.last)

    def changed(self) -> str | None:
        """What a forward changed in the regions' modules, which their recomputation would not see; None if nothing."""
        return None if self.state is None else self.state.changed(self.step.names)

    def called(self, k: int, replay: CallReplay, hooks: tuple[tuple[Any, Any], ...]) -> None:
        """A met BatchNorm call of micro-batch k inside its region (`hooks`: the saved-tensor hooks at the call)."""
        if in_region(hooks):
            raise RegionStateChanged(
                "the segments schedule recomputes a region alone in the backward, but a BatchNorm call in it runs "
                "inside a torch.utils.checkpoint of your own, whose recomputation torch runs outside the step")
        entry = self.open[k]
        if entry is not None:
            entry.calls.append(replay)
            entry.refusal = self.refusal

    def call(self, region: Region, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A region's call in a micro-batch's forward (module doc)."""
        k = None if self.lockstep is None else self.lockstep.current
        hooks = saved_tensor_hooks()
        # One micro-batch alone needs no region; under a process group it runs them still, as the other ranks do (a
        # region's backward sums its calls across the ranks).
        alone = len(self.open) == 1 and self.step.collectives.group is None
        if k is None or self.open[k] is not None or alone or not torch.is_grad_enabled() or \
                in_region(hooks) or in_recomputation(hooks) or in_segment(hooks):
            return forward(*args, **kwargs)
        # The step's own bookkeeping around the forward, outside every torch-function mode: none of theirs to see.
        with torch._C.DisableTorchFunction():
            self.state.called(region)
            leaves, spec = flatten((args, kwargs))
            tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
            versions = [leaves[i]._version for i in tensors]
            entry = Entry(region, forward, leaves, spec, tensors, self.step.rng.shared_states(), Modes.current(),
                          sources=self._sources(k, leaves, tensors))
            self.open[k] = entry
        hooks, kept = keeping_nothing()
        try:
            with hooks:
                out = forward(*args, **kwargs)
        finally:
            self.open[k] = None
        with torch._C.DisableTorchFunction():
            entry.saved = kept.counted.bytes
            after, after_spec = flatten((args, kwargs))
            if after_spec != spec or [leaves[i]._version for i in tensors] != versions or any(
                    a is not b for a, b in zip(after, leaves)):
                raise RegionStateChanged(
                    f"the segments schedule runs a region's forward again in the backward, but the forward of "
                    f"{type(region_modules(region)[0]).__name__} changed its arguments in place: its recomputation "
                    "would not be exact")
            out_leaves, out_spec = flatten(out)
            del out
            positions = [i for i, t in enumerate(out_leaves) if isinstance(t, Tensor) and t.requires_grad]
            if k == 0:  # each micro-batch's forward makes the same graph
                entry.user_functions = holds_user_functions([out_leaves[i] for i in positions])
            outputs = [out_leaves[i].detach() for i in positions]
            for i in positions:  # the forward's graph of the region goes
                out_leaves[i] = None
            entry.positions = positions
        given = self.lockstep.pause(RegionExit(entry, outputs))  # in the thread's state: the others' come meanwhile
        del outputs
        with torch._C.DisableTorchFunction():
            self.last[k] = (self.node, [weakref.ref(t) for t in given], [t._version for t in given])
            for i, t in zip(positions, given):
                out_leaves[i] = t
            return tree_unflatten(out_leaves, out_spec)

    def meet(self, ends: list[Any], index: int) -> list[list[Tensor]]:
        """The K micro-batches at a region's exit (the step's `index`-th): each one's outputs of one node over the K,
        whose backward is the region's passes."""
        i, first = next((i, end) for i, end in enumerate(ends) if isinstance(end, RegionExit))
        for k, end in enumerate(ends):
            problem = _differs(first, end)
            if problem is not None:
                raise ValueError(
                    f"bn='exact' needs every micro-batch to make the same calls in the same order, but micro-batch {k} "
                    f"{problem} where micro-batch {i} was at the exit of a region "
                    f"({type(region_modules(first.entry.region)[0]).__name__}, the step's region call {index}). "
                    "Nothing was changed. Make every micro-batch's forward make the same calls, or use "
                    "schedule='layerwise'")
        entries = [end.entry for end in ends]
        passes = self.node = RegionPasses(self.step, entries, [end.outputs for end in ends])
        outputs = passes.node(self._running)
        self.step.graphs.met_region(outputs, [[e.leaves[i] for i in e.tensors] for e in entries])
        flowing = _gradient_bytes(ends)
        dropped = self._keep_or_drop(passes, entries)
        release_free_memory(passes.device)  # every micro-batch's forward of the region is gone (`memory.heap`)
        # Its backward holds one micro-batch's recomputation at a time, every micro-batch's dropped arguments
        # recomputed for it, and the whole batch's gradients at the region's exit and at its entrance.
        self.backward_bytes = max(self.backward_bytes, max(e.saved for e in entries) + dropped + flowing)
        if self.meter is not None:
            for e in entries:
                for i in e.tensors:
                    if e.leaves[i] is not None:
                        self.meter.count(e.leaves[i])
            self.meter.count_objects(entries, _RECORDS)  # what each call keeps beside its tensors
        return outputs

    def _sources(self, k: int, leaves: list[Any], tensors: list[int]) -> dict[int, tuple[RegionPasses, int]]:
        """The arguments of micro-batch k's region call that are, unchanged, outputs of the last region node it
        left: position -> (that node's passes, which output)."""
        last = self.last[k]
        if last is None:
            return {}
        passes, refs, versions = last
        sources = {}
        for i in tensors:
            for j, (ref, version) in enumerate(zip(refs, versions)):
                if ref() is leaves[i] and leaves[i]._version == version:
                    sources[i] = (passes, j)
                    break
        return sources

    def _keep_or_drop(self, passes: RegionPasses, entries: list[Entry]) -> int:
        """Keep the region's arguments, or (every micro-batch's come from one region node, the chain from the last
        kept ones is shorter than `keep_every`) let go of those the region before can give again; returns the bytes
        let go of."""
        first = entries[0].sources
        source = next(iter(first.values()))[0] if first else None
        chained = source is not None and all(
            e.sources.keys() == first.keys() and all(p is source for p, _ in e.sources.values()) for e in entries)
        passes.depth = source.depth + 1 if chained else 0
        if passes.depth % self.keep_every == 0:
            passes.depth = 0
            for e in entries:
                e.sources = {}
            return 0
        dropped = 0
        for e in entries:
            for i in e.sources:
                dropped += e.leaves[i].untyped_storage().nbytes()
                e.leaves[i] = None
        return dropped

    def _running(self) -> int | None:
        return None if self.lockstep is None else self.lockstep.current


def _gradient_bytes(ends: list[RegionExit]) -> int:
    """The bytes of the gradients a region's node holds at once in its backward: those of every micro-batch's outputs,
    which it is given, and of its arguments that require grad, which it gives."""
    outputs = sum(o.numel() * o.element_size() for end in ends for o in end.outputs)
    arguments = sum(e.leaves[i].numel() * e.leaves[i].element_size()
                    for e in (end.entry for end in ends) for i, grad in zip(e.tensors, e.requires_grad) if grad)
    return outputs + arguments


def _differs(first: RegionExit, end: Any) -> str | None:
    """How a micro-batch's end of a turn differs from another's region exit, if it does."""
    if not isinstance(end, RegionExit):
        return "had ended its forward"
    if end.entry.region is not first.entry.region:
        return "was at the exit of another region"
    if [(o.shape[1:], o.dtype) for o in end.outputs] != [(o.shape[1:], o.dtype) for o in first.outputs]:
        return "left the region with outputs of other shapes or dtypes"
    if len(end.entry.calls) != len(first.entry.calls):
        return f"made {len(end.entry.calls)} BatchNorm calls in the region"
    return None
