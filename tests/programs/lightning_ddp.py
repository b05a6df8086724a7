"""One rank of a Lightning DDP run on gloo, started by tests/integrations/test_lightning.py with torchrun's environment.

    python tests/programs/lightning_ddp.py OUT CLIP

3 optimizer steps of micro-batches 3 + 1 of this rank's 4 samples out of each global batch of 8,
in float64, the gradient clipped to norm CLIP; torch's BatchNorm layers as they are, and the passes
schedule (the one-process test runs the default, layerwise), and a penalty added to the loss training_step
returns. The batches this rank was given (Lightning's own
DistributedSampler shuffles) and the final state of the net go to OUT/rank<rank>.pt.
"""
import sys
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy

from models import lit_classifier, small_penalty, tiny_bn, tiny_dataset


class Batches(pl.Callback):
    """Keeps the batches this rank trains on: the test joins the ranks' batches into the global ones."""

    def __init__(self) -> None:
        self.seen = []

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch, batch_idx: int) -> None:
        self.seen.append(batch)


def main(out: Path, clip: float) -> None:
    loader = torch.utils.data.DataLoader(tiny_dataset(24), batch_size=4)
    class Penalized(lit_classifier()):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx) + small_penalty(self)

    model = Penalized(tiny_bn(), micro_batch_size=3, schedule="passes")
    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=300))  # a lost rank fails, not hangs
    run = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="64-true", max_steps=3,
                     gradient_clip_val=clip, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, callbacks=[batches := Batches()])
    run.fit(model, loader)
    torch.save({"state": model.net.state_dict(), "steps": run.global_step, "batches": batches.seen},
               out / f"rank{run.global_rank}.pt")
    # Lightning leaves the process group up: without this, gloo's threads may still run at interpreter exit and
    # abort the process after its work is done
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]))
