"""A Hugging Face ResNet trained by the Trainer with BatchNorm exact under gradient accumulation: one changed line.

    python examples/hf_trainer_resnet.py --steps 100 --batch-size 64 --micro-batch-size 8
    torchrun --nproc_per_node 2 examples/hf_trainer_resnet.py          # DDP: each process its share

`per_device_train_batch_size` is the micro-batch and `gradient_accumulation_steps` how many make a step, as
for the stock Trainer; ExactTrainer runs the micro-batches of each step through `accumnorm.backward` as one
whole batch, so BatchNorm normalizes with the statistics of all --batch-size digits. The model is built from
a config (nothing is downloaded).
"""
import argparse
import os
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from transformers import ResNetConfig, ResNetForImageClassification, TrainingArguments  # noqa: E402
from transformers.utils import logging  # noqa: E402

from accumnorm.integrations.transformers import ExactTrainer  # noqa: E402
from accumnorm.study import load_dataset  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist-mini"  # beside the project

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--data", default=str(DATA), help="MNIST root (torchvision layout)")
p.add_argument("--batch-size", type=int, default=64, help="samples per optimizer step and process")
p.add_argument("--micro-batch-size", type=int, default=8, help="samples per forward/backward; divides --batch-size")
p.add_argument("--steps", type=int, default=100)
p.add_argument("--val-samples", type=int, default=2000)
p.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
p.add_argument("--out", default="hf_trainer_resnet", help="the Trainer's output_dir")
args = p.parse_args()
if args.batch_size % args.micro_batch_size:
    p.error(f"--micro-batch-size {args.micro_batch_size} must divide --batch-size {args.batch_size}")


class Digits(torch.utils.data.Dataset):
    """MNIST as the Trainer's collator wants it: a dict per sample."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.x[i], "labels": self.y[i]}


logging.set_verbosity_error()
data = load_dataset("mnist", args.data)
config = ResNetConfig(num_channels=1, embedding_size=16, hidden_sizes=[16, 32, 64], depths=[1, 1, 1],
                      layer_type="basic", num_labels=10)
torch.manual_seed(0)
model = ResNetForImageClassification(config)  # torch's BatchNorm2d layers, as they are
training = TrainingArguments(
    args.out, per_device_train_batch_size=args.micro_batch_size,
    gradient_accumulation_steps=args.batch_size // args.micro_batch_size, max_steps=args.steps, learning_rate=1e-3,
    max_grad_norm=1.0, bf16=args.bf16, report_to="none", save_strategy="no", logging_steps=max(args.steps // 5, 1),
    disable_tqdm=True, use_cpu=not torch.cuda.is_available(), seed=0)
trainer = ExactTrainer(model=model, args=training, train_dataset=Digits(data.train_x, data.train_y))  # changed
trainer.train()

model.eval()
with torch.no_grad():
    x, y = data.valid_x[:args.val_samples].to(model.device), data.valid_y[:args.val_samples].to(model.device)
    accuracy = (model(pixel_values=x).logits.argmax(1) == y).float().mean().item()
if trainer.is_world_process_zero():
    print(f"final val_acc {accuracy:.4f} on {len(y)} digits after {trainer.state.global_step} steps")
