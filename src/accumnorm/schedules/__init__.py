"""How `accumnorm.backward` runs the micro-batches: plain accumulation, and the two exact schedules.

- `plain`: each micro-batch forward and backward in turn (`bn="micro"`).
- `layerwise`: the micro-batches in lockstep, meeting at every BatchNorm call; about the cost of plain
  accumulation, holding the whole batch's saved tensors in a store.
- `passes`: 2L + 1 passes over the micro-batches for L BatchNorm calls, recomputing instead of
  storing; memory of one micro-batch, cost linear in depth.
"""
from .graph import trace_safe
from .layerwise import cannot_run_reason, layerwise, resolve_store
from .passes import passes
from .step import LossFn, Step, plain

__all__ = ["Step", "LossFn", "plain", "layerwise", "passes", "cannot_run_reason", "resolve_store", "trace_safe"]
