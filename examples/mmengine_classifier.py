"""An mmengine Runner training a BatchNorm classifier with BatchNorm exact under gradient accumulation: config only.

    python examples/mmengine_classifier.py --steps 100 --batch-size 64 --micro-batch-size 8

The config below is what an OpenMMLab user writes; the accumnorm lines are marked. train_dataloader's batch_size
is the batch of one optimizer step, and the loop runs it through `accumnorm.backward` --micro-batch-size digits at
a time, every BatchNorm layer normalizing with the statistics of the whole batch (not optim_wrapper's
accumulative_counts: it normalizes each small batch alone, so the loop refuses it). With --count-normalized the
loss divides by a count over the whole batch (as detection heads divide by their positives) and goes through the
whole-batch form: the model's `loss_by_feat` once over the whole batch's logits.
"""
import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from mmengine.config import Config
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, MODELS
from mmengine.runner import Runner
from mmengine.structures import BaseDataElement
from mmengine.utils import import_modules_from_strings

from accumnorm.study import SimpleModel, load_dataset

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist-mini"  # beside the project

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--data", default=str(DATA), help="MNIST root (torchvision layout)")
p.add_argument("--batch-size", type=int, default=64, help="samples per optimizer step (per GPU)")
p.add_argument("--micro-batch-size", type=int, default=8, help="samples per forward/backward")
p.add_argument("--steps", type=int, default=100)
p.add_argument("--val-samples", type=int, default=2000)
p.add_argument("--count-normalized", action="store_true", help="a loss divided by a count over the whole batch")
p.add_argument("--work-dir", default="mmengine_classifier")
args = p.parse_args()


@DATASETS.register_module()
class MnistDigits(torch.utils.data.Dataset):
    """MNIST as mmengine's datasets give it: inputs, and a data sample holding the label."""

    metainfo = dict(classes=tuple("0123456789"))

    def __init__(self, root: str) -> None:
        data = load_dataset("mnist", root)
        self.x, self.y = data.train_x, data.train_y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"inputs": self.x[i], "data_samples": BaseDataElement(gt_label=self.y[i])}


@MODELS.register_module()
class DigitClassifier(BaseModel):
    """The study's VGG-like net with torch's BatchNorm2d: loss mode gives mmengine's dict of losses."""

    def __init__(self, count_normalized: bool = False) -> None:
        super().__init__()
        self.net = SimpleModel(torch.nn.BatchNorm2d, channels=(16, 32, 64))
        self.count_normalized = count_normalized

    def forward(self, inputs, data_samples=None, mode: str = "tensor"):
        logits = self.net(inputs)
        return self.loss_by_feat(logits, data_samples) if mode == "loss" else logits

    def loss_by_feat(self, logits, data_samples) -> dict:
        """The losses of logits and their data samples; the whole batch's under whole_batch_loss=True."""
        labels = torch.stack([s.gt_label for s in data_samples]).to(logits.device)
        if not self.count_normalized:
            return {"loss_cls": F.cross_entropy(logits, labels)}
        even = labels % 2 == 0  # a count over the batch: only the even digits are scored
        summed = F.cross_entropy(logits, labels, reduction="none")[even].sum()
        return {"loss_cls": summed / even.sum().clamp(min=1)}


config = dict(
    custom_imports=dict(imports=["accumnorm.integrations.mmengine"], allow_failed_imports=False),  # accumnorm
    model=dict(type="DigitClassifier", count_normalized=args.count_normalized),
    work_dir=args.work_dir,
    train_dataloader=dict(dataset=dict(type="MnistDigits", root=args.data), batch_size=args.batch_size,
                          sampler=dict(type="DefaultSampler", shuffle=True), collate_fn=dict(type="default_collate")),
    train_cfg=dict(type="ExactIterBasedTrainLoop", micro_batch_size=args.micro_batch_size,  # accumnorm: type, size
                   whole_batch_loss=args.count_normalized, max_iters=args.steps),
    optim_wrapper=dict(optimizer=dict(type="Adam", lr=1e-3), clip_grad=dict(max_norm=1.0)),
    default_hooks=dict(logger=dict(type="LoggerHook", interval=max(args.steps // 5, 1)), checkpoint=None),
    randomness=dict(seed=0), log_level="WARNING",
)
import_modules_from_strings(**config["custom_imports"])  # what Config.fromfile does for a config file
runner = Runner.from_cfg(Config(config))
model = runner.train()

data = load_dataset("mnist", args.data)
model.eval()
with torch.no_grad():
    x, y = data.valid_x[:args.val_samples], data.valid_y[:args.val_samples]
    accuracy = (model(x).argmax(1) == y).float().mean().item()
print(f"final val_acc {accuracy:.4f} on {len(y)} digits after {runner.iter} steps")
