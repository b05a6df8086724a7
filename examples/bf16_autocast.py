"""Train the study's convnet on MNIST in bfloat16 autocast, with BatchNorm exact under gradient accumulation.

    python examples/bf16_autocast.py --steps 100 --batch-size 64 --micro-batch-size 8

`accumnorm.backward` runs inside `torch.autocast`: convolutions and matmuls run in bfloat16 while the
BatchNorm statistics and backward sums of the whole batch are kept in float32. bfloat16 has float32's
range, so no GradScaler is needed (float16 on CUDA would need one: pass `grad_scaler=` to backward).
Works on a CPU and on a GPU.
"""
import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

import accumnorm
from accumnorm.study import SimpleModel, load_dataset

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist-mini"  # beside the project

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--data", default=str(DATA), help="MNIST root (torchvision layout)")
p.add_argument("--batch-size", type=int, default=64, help="samples per optimizer step")
p.add_argument("--micro-batch-size", type=int, default=8, help="samples per forward/backward")
p.add_argument("--steps", type=int, default=100)
p.add_argument("--val-samples", type=int, default=2000)
args = p.parse_args()
torch.manual_seed(0)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

data = load_dataset("mnist", args.data).to(device)
model = SimpleModel(torch.nn.BatchNorm2d, channels=(16, 32, 64)).to(device)  # torch's BatchNorm, as it is
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)


def loss_fn(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


model.train()
for step in range(1, args.steps + 1):
    i = torch.randint(len(data.train_y), (args.batch_size,), device=device)
    optimizer.zero_grad()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = accumnorm.backward(model, (data.train_x[i], data.train_y[i]), loss_fn,
                                  micro_batch_size=args.micro_batch_size)
    optimizer.step()  # parameters and their gradients stay float32: autocast only lowers the operations
    if step % 10 == 0 or step == args.steps:
        print(f"step {step}: loss {loss.item():.4f}")

model.eval()
with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
    x, y = data.valid_x[:args.val_samples], data.valid_y[:args.val_samples]
    accuracy = (model(x).argmax(1) == y).float().mean().item()
print(f"final val_acc {accuracy:.4f} on {len(y)} digits after {args.steps} steps")
