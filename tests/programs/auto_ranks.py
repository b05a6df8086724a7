"""One rank of a two-rank run on gloo, started by tests/engine/test_schedules.py with torchrun's environment.

    python tests/programs/auto_ranks.py OUT BUDGET

Three steps of `accumnorm.backward(schedule="auto", memory_budget=BUDGET)` under the process group, on shards of
unequal size (7 samples on rank 0, 3 on rank 1), of one residual net: the ranks' needs differ, and the schedule
each step runs must be one and the same on both. Each step's loss, gradients and
schedule go to OUT/<step>-<rank>.pt.
"""
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import accumnorm
from accumnorm import distributed
from helpers import ce_loss
from models import residual_batch, residual_net


def main(out: Path, budget: int) -> None:
    env = distributed.init_from_env(timeout=timedelta(seconds=60))
    x, y = residual_batch()
    mine = slice(0, 7) if env.rank == 0 else slice(7, 10)
    model = residual_net()  # one model: auto's figures are its own; no optimizer step, so one gradient each step
    for step in range(3):
        model.zero_grad(set_to_none=True)
        loss = accumnorm.backward(model, (x[mine], y[mine]), ce_loss, micro_batch_size=2, memory_budget=budget,
                                  process_group=dist.group.WORLD)
        torch.save({"loss": loss, "grads": {n: p.grad for n, p in model.named_parameters()},
                    "schedule": accumnorm.last_schedule(model).schedule}, out / f"{step}-{env.rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
