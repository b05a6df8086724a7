"""Train the study's convnet on MNIST with BatchNorm that is exact across ranks and micro-batches.

    torchrun --nproc_per_node 2 examples/ddp.py      # 2 ranks: gloo on CPU, nccl on GPUs
    python examples/ddp.py                           # one process: the same run, step for step

Every rank loads the same global batch and trains on its shard, K micro-batches of --micro-batch-size
each, and one optimizer step sees exactly what one process with the whole global batch would see,
BatchNorm statistics included. Reads MNIST from --data (torchvision's raw layout) and falls back to
random synthetic digits when it is not there. Run it again with the same --out to resume.
"""
import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from accumnorm import Trainer, distributed

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist-mini"  # beside the project

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--data", default=str(DATA), help="MNIST root (torchvision layout)")
p.add_argument("--batch-size", type=int, default=64, help="global batch per optimizer step, all ranks together")
p.add_argument("--micro-batch-size", type=int, default=8)
p.add_argument("--steps", type=int, default=60)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--eval-every", type=int, default=20)
p.add_argument("--amp", choices=["bf16", "fp16"], default=None)
p.add_argument("--out", default="runs/ddp", help="config, metrics, TensorBoard events and checkpoint.pt")
args = p.parse_args()

env = distributed.init_from_env()  # reads torchrun's RANK/WORLD_SIZE; one process without them
torch.manual_seed(0)  # the same seed on every rank: the same initial weights and the same global batches


def load(train: bool) -> torch.utils.data.TensorDataset:
    root = Path(args.data)
    if (root / "MNIST" / "raw").is_dir():
        from torchvision.datasets import MNIST
        ds = MNIST(root, train=train, download=False)
        x, y = ds.data, ds.targets
    else:  # no data: synthetic digits, so the script still runs anywhere
        g = torch.Generator().manual_seed(int(train))
        y = torch.randint(0, 10, (2000 if train else 500,), generator=g)
        x = (torch.rand(len(y), 28, 28, generator=g) * 64 + y[:, None, None] * 19).to(torch.uint8)
    # the whole set as one tensor: no per-sample PIL decoding in the training loop
    return torch.utils.data.TensorDataset(((x.float() / 255 - 0.1307) / 0.3081).unsqueeze(1), y)


train_set, val_set = load(train=True), load(train=False)
if env.rank == 0:
    print(f"data: {len(train_set)} train / {len(val_set)} val samples from "
          f"{args.data if (Path(args.data) / 'MNIST' / 'raw').is_dir() else 'synthetic digits'}")
loader = distributed.ShardedLoader(
    torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, shuffle=True))


def conv_net(channels=(32, 64, 128, 256)) -> nn.Module:
    """The study's SimpleModel with BatchNorm: conv-BN-ReLU blocks, max-pool between, global pool, linear."""
    layers, prev = [], 1
    for i, c in enumerate(channels):
        # no conv bias: BatchNorm right after subtracts it again (its true gradient is 0, its computed one rounding)
        layers += [nn.Conv2d(prev, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()]
        layers += [nn.MaxPool2d(2)] if i < len(channels) - 1 else []
        prev = c
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(prev, 10))


model = conv_net().to(env.device)  # torch's own BatchNorm: the Trainer makes it exact, no conversion
optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def evaluate(model: nn.Module) -> dict[str, float]:
    """Accuracy on the validation set, each rank scoring its shard."""
    x, y = (t.to(env.device) for t in distributed.shard(val_set.tensors))
    correct = torch.stack([(model(x).argmax(1) == y).sum(), torch.tensor(len(y), device=env.device)]).float()
    if dist.is_initialized():
        dist.all_reduce(correct)
    return {"val_acc": (correct[0] / correct[1]).item()}


checkpoint = Path(args.out) / "checkpoint.pt"
kwargs = dict(scheduler=scheduler, max_grad_norm=1.0)
if checkpoint.exists():  # resume: the next step trains on the very batch the stopped run would have
    trainer = Trainer.load(checkpoint, model, optimizer, loss_fn, **kwargs)
else:
    trainer = Trainer(model, optimizer, loss_fn, micro_batch_size=args.micro_batch_size,
                                amp=args.amp, **kwargs)
final = trainer.fit(loader, steps=args.steps, eval_fn=evaluate, eval_every=args.eval_every, log=args.out,
                    checkpoint_every=args.eval_every)
if env.rank == 0:
    print(f"step {trainer.step_count}: " + ", ".join(f"{k} {v:.4g}" for k, v in final.items()))
if dist.is_initialized():
    dist.barrier()  # every rank at teardown together: gloo may abort a rank whose peers have already gone
    dist.destroy_process_group()
