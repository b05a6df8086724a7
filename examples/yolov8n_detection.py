"""Train YOLOv8n with ultralytics' own detection loss over the whole batch, in micro-batches, exactly.

    YOLO_OFFLINE=1 python examples/yolov8n_detection.py --steps 20 --batch-size 16 --micro-batch-size 4

ultralytics' loss is not a mean over images. `v8DetectionLoss` assigns ground-truth boxes to anchors, divides
the class and box losses by `target_scores_sum` (the assigned scores summed over the whole batch), and
multiplies by the batch size. Plain accumulation would divide each micro-batch by its own sum, weighting an
image with few objects like one with many, and BatchNorm would normalize each micro-batch alone. The whole-batch
form of `accumnorm.backward` runs the model one micro-batch at a time (`forward_fn`: the train-mode forward,
whose dict of maps has one row per image), puts the micro-batches' outputs together and takes ultralytics' loss
once over them (`batch_loss_fn`, with the batch's boxes as `targets`, never split): the gradient of one
forward/backward of the whole batch. The first step checks that against a whole-batch forward/backward of a
copy of the model, and against plain accumulation.

The data is synthetic (no download): filled rectangles of three colours, the colour is the class. YOLOv8n is
built from its yaml, without weights.
"""
import argparse
import copy
import os

os.environ.setdefault("YOLO_OFFLINE", "1")  # else ultralytics looks up DNS names when it is imported

import torch
from ultralytics.cfg import get_cfg
from ultralytics.nn.tasks import DetectionModel
from ultralytics.utils import LOGGER

import accumnorm

COLOURS = torch.tensor([[0.9, 0.1, 0.1], [0.1, 0.8, 0.1], [0.1, 0.2, 0.9]])  # class c is a rectangle of colour c

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--batch-size", type=int, default=16, help="images per optimizer step")
p.add_argument("--micro-batch-size", type=int, default=4, help="images per forward/backward")
p.add_argument("--steps", type=int, default=20)
p.add_argument("--imgsz", type=int, default=128, help="image side, a multiple of 32")
args = p.parse_args()
torch.manual_seed(0)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synthetic_batch(n: int, gen: torch.Generator) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """n grey images with 1 to 3 rectangles each, and their boxes in ultralytics' batch layout: one row per box,
    `batch_idx` its image, `cls` its class, `bboxes` its centre x, y, width, height as fractions of the image."""
    images = torch.full((n, 3, args.imgsz, args.imgsz), 0.5)
    index, classes, boxes = [], [], []
    for i in range(n):
        for _ in range(int(torch.randint(1, 4, (), generator=gen))):
            w, h = (torch.rand(2, generator=gen) * 0.3 + 0.15).tolist()
            x, y = (torch.rand(2, generator=gen) * torch.tensor([1 - w, 1 - h]) + torch.tensor([w, h]) / 2).tolist()
            c = int(torch.randint(len(COLOURS), (), generator=gen))
            x0, x1 = round((x - w / 2) * args.imgsz), round((x + w / 2) * args.imgsz)
            y0, y1 = round((y - h / 2) * args.imgsz), round((y + h / 2) * args.imgsz)
            images[i, :, y0:y1, x0:x1] = COLOURS[c, :, None, None]
            index.append(i), classes.append(c), boxes.append([x, y, w, h])
    targets = {"batch_idx": torch.tensor(index, dtype=torch.float32), "cls": torch.tensor(classes).float()[:, None],
               "bboxes": torch.tensor(boxes)}
    return images.to(device), {k: v.to(device) for k, v in targets.items()}


LOGGER.setLevel("WARNING")  # "Overriding model.yaml nc=80 with nc=3"
model = DetectionModel("yolov8n.yaml", nc=len(COLOURS), verbose=False).to(device).train()
model.args = get_cfg()  # ultralytics' default hyperparameters: the loss gains box 7.5, cls 0.5, dfl 1.5
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)


def forward(model: DetectionModel, images: torch.Tensor) -> dict:
    return model(images)  # in train mode: {"boxes", "scores", "feats"}, one row per image


def detection_loss(model: DetectionModel):
    """ultralytics' loss of a batch's predictions, as its trainer back-propagates it: the sum of the box, class and
    DFL terms (each times the batch size)."""
    return lambda preds, targets: model.loss(targets, preds)[0].sum()


def max_rel_diff(a: DetectionModel, b: DetectionModel) -> float:
    """The largest gradient difference of a against b, relative to b's largest gradient."""
    pairs = [(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()) if q.grad is not None]
    return max(float((g - h).abs().max()) for g, h in pairs) / max(float(h.abs().max()) for _, h in pairs)


gen = torch.Generator().manual_seed(0)
for step in range(1, args.steps + 1):
    images, targets = synthetic_batch(args.batch_size, gen)
    if step == 1:  # the oracle: one forward/backward of the whole batch, on copies; and plain accumulation
        whole, plain = copy.deepcopy(model), copy.deepcopy(model)
        detection_loss(whole)(whole(images), targets).backward()
        micro = args.micro_batch_size
        for i in range(0, args.batch_size, micro):  # each micro-batch its own loss, as ultralytics accumulates
            keep = (targets["batch_idx"] >= i) & (targets["batch_idx"] < i + micro)
            part = {k: v[keep] for k, v in targets.items()}
            part["batch_idx"] = part["batch_idx"] - i
            detection_loss(plain)(plain(images[i:i + micro]), part).backward()
    optimizer.zero_grad()
    loss = accumnorm.backward(model, images, micro_batch_size=args.micro_batch_size, forward_fn=forward,
                              batch_loss_fn=detection_loss(model), targets=targets)
    if step == 1:
        print(f"step 1 gradient against one whole-batch forward/backward (max relative difference): accumnorm "
              f"{max_rel_diff(model, whole):.1e}, plain accumulation {max_rel_diff(plain, whole):.1e}")
        del whole, plain
    optimizer.step()
    print(f"step {step}: loss {loss.item():.4f}")
print(f"final loss {loss.item():.4f} after {args.steps} steps of {args.batch_size} images "
      f"in micro-batches of {args.micro_batch_size}")
