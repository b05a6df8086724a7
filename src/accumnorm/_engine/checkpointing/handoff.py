"""Region outputs handed on: a recompute region's output that the next region takes, unchanged, as its input.

A region's forward fingerprints its outputs (`again`), for its recomputation in the backward to be checked against.
Where its output is one tensor that the next region keeps as its input (a chain of blocks, a Sequential's runs), that
tensor itself lives until the backward: the recomputation is compared with it (`again.check_kept`), and neither run
takes a fingerprint. On a net of small regions, where each op costs more than its work, the two fingerprints were
most of a region call's own cost.

Whether an output is handed on is known only once the next region is called, and by then it may have been changed
in place (a `ReLU(inplace=True)` between two runs). So a region's output is left unread only where an earlier step
saw that region's output handed on. It is read (`RegionFrame.settle`) when the next region call shows it is not, or
at the forwards' end. One changed in place meanwhile refuses the step (`RegionStateChanged`, which starts it over
under layerwise), and that region's output is read at once from then on.
"""
from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from .recomputation import RegionFrame
from .regions import Region, RegionMemo

__all__ = ["HANDED_ON", "Handoffs"]

HANDED_ON = RegionMemo()  # whether a region's output was last seen handed on to the next region


class Handoffs:
    """One step's region outputs, until a region takes them or the forwards end (module doc)."""

    def __init__(self) -> None:
        # id(output) -> (the frame that gave it, its region, a weak reference to it, its version then)
        self._given: dict[int, tuple[RegionFrame, Region, weakref.ref, int]] = {}
        # the frames that hold their output (left for later, then handed on): each one's output holds, through its
        # graph's saved-tensor hooks, the frame itself, a cycle through autograd's graph that only the backward, or
        # `close`, breaks
        self._holding: list[weakref.ref[RegionFrame]] = []

    def later(self, region: Region) -> Callable[[], None] | None:
        """What a call of `region` gives `RegionFrame.forward`: None, to read its output at once; or, where the output
        was last handed on, what to call where it can no longer be read as the forward made it."""
        return functools.partial(HANDED_ON.set, region, False) if HANDED_ON.get(region) else None

    def gave(self, frame: RegionFrame, region: Region, out: Any) -> None:
        """A region call's output, which a later region call may take."""
        if type(out) is Tensor:
            self._given[id(out)] = (frame, region, weakref.ref(out), out._version)
            if frame.pending is not None:
                self._holding.append(weakref.ref(frame))

    def took(self, frame: RegionFrame, inputs: Sequence[Tensor]) -> None:
        """A region call's `inputs`, which its `frame` keeps: the outputs among them, handed on where unchanged."""
        for t in inputs:
            entry = self._given.pop(id(t), None)
            if entry is None:
                continue
            giver, region, ref, version = entry
            if ref() is not t:
                continue
            if t._version != version:
                giver.settle()  # refuses an output left for later
                continue
            HANDED_ON.set(region, True)
            if giver.pending is not None and frame.inputs_as_given:
                giver.hand_on()
            else:
                giver.settle()

    def settle(self) -> None:
        """The forwards' end: the outputs left for later that no region took are read, and read at once from now; those
        handed on are let go of once the backward has compared its recomputation with them."""
        for frame in self._frames():
            frame.last_recomputation = True
        given, self._given = self._given, {}
        for giver, region, _, _ in given.values():
            if giver.pending is not None:
                HANDED_ON.set(region, False)
                giver.settle()

    def close(self) -> None:
        """The step's end, or its failure: every frame lets go of the output it holds (a region whose backward never
        ran, a step that failed before its backward, would otherwise keep it, and its graph, for good)."""
        for frame in self._frames():
            frame.let_go()
        self._given, self._holding = {}, []

    def _frames(self) -> list[RegionFrame]:
        return [frame for ref in self._holding if (frame := ref()) is not None]
