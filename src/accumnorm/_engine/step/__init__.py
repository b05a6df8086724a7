"""Layer `step`: one `accumnorm.backward` call as a schedule runs it.

`step`: the `Step` (micro-batches, objective, its mode, refusals of what its forwards may not do); `lifecycle`:
the step run as a transaction, committed or undone, and what the process holds while it runs; `meeting`:
the round protocol, K pieces of a BatchNorm call made one call of the whole batch, and `sameness`, its check;
`ledger`: the calls counted and their one running-statistics update; `running`: running statistics as a
forward that runs several times finds them; `objective`: what the step minimizes and the losses it returns;
`outputs`: a whole-batch loss's outputs put together and their gradients handed back.

Imports: the layers below (`bn`, `safety`, `memory`, `intercept`, `checkpointing`).
"""
