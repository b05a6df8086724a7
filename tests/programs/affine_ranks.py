"""One rank of a two-rank run on gloo, started by tests/engine/test_user_functions.py with torchrun's environment.

    python tests/programs/affine_ranks.py OUT [reads-running | uneven]

A net whose batch norms are direct `F.batch_norm` calls with a bias and no weight, and a weight and no bias
(or, with `reads-running`, a net that reads a BatchNorm's running statistics after its call): one
`accumnorm.backward` under the process group per exact schedule, on this rank's half of `affine_batch`;
the loss, every gradient and every buffer go to OUT/<schedule>-<rank>.pt. With `uneven`, four blocks (regions of
recompute and segments) on 6 samples on rank 0 and 2 on rank 1: 3 micro-batches and 1.
"""
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import accumnorm
from accumnorm import distributed
from helpers import EXACT_SCHEDULES, ce_loss
from models import affine_batch, affine_net, blocks_net, reads_running_net

NETS = {"affine": affine_net, "reads-running": reads_running_net, "uneven": blocks_net}


def main(out: Path, net: str) -> None:
    env = distributed.init_from_env(timeout=timedelta(seconds=60))
    x, y = affine_batch()
    ends = [0, 6, 8] if net == "uneven" else [len(x) * r // env.world_size for r in range(env.world_size + 1)]
    mine = (x[ends[env.rank]:ends[env.rank + 1]], y[ends[env.rank]:ends[env.rank + 1]])
    for schedule in EXACT_SCHEDULES:
        model = NETS[net]()
        loss = accumnorm.backward(model, mine, ce_loss, micro_batch_size=2, schedule=schedule,
                                  process_group=dist.group.WORLD)
        grads = {n: p.grad for n, p in model.named_parameters()}
        torch.save({"loss": loss, "grads": grads, "buffers": dict(model.named_buffers())},
                   out / f"{schedule}-{env.rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "affine")
