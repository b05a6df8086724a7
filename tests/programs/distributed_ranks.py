"""One rank of a two-rank run on gloo, started by tests/engine/test_distributed.py with torchrun's environment.

    python tests/programs/distributed_ranks.py SCENARIO OUT

with PG_TIMEOUT_S, the process group's timeout in seconds, in the environment too. SCENARIO exact: the
Trainer on `ranks_net` (converted) over each of SCENARIOS' batches, micro-batches of MICRO; each rank's losses
and final state go to OUT/<scenario>-<rank>.pt; then a checkpoint's resume, to OUT/resume-<rank>.pt, and the
error of a batch too small to shard, to OUT/shard-error-<rank>.txt. SCENARIO raise or stall: rank 1 raises
or stalls at step 3 of 5; a rank that gets through all 5 touches OUT/finished-<rank>.
"""
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn as nn

import accumnorm
from accumnorm import Trainer, distributed
from helpers import ce_loss
from models import ranks_batches, ranks_net, ranks_sgd

MICRO = 2  # micro-batch 2 x 4 accumulation x 2 ranks = one batch of 16
SCENARIOS = {"even": [16, 16, 16, 16], "uneven": [16, 16, 11], "ddp_wrapped": [16, 16, 16]}


def main(scenario: str, out: Path) -> None:
    env = distributed.init_from_env(timeout=timedelta(seconds=float(os.environ["PG_TIMEOUT_S"])))
    if scenario == "exact":
        for name, sizes in SCENARIOS.items():
            model = accumnorm.convert(ranks_net())
            if name == "ddp_wrapped":
                model = nn.parallel.DistributedDataParallel(model)
            trainer = Trainer(model, ranks_sgd(model), ce_loss, micro_batch_size=MICRO)
            losses = [trainer.step(distributed.shard(b)) for b in ranks_batches(sizes)]
            torch.save({"losses": losses, "state": trainer.model.state_dict()}, out / f"{name}-{env.rank}.pt")
        resume(env.rank, out)
        try:
            distributed.shard(torch.zeros(1, 3))
        except ValueError as e:
            (out / f"shard-error-{env.rank}.txt").write_text(str(e))
    elif scenario in ("raise", "stall"):
        model = accumnorm.convert(ranks_net())
        trainer = Trainer(model, ranks_sgd(model), ce_loss, micro_batch_size=MICRO)

        def failing_loss(model, batch):
            if env.rank == 1 and trainer.step_count == 2:
                if scenario == "stall":  # alive, but never joins the step's collectives again
                    time.sleep(600)
                raise RuntimeError("rank 1 fails at step 3")
            return ce_loss(model, batch)

        trainer.loss_fn = failing_loss
        for b in ranks_batches([16] * 5):
            trainer.step(distributed.shard(b))
        (out / f"finished-{env.rank}").touch()
    torch.distributed.barrier()  # every rank at teardown together: gloo may abort a rank whose peers have gone
    torch.distributed.destroy_process_group()


def resume(rank: int, out: Path) -> None:
    """2 steps, save, 2 more; against a fresh trainer loaded from the checkpoint, 2 more. Each rank
    draws its own dropout masks, so each must get its own RNG state back."""
    def dropout_net() -> nn.Module:
        return accumnorm.convert(nn.Sequential(ranks_net(), nn.Dropout(0.5)))

    model = dropout_net()
    trainer = Trainer(model, ranks_sgd(model), ce_loss, micro_batch_size=MICRO)
    torch.manual_seed(100 + rank)
    data = [distributed.shard(b) for b in ranks_batches([16] * 4)]
    for b in data[:2]:
        trainer.step(b)
    trainer.save(out / "checkpoint.pt")
    straight = [trainer.step(b) for b in data[2:]], model.state_dict()
    model = dropout_net()
    torch.manual_seed(7)  # whatever the RNG holds now, the checkpoint's comes back
    trainer = Trainer.load(out / "checkpoint.pt", model, ranks_sgd(model), ce_loss)
    resumed = [trainer.step(b) for b in data[2:]], model.state_dict()
    torch.save({"straight": straight, "resumed": resumed}, out / f"resume-{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
