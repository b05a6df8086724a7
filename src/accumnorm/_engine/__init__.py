"""The engine behind `accumnorm.backward`, one job per module, in the order a step runs them:

- `backward`: the public function: arguments, schedule, the step as a transaction.
- `args`: argument checks; the batch cut into micro-batches.
- `lazy_eps`: a warning, once per layer, for a norm whose eps is 1 or more (`nn.LazyBatchNorm2d(32)`).
- `transaction`: gradients and buffers set aside, merged on success, restored on any error.
- `rng`: each micro-batch's random stream; the caller's generators one draw on.
- `step`: one call's micro-batches and the round protocol: `Step.meet` checks that the K micro-batches are
  at the same BatchNorm call and makes it one call of the whole batch; `sameness`: that check.
- `whole`: that call: torch's own BatchNorm on the pieces, concatenated; each micro-batch gets its rows.
- `pieces`: that call inside checkpointed regions: each piece's input kept in its region's place, not the whole's.
- `joint`: that call across the ranks of a process group (SyncBatchNorm on any device).
- `calls`: the TorchFunctionMode that routes every batch-statistics norm call of a step to its schedule.
- `plain`, `lockstep` (the layerwise schedule: coroutines on the caller's thread), `recompute` (layerwise with the
  model's blocks in checkpointed regions), `passes`: the schedules; `regions`: which parts recompute checkpoints.
- `budget`, `auto`: what a step may keep and each schedule needs, measured; "auto"'s choice by memory.
- `choice`: which schedule runs a step (the one asked for, or "auto"'s), each try undone before the next.
- `threadstate`: torch's per-thread state, swapped as the coroutines take turns; `flags`: the process-wide flags
  swapped with it.
- `crossing`: the K graphs checked before their backward: no micro-batch uses another's tensors (Python state
  shared across a BatchNorm call), and no batch norm with batch statistics ran unseen.
- `checkpoint`: BatchNorm inside `torch.utils.checkpoint(use_reentrant=False)` regions.
- `store`: where the layerwise schedule keeps saved tensors.
- `costs`: the cost model of moving saved tensors to the host against recomputing them on the device.
"""
