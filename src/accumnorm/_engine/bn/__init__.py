"""Layer `bn` (the lowest): the whole-batch BatchNorm maths, knowing nothing of who calls it.

`normalize`: every formula once (the scale, the input gradient from the two sums, the normalization with known
statistics) and the passes schedule's BatchNorm; `whole`: a met call on the concatenated pieces; `pieces`: a met
call whose pieces stay in their checkpointed regions; `ranks`: a met call across the ranks of a process group;
`replay`: a met call's output given again in a region's recomputation.

Imports: torch and `accumnorm.functional` only; no schedule, region or step.
"""
