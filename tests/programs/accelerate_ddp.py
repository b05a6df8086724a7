"""One process of a two-process Accelerate run on CPU (gloo), started by tests/integrations/test_accelerate.py.

    accelerate launch --cpu --num_processes 2 tests/programs/accelerate_ddp.py OUT CLIP

3 optimizer steps over global batches of 8, split 4 + 4 over the processes, each process's 4 as
micro-batches 3 + 1, in float64, the gradient clipped to norm CLIP; torch's BatchNorm layers as they are.
The batches this process was given and the final state of the net go to OUT/rank<process index>.pt;
before that, the error of an ExactAccumulator given the unwrapped net, to OUT/unwrapped-<index>.txt.
"""
import sys
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs

from accumnorm.integrations.accelerate import ExactAccumulator
from helpers import accelerate_steps, ce_loss, sgd_halving
from models import tiny_bn, tiny_dataset


def main(out: Path, clip: float) -> None:
    # split_batches: the loader's batches are global ones, cut in contiguous parts (and the scheduler steps once)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True),
                              kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=300))])
    net = tiny_bn()
    optimizer, scheduler = sgd_halving(net.parameters())
    loader = torch.utils.data.DataLoader(tiny_dataset(24), batch_size=8)
    model, optimizer, loader, scheduler = accelerator.prepare(net, optimizer, loader, scheduler)
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel), type(model)
    batches = list(loader)
    try:  # each process would train its own net: refused
        ExactAccumulator(accelerator, net, optimizer, ce_loss, micro_batch_size=3)
    except ValueError as err:
        (out / f"unwrapped-{accelerator.process_index}.txt").write_text(str(err))
    exact = ExactAccumulator(accelerator, model, optimizer, ce_loss, micro_batch_size=3)
    accelerate_steps(exact, accelerator, model, optimizer, scheduler, batches, clip)
    torch.save({"state": net.state_dict(), "batches": batches}, out / f"rank{accelerator.process_index}.pt")
    # without it, gloo's threads may still be running when the interpreter exits: the process aborts after its work
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]))
