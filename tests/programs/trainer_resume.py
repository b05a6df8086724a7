"""One run of the Trainer's kill-and-resume test, started by tests/trainer/test_trainer.py in a fresh process.

    python tests/programs/trainer_resume.py MODE OUT

MODE full: 20 steps of `small_net` on `NoisyDigits`, a checkpoint every 5, the logs in OUT. killed: the same
run, SIGKILLed by itself inside step 12 (last checkpoint: step 10). resumed: load OUT/checkpoint.pt (a killed
run's) and fit to step 20. A run that ends saves the model, the optimizer and torch's RNG to OUT/final.pt.
"""
import os
import random
import signal
import sys
from pathlib import Path

import numpy as np
import torch

import accumnorm
from accumnorm import Trainer
from helpers import ce_loss
from models import NoisyDigits, small_net

RESUME_STEPS, CHECKPOINT_EVERY, KILL_IN_STEP = 20, 5, 12


def main(mode: str, out: Path) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model = accumnorm.convert(small_net())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
    loader = torch.utils.data.DataLoader(NoisyDigits(), batch_size=8, shuffle=True)  # 6 batches, the last of 4

    def maybe_killed(model, batch):
        if mode == "killed" and trainer.step_count == KILL_IN_STEP - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return ce_loss(model, batch)

    def eval_fn(model):  # draws from the RNG too, as a validation sampler might
        return torch.rand(()).item()

    kwargs = dict(scheduler=sched)
    if mode == "resumed":
        trainer = Trainer.load(out / "checkpoint.pt", model, opt, maybe_killed, **kwargs)
        assert trainer.step_count == 10
    else:
        trainer = Trainer(model, opt, maybe_killed, micro_batch_size=3, max_grad_norm=1.0, **kwargs)
    trainer.fit(loader, steps=RESUME_STEPS, eval_fn=eval_fn, eval_every=4, log=out, checkpoint_every=CHECKPOINT_EVERY)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": torch.get_rng_state()},
               out / "final.pt")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
