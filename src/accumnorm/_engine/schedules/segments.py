"""The segments schedule: layerwise, with each region's forward keeping nothing and its backward run alone.

Recompute keeps the regions' inputs of the whole batch and, in the backward, one region's recomputation for all K
micro-batches at once: a met BatchNorm call's backward needs every piece. Here the micro-batches also meet at each
region's exit (`checkpointing.segmented`), and the region's backward recomputes one micro-batch at a time, in the
passes schedule's passes over the region alone (`checkpointing.region_passes`): the step holds the regions'
arguments of the whole batch (of one region in `keep_every` of a chain) and one micro-batch's recomputation of one
region. It runs each region's forward about half as many times more as the region makes BatchNorm calls, plus two.
"auto" runs it where recompute does not fit, at the first of `keep_every` 1, 2 and 4 that does, before passes.
On the CPU it hands the C heap's free pages back to the OS at each region's exit and after each region's backward,
and with a budget whenever the step's resident memory nears it (`memory.heap`, as every lockstep schedule): what
glibc keeps of the regions' freed blocks would otherwise be much of its resident peak.

A step whose forward changed a region's state is refused before its backward (`RegionStateChanged`), so that the
step can start over under layerwise; so is one whose recomputation gives other outputs, in the backward.
"""
from __future__ import annotations

from typing import Any

from ..checkpointing.checkpointed import RegionStateChanged
from ..checkpointing.regions import choose_regions
from ..checkpointing.segmented import SegmentedRegions
from ..memory.budget import Meter
from ..memory.store import Store
from ..step.step import Step
from .base import Schedule
from .layerwise import lockstep

__all__ = ["Segments"]

_AUTO_KEEP_EVERY = (1, 2, 4)  # the settings "auto" tries, fastest first


class Segments(Schedule):
    """Exact BatchNorm in lockstep, each region recomputed one micro-batch at a time in its backward (module doc).

    Raises RegionStateChanged, before any backward, if a region's forward changed its module's state; under a
    `Meter` ("auto"), OverBudget once the regions' kept arguments, or before the backward what its largest region's
    backward holds, would pass the budget.
    """

    name = "segments"
    backward_once = False  # a region's backward, one per pass

    def __init__(self, keep_every: int = 2) -> None:
        # Of a chain of regions, each one's output the next one's argument: the arguments of every keep_every-th
        # stay, the others are recomputed in the backward from the last kept ones. Two by default: half the kept
        # arguments for one region forward more in every other region's backward, against the region's passes.
        self.keep_every = keep_every

    def setting(self) -> str:
        return f", keeping the arguments of one region in {self.keep_every} of a chain"

    @property
    def settings(self) -> dict[str, Any]:
        return {"keep_every": self.keep_every}

    def choices(self) -> list[Schedule]:
        # Fewer kept arguments for more recomputation: each doubling of keep_every about halves what the regions'
        # arguments take, for about one more region forward per region in the backward.
        return [type(self)(keep_every) for keep_every in _AUTO_KEEP_EVERY]

    def run(self, step: Step, store: Store | Meter | None) -> None:
        meter = store if isinstance(store, Meter) else None
        regions = SegmentedRegions(step, choose_regions(step.model, weigh=False), self.keep_every, meter)

        def before_backward() -> None:
            problem = regions.changed()
            if problem is not None:
                raise RegionStateChanged(f"the segments schedule runs a region's forward again in the backward, but "
                                         f"in the forward {problem}: its recomputation would not be exact")
            if meter is not None:  # "auto": the backward recomputes a region for one micro-batch at a time
                meter.reserve_bytes(regions.backward_bytes)

        with regions.patched():
            try:
                lockstep(step, store, before_backward=before_backward, segments=regions)
            finally:
                regions.close()
