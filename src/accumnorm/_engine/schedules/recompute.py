"""The recompute schedule: layerwise, with the model's forward cut into checkpointed regions.

Layerwise keeps every micro-batch's graph until the one backward: the saved tensors of the whole batch. Here, for
the length of the step, chosen modules ("regions", `checkpointing.regions`) run their forward checkpointed
(`checkpointing.checkpointed`, in frames of `checkpointing.recomputation`), which keeps only the region's inputs and
recomputes the rest when the backward reaches it. `checkpointing.recorded` makes each recomputation exact (the
forward's whole-batch BatchNorm outputs again, no running-statistics update), and `bn.pieces` keeps each BatchNorm
input in its region's place. The step then holds the regions' inputs of the whole batch, what runs outside regions,
and, during the backward, one region's recomputed tensors for all K micro-batches at once (a met BatchNorm call's
backward needs every piece); it runs the regions' forwards twice, but for the costliest convolutions, whose outputs
the regions keep instead (`checkpointing.kept`: few bytes for much work).

A step whose forward changed a region's state is refused before its backward (`RegionStateChanged`), so that the
step can start over under layerwise.
"""
from __future__ import annotations

from typing import Any

from ..checkpointing.checkpointed import RegionState, RegionStateChanged, checkpointed
from ..checkpointing.handoff import Handoffs
from ..checkpointing.regions import Region, choose_regions, keep_allowance, largest_saved
from ..memory.budget import Meter
from ..memory.store import Store
from ..step.step import Step
from .base import Schedule
from .layerwise import lockstep

__all__ = ["Recompute"]


class Recompute(Schedule):
    """Exact BatchNorm in lockstep with checkpointed regions (module doc).

    Raises RegionStateChanged, before any backward, if a region's forward changed its module's state; under a
    `Meter` ("auto"), OverBudget if the backward's recomputation would pass the budget.
    """

    name = "recompute"
    remeasured = True  # its regions and kept outputs follow the last step's measurements

    def run(self, step: Step, store: Store | Meter | None) -> None:
        regions = choose_regions(step.model)
        step.regions.keep_convolutions(step.modules, keep_allowance(regions), len(step.micro_batches))

        def called(frame: Any, region: Region) -> None:  # a region's call in a forward, once `state` is taken
            step.regions.own(frame)
            state.called(region)

        handoffs = Handoffs()
        with checkpointed(regions, called, handoffs, lambda: step.rng.shared_states()[0]):
            # with the regions' forwards patched in, as the forwards will find them
            state = RegionState(regions, step.ledger.changed_statistics)

            def before_backward() -> None:
                step.regions.kept.seal()
                handoffs.settle()
                problem = state.changed(step.names)
                if problem is not None:
                    raise RegionStateChanged(f"the recompute schedule runs a region's forward again in the backward, "
                                             f"but in the forward {problem}: its recomputation would not be exact")
                if isinstance(store, Meter):  # "auto": the backward recomputes a region for every micro-batch at once
                    step.regions.count_records(store)
                    store.reserve(largest_saved(regions))

            try:
                lockstep(step, store, before_backward=before_backward)
            finally:
                state.close()
                handoffs.close()
