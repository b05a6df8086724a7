"""Layer `checkpointing`: BatchNorm inside `torch.utils.checkpoint(use_reentrant=False)` regions, and the regions
the recompute schedule makes of a model.

`frames`: where a point stands against the regions (their forward, their recomputation); `recorded`: each region's
BatchNorm calls recorded in the forward, and its recomputation made to give their outputs again; `regions`: which
modules the recompute schedule checkpoints; `checkpointed`: their forwards checkpointed for a step, each call in a
frame of `recomputation`, the schedule's own checkpoint, run again by `rerun` and checked against the output the next
region kept (`handoff`) or a fingerprint (`again`); `kept`: the convolutions whose outputs the regions keep
instead of recomputing them; `measurements`: what the last steps measured of those choices, for a checkpoint;
`segmented`: the segments schedule's regions, met at their exits; `region_passes`:
their backward, one micro-batch at a time; `region_checks`: what each of its recomputations must be for it to be
exact.

Imports: the layers below (`bn`, `safety`, `memory`, `intercept`).
"""
