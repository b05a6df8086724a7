"""A Lightning model with BatchNorm exact under gradient accumulation: three changed lines, marked below.

    python examples/lightning_mnist.py --steps 100 --batch-size 64 --micro-batch-size 8
    python examples/lightning_mnist.py --precision bf16-mixed --devices 2 --strategy ddp   # 2 processes

The DataLoader yields the batch of one optimizer step (per device); ExactAccumulation runs it through
`accumnorm.backward` --micro-batch-size samples at a time, and Lightning does the rest: precision,
gradient clipping, the optimizer step, checkpoints, logging, DDP. Not `accumulate_grad_batches`: it
would normalize each batch with its own statistics, so set-up refuses it.
"""
import argparse
import logging
import warnings
from pathlib import Path

import lightning.pytorch as L
import torch
import torch.nn.functional as F

from accumnorm.integrations.lightning import ExactAccumulation
from accumnorm.study import SimpleModel, load_dataset

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist-mini"  # beside the project

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--data", default=str(DATA), help="MNIST root (torchvision layout)")
p.add_argument("--batch-size", type=int, default=64, help="samples per optimizer step and device")
p.add_argument("--micro-batch-size", type=int, default=8, help="samples per forward/backward")
p.add_argument("--steps", type=int, default=100)
p.add_argument("--val-samples", type=int, default=2000)
p.add_argument("--precision", default="32-true", help="Lightning's: 32-true, bf16-mixed, 16-mixed (CUDA), ...")
p.add_argument("--devices", type=int, default=1)
p.add_argument("--strategy", default="auto", help="auto (one device) or ddp")
args = p.parse_args()


class Classifier(ExactAccumulation, L.LightningModule):  # changed: + ExactAccumulation
    def __init__(self, micro_batch_size: int) -> None:
        super().__init__(micro_batch_size=micro_batch_size)  # changed: + micro_batch_size
        self.net = SimpleModel(torch.nn.BatchNorm2d, channels=(16, 32, 64))  # torch's BatchNorm, as it is

    def training_loss(self, batch) -> torch.Tensor:  # changed: was training_step, the mean loss of a micro-batch
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:  # optional: to log the whole batch's loss
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


# Quiet: Lightning's notes (devices found, tips for its cloud services) and the deprecation warning of torch 2.14 that
# Lightning's own tree utilities trigger; Lightning's warnings about this script still show.
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
L.seed_everything(0, verbose=False)
data = load_dataset("mnist", args.data)
train = torch.utils.data.TensorDataset(data.train_x, data.train_y)
val = torch.utils.data.TensorDataset(data.valid_x[:args.val_samples], data.valid_y[:args.val_samples])
trainer = L.Trainer(max_steps=args.steps, precision=args.precision, devices=args.devices, strategy=args.strategy,
                    gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_model_summary=False,
                    enable_progress_bar=False, num_sanity_val_steps=0)
model = Classifier(args.micro_batch_size)
val_loader = torch.utils.data.DataLoader(val, batch_size=500)
trainer.fit(model, torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True), val_loader)
result = trainer.validate(model, val_loader, verbose=False)[0]  # at the end (and at each epoch's end in fit)
if trainer.is_global_zero:
    print(f"final val_acc {result['val_acc']:.4f} on {len(val)} digits after {trainer.global_step} steps")
if torch.distributed.is_initialized():  # --strategy ddp: Lightning leaves the group up; end it before exit
    torch.distributed.barrier()  # every rank at teardown together: gloo may abort a rank whose peers have gone
    torch.distributed.destroy_process_group()
