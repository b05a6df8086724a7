"""An Accelerate training loop with BatchNorm exact under gradient accumulation: two changed lines, marked below.

    python examples/accelerate_mnist.py --steps 100 --batch-size 64 --micro-batch-size 8
    torchrun --nproc_per_node 2 examples/accelerate_mnist.py --mixed-precision bf16    # 2 processes

Each batch the prepared loader yields (per process) is the batch of one optimizer step; ExactAccumulator
runs it through `accumnorm.backward` --micro-batch-size samples at a time. The Accelerator does the rest:
device placement, mixed precision (and its GradScaler under fp16 on CUDA), the DDP process group,
clip_grad_norm_, checkpoints with save_state. Not `gradient_accumulation_steps`: it would normalize each
batch with its own statistics, so ExactAccumulator refuses it.
"""
import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator

from accumnorm.integrations.accelerate import ExactAccumulator
from accumnorm.study import SimpleModel, load_dataset

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist-mini"  # beside the project

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--data", default=str(DATA), help="MNIST root (torchvision layout)")
p.add_argument("--batch-size", type=int, default=64, help="samples per optimizer step and process")
p.add_argument("--micro-batch-size", type=int, default=8, help="samples per forward/backward")
p.add_argument("--steps", type=int, default=100)
p.add_argument("--val-samples", type=int, default=2000)
p.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
p.add_argument("--checkpoint", help="a directory for accelerator.save_state at the end")
args = p.parse_args()
torch.manual_seed(0)  # the same initial weights on every process

# cpu=True without a GPU: Accelerate then treats torchrun's processes as one multi-CPU (gloo) run; without
# it, each process on a GPU-less machine would train alone.
accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=args.mixed_precision)
data = load_dataset("mnist", args.data)
train = torch.utils.data.TensorDataset(data.train_x, data.train_y)
val = torch.utils.data.TensorDataset(data.valid_x[:args.val_samples], data.valid_y[:args.val_samples])
model = SimpleModel(torch.nn.BatchNorm2d, channels=(16, 32, 64))  # torch's BatchNorm, as it is
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
model, optimizer, train_loader, val_loader = accelerator.prepare(
    model, optimizer, torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True),
    torch.utils.data.DataLoader(val, batch_size=500))


def loss_fn(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


exact = ExactAccumulator(accelerator, model, optimizer, loss_fn, micro_batch_size=args.micro_batch_size)  # changed: +
accelerator.register_for_checkpointing(exact)  # + save_state keeps what a bit-identical resume under recompute needs


def batches():
    while True:  # epoch after epoch (the prepared loader reshuffles each)
        yield from train_loader


model.train()
for step, batch in zip(range(1, args.steps + 1), batches()):
    optimizer.zero_grad()
    loss = exact.backward(batch)  # changed: was accelerator.backward(loss_fn(model, batch))
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    if step % 10 == 0 or step == args.steps:
        accelerator.print(f"step {step}: loss {loss.item():.4f}")
if args.checkpoint:
    accelerator.save_state(args.checkpoint)

model.eval()
correct = total = 0
with torch.no_grad():
    for x, y in val_loader:
        hits = accelerator.gather_for_metrics(model(x).argmax(1) == y)
        correct, total = correct + hits.sum().item(), total + len(hits)
accelerator.print(f"final val_acc {correct / total:.4f} on {total} digits after {args.steps} steps")
accelerator.wait_for_everyone()  # every rank at teardown together: gloo may abort a rank whose peers have gone
accelerator.end_training()  # destroys the process group of a multi-process run before the interpreter exits
