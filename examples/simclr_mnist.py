"""SimCLR on MNIST with exact gradient accumulation: the batch's contrastive loss and BatchNorm, in micro-batches.

    python examples/simclr_mnist.py --steps 300 --batch-size 64 --micro-batch-size 8

NT-Xent couples every sample of a batch: each view's negatives are all the other views of the batch. Plain
accumulation would take it over each micro-batch alone (2b - 2 negatives instead of 2B - 2) and BatchNorm would
normalize each micro-batch alone. The whole-batch form of `accumnorm.backward` runs the model one micro-batch at
a time (`forward_fn`: both views of the micro-batch in one forward, so BatchNorm sees all of them), puts the
micro-batches' projections together and takes NT-Xent once over them (`batch_loss_fn`): the gradient of one
forward/backward of the whole batch, BatchNorm included. The encoder, views, loss and linear probe are those of
`accumnorm study --task simclr` (`accumnorm.study`), where docs/study/simclr.md compares the methods.
"""
import argparse
from pathlib import Path

import torch

import accumnorm
from accumnorm.study import Dataset, SimCLRNet, linear_probe, load_dataset, nt_xent, project, two_views

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist-mini"  # beside the project

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--data", default=str(DATA), help="MNIST root (torchvision layout)")
p.add_argument("--batch-size", type=int, default=64, help="images per optimizer step (two views each)")
p.add_argument("--micro-batch-size", type=int, default=8, help="images per forward/backward")
p.add_argument("--steps", type=int, default=300)
p.add_argument("--temperature", type=float, default=0.5, help="NT-Xent's temperature")
p.add_argument("--val-samples", type=int, default=2000, help="validation digits the linear probe is scored on")
args = p.parse_args()
torch.manual_seed(0)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

data = load_dataset("mnist", args.data).to(device)
model = SimCLRNet("bn").to(device)  # torch's BatchNorm, as it is
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
views = torch.Generator().manual_seed(0)  # the augmentations' random numbers


def batch_loss(projections: tuple[torch.Tensor, torch.Tensor], targets: None) -> torch.Tensor:
    return nt_xent(*projections, args.temperature)  # over every view of the whole batch


model.train()
for step in range(1, args.steps + 1):
    images = data.train_x[torch.randint(len(data.train_x), (args.batch_size,), device=device)]
    optimizer.zero_grad()
    loss = accumnorm.backward(model, two_views(images, views), micro_batch_size=args.micro_batch_size,
                              forward_fn=project, batch_loss_fn=batch_loss)
    optimizer.step()
    if step % 50 == 0 or step == args.steps:
        print(f"step {step}: NT-Xent {loss.item():.4f}")

# The representation's quality: a linear classifier on the frozen encoder's features of the training digits.
probe = Dataset(data.train_x, data.train_y, data.valid_x[:args.val_samples], data.valid_y[:args.val_samples])
accuracy = linear_probe(model.encoder, probe)
print(f"final val_acc {accuracy:.4f} on {args.val_samples} digits (linear probe) after {args.steps} steps")
