"""Layer `memory`: what a step may keep, where it keeps it, and what each schedule was measured to need.

`budget`: `memory_budget=`, the `Meter` of saved tensors, the per-model figures and `last_schedule`; `store`:
where the layerwise schedule keeps the whole batch's saved tensors (pinned host memory on CUDA); `heap`: the C
heap's free memory handed back to the OS where a CPU step lets go of a region or nears its budget; `objects`: the
bytes of the Python records a checkpointing schedule keeps beside its tensors, which the meter counts too.

Imports: torch and `accumnorm._dist`; no other layer of the engine.
"""
