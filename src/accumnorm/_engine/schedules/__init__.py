"""Layer `schedules`: the ways to run a step, behind one interface, and the one place that chooses.

`base`: `Schedule.run(step, store)`; `plain`, `layerwise`, `recompute`, `segments`, `passes`: the schedules;
`registry`: the one table of them, in "auto"'s order; `decide`: which one runs a step (asked for, "auto", fallbacks).

Imports: every layer below.
"""
