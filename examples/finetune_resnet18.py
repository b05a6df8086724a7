"""Fine-tune a torchvision ResNet-18 on MNIST digits with BatchNorm that is exact under gradient accumulation.

    python examples/finetune_resnet18.py                                      # random init, all layers train
    python examples/finetune_resnet18.py --weights resnet18.pth --freeze-backbone --bn-eval

Each optimizer step takes a batch of --batch-size through the net --micro-batch-size samples at a time,
and sees the gradient, and the BatchNorm statistics, of the whole batch. --weights loads a state dict of
torchvision's resnet18 from a local file (e.g. saved from resnet18(weights="IMAGENET1K_V1")); nothing
is downloaded, and without it the net starts from random weights. --freeze-backbone trains the new
10-class head only; --bn-eval keeps the BatchNorm layers in eval mode, normalizing with their running
statistics (the usual choice when fine-tuning with small batches; accumulation is then exact as it is).
Digits from --data (torchvision's MNIST layout) are resized to 32x32 and repeated over 3 channels.
"""
import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision

import accumnorm
from accumnorm.study import load_dataset

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist-mini"  # beside the project

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--data", default=str(DATA), help="MNIST root (torchvision layout)")
p.add_argument("--weights", help="a resnet18 state dict file; random initialization when not given")
p.add_argument("--freeze-backbone", action="store_true", help="train the new head only")
p.add_argument("--bn-eval", action="store_true", help="keep BatchNorm in eval mode (running statistics)")
p.add_argument("--batch-size", type=int, default=32, help="samples per optimizer step")
p.add_argument("--micro-batch-size", type=int, default=8, help="samples per forward/backward")
p.add_argument("--steps", type=int, default=30)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--val-samples", type=int, default=500)
args = p.parse_args()
torch.manual_seed(0)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

model = torchvision.models.resnet18()
if args.weights:
    model.load_state_dict(torch.load(args.weights, map_location="cpu", weights_only=True))
if args.freeze_backbone:
    model.requires_grad_(False)
model.fc = torch.nn.Linear(model.fc.in_features, 10)  # a new head, trainable either way
model = model.to(device)  # torch's BatchNorm layers as they are: accumnorm.backward makes every BN call exact

data = load_dataset("mnist", args.data)
optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=args.lr)


def images(x: torch.Tensor) -> torch.Tensor:
    """28x28 grey digits as the 32x32 RGB images the net takes."""
    return F.interpolate(x, size=32, mode="bilinear").expand(-1, 3, -1, -1).to(device)


def loss_fn(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


for step in range(1, args.steps + 1):
    model.train()
    if args.bn_eval:
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.eval()
    i = torch.randint(len(data.train_y), (args.batch_size,))
    optimizer.zero_grad()
    loss = accumnorm.backward(model, (images(data.train_x[i]), data.train_y[i].to(device)), loss_fn,
                              micro_batch_size=args.micro_batch_size)
    optimizer.step()
    print(f"step {step}: loss {loss.item():.4f}")

model.eval()
with torch.no_grad():
    x, y = data.valid_x[:args.val_samples], data.valid_y[:args.val_samples].to(device)
    correct = sum((model(images(xb)).argmax(1) == yb).sum().item() for xb, yb in zip(x.split(256), y.split(256)))
print(f"final val_acc {correct / len(y):.4f} on {len(y)} digits after {args.steps} steps")
