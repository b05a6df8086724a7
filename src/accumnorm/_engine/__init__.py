"""The engine behind `accumnorm.backward`, in layers, each importing only from the layers below it:

1. `bn`: the whole-batch BatchNorm maths (every formula once), knowing nothing of who calls it.
2. `safety`: the step as a transaction, random streams, Ctrl-C, torch's thread state, the graph check.
3. `memory`: the memory budget, where saved tensors are kept, and the figures "auto" judges by.
4. `intercept`: the TorchFunctionMode that finds every batch-statistics norm call; the refusals of what it cannot.
5. `checkpointing`: BatchNorm inside checkpointed regions, and the recompute schedule's own regions.
6. `step`: one call as a schedule runs it, inside its transaction: the meeting of the micro-batches, the
   running-statistics ledger, losses.
7. `schedules`: plain, layerwise, recompute, segments and passes behind one interface; the one module that
   chooses.
8. This package's modules: `backward` (the public function), `args` (its
   arguments, the batch cut into micro-batches) and `lazy_eps` (a warning for `nn.LazyBatchNorm2d(32)`).

One BatchNorm call of the layerwise schedule, top to bottom: `intercept.forwards` (the layer's forward) →
`intercept.calls.NormCalls.batch_norm` → `schedules.layerwise` (the micro-batch pauses) → `step.meeting.meet`
(the K pieces checked by `step.sameness`) → `bn.whole` or, inside checkpointed regions, `bn.pieces` (across
ranks, `bn.ranks`) → back in each micro-batch, `checkpointing.recorded` notes the call for its region's
recomputation, which `bn.replay` gives again in the backward. docs/how-it-works.md says more.
"""
