"""accumnorm.integrations.ultralytics: YOLOv8n's own loss and BatchNorm over the whole batch, in micro-batches, in
ultralytics' own trainer, against the whole-batch oracle."""
import copy
import io
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import SCHEDULE_OPTIONS, assert_ran_with, rel_err

os.environ.setdefault("YOLO_OFFLINE", "1")  # else ultralytics looks up DNS names when it is imported
pytest.importorskip("ultralytics")
from ultralytics.cfg import get_cfg  # noqa: E402
from ultralytics.models.yolo.detect import DetectionTrainer  # noqa: E402
from ultralytics.nn.tasks import DetectionModel  # noqa: E402
from ultralytics.utils import LOGGER  # noqa: E402

from accumnorm.integrations.ultralytics import _check_trainer, exact_loss, exact_trainer  # noqa: E402


def _yolo() -> DetectionModel:
    level = LOGGER.level
    LOGGER.setLevel("WARNING")  # "Overriding model.yaml nc=80 with nc=3"
    try:
        model = DetectionModel("yolov8n.yaml", nc=3, verbose=False).train()
    finally:
        LOGGER.setLevel(level)
    model.args = get_cfg()  # the loss gains, as the trainer sets them
    return model


def _batch() -> dict:
    """4 images, boxes on three of them (image 2 has none, image 1 two): what the trainer hands its model."""
    return {"img": torch.rand(4, 3, 64, 64), "batch_idx": torch.tensor([0.0, 1, 1, 3]),
            "cls": torch.tensor([[0.0], [1], [2], [1]]),
            "bboxes": torch.tensor([[0.5, 0.5, 0.3, 0.3], [0.3, 0.3, 0.2, 0.4], [0.7, 0.6, 0.3, 0.3],
                                    [0.5, 0.5, 0.5, 0.5]])}


def _grads(model: torch.nn.Module) -> list:
    return [p.grad.clone() if p.grad is not None else None for p in model.parameters()]


def _worst(grads: list, want: list) -> float:
    scale = max(float(w.abs().max()) for w in want if w is not None)
    return max(rel_err(g, w, scale) for g, w in zip(grads, want) if w is not None)


def test_the_models_loss_is_the_whole_batch_in_micro_batches(one_thread):
    """model(batch), as the trainer calls it: the whole batch's gradient in .grad (running statistics too), the
    whole batch's loss and items returned, and the trainer's backward of that loss adds nothing."""
    torch.manual_seed(0)
    ref = _yolo()
    model = exact_loss(copy.deepcopy(ref), micro_batch_size=2)
    micro = exact_loss(copy.deepcopy(ref), micro_batch_size=2, bn="micro")
    batch = _batch()
    want, want_items = ref(batch)
    want.sum().backward()
    loss, items = model(batch)
    assert type(model).__name__ == "ExactDetectionModel" and isinstance(model, DetectionModel)
    assert rel_err(loss, want) < 1e-5 and items.keys() == want_items.keys()
    assert _worst(_grads(model), _grads(ref)) < 1e-4
    for (name, b), c in zip(ref.named_buffers(), model.buffers()):
        assert rel_err(c, b, 1e-3) < 1e-4, name
    before = _grads(model)
    loss.sum().backward()  # what the trainer does next: nothing reaches the model
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), before) if b is not None)
    micro(batch)  # the loss whole, BatchNorm per micro-batch: another gradient
    assert _worst(_grads(micro), _grads(ref)) > 1e-2


def test_validation_and_given_predictions_take_ultralytics_own_path(one_thread):
    torch.manual_seed(0)
    ref = _yolo()
    model = exact_loss(copy.deepcopy(ref), micro_batch_size=2)
    batch = _batch()
    loss, _ = model.loss(batch, model(batch["img"]))  # compile=True's path: the caller's whole-batch forward
    assert loss.grad_fn is not None and rel_err(loss, ref.loss(batch, ref(batch["img"]))[0]) < 1e-5
    assert all(p.grad is None for p in model.parameters())
    model.eval(), ref.eval()
    with torch.no_grad():
        assert rel_err(model.loss(batch)[0], ref.loss(batch)[0]) < 1e-5  # the validator's loss


def test_copies_and_checkpoints_are_ultralytics_own_model(one_thread):
    """The EMA is a deepcopy and checkpoints are pickles: both of ultralytics' class, loadable without accumnorm."""
    model = exact_loss(_yolo(), micro_batch_size=2)
    copied = copy.deepcopy(model)
    assert type(copied) is DetectionModel and "_accumnorm" not in copied.__dict__
    buffer = io.BytesIO()
    torch.save({"ema": model}, buffer)
    assert b"accumnorm" not in buffer.getvalue()
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)["ema"]
    assert type(loaded) is DetectionModel
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    assert type(model).__name__ == "ExactDetectionModel"  # the original keeps its exact loss
    assert type(exact_loss(model, micro_batch_size=4)) is type(model) and model._accumnorm.micro_batch_size == 4


@pytest.mark.parametrize("option", SCHEDULE_OPTIONS)
def test_the_schedules_options_reach_the_step(option, tmp_path, one_thread):
    """Through exact_loss, and through exact_trainer's model."""
    options = SCHEDULE_OPTIONS[option]
    model = exact_loss(_yolo(), micro_batch_size=2, **options)
    model(_batch())
    assert_ran_with(model, options)
    trainer = exact_trainer(2, **options)(overrides=dict(
        model="yolov8n.yaml", data=str(_dataset(tmp_path / "data")), imgsz=64, device="cpu", workers=0,
        project=str(tmp_path / "runs"), verbose=False))
    model = trainer.get_model(cfg="yolov8n.yaml", verbose=False).train()
    model.args = trainer.args  # the loss gains, as the trainer sets them
    model(_batch())
    assert_ran_with(model, options)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(micro_batch_size=0), ValueError, "micro_batch_size must be >= 1, got 0"),
    (dict(micro_batch_size=2, bn="whole"), ValueError, "bn must be one of"),
    (dict(micro_batch_size=2, schedule="fast"), ValueError, "schedule must be one of"),
    (dict(micro_batch_size=2, store="gpu"), ValueError, "store must be None, 'cpu' or a torch.device"),
    (dict(micro_batch_size=2, memory_budget=True), TypeError, "memory_budget must be a number of bytes"),
    (dict(micro_batch_size=2, keep_every=2), ValueError, "keep_every is the segments schedule's setting"),
])
def test_bad_options_are_refused_before_anything_changes(kwargs, error, message):
    model = _yolo()
    with pytest.raises(error, match=message):
        exact_loss(model, **kwargs)
    assert type(model) is DetectionModel
    with pytest.raises(TypeError, match="expected an ultralytics model with a loss"):
        exact_loss(torch.nn.Linear(2, 2), 2)


@pytest.mark.parametrize("cls, config", [("WorldModel", "yolov8s-worldv2.yaml"),
                                         ("RTDETRDetectionModel", "rtdetr-l.yaml")])
def test_a_model_with_a_loss_of_its_own_is_refused_before_anything_changes(cls, config):
    """YOLO-World's loss runs its forward with the batch's text features, RT-DETR's with its targets (denoising):
    the micro-batches' forwards, on the images alone, trained YOLO-World on other features (gradient 1.02 off)."""
    import ultralytics.nn.tasks

    model = getattr(ultralytics.nn.tasks, cls)(config, nc=3, verbose=False)
    with pytest.raises(TypeError, match=f"got {cls}, whose loss\\(\\) is its own.*Nothing was changed"):
        exact_loss(model, 2)
    assert type(model).__name__ == cls and "_accumnorm" not in vars(model)


@pytest.mark.parametrize("change, message", [
    (dict(batch_size=16), r"ultralytics would accumulate 4 batches of 16 per optimizer step \(nbs=64\)"),
    (dict(compile=True), r"compile=True makes ultralytics' loop run the whole batch through the model in one "
                         r"forward \(preds = model\(batch\['img'\]\)\) and take the loss of its outputs"),
    (dict(compile="max-autotune"), "compile='max-autotune' makes ultralytics' loop run the whole batch"),
    (dict(world_size=2), "training on 2 devices"),
    (dict(model=torch.nn.Linear(2, 2)), r"the trainer's model \(Linear\) is not the one get_model built"),
])
def test_the_trainer_refuses_what_would_not_train_exactly(change, message):
    trainer = SimpleNamespace(args=SimpleNamespace(nbs=64, compile=change.get("compile", False)),
                              batch_size=change.get("batch_size", 64), world_size=change.get("world_size", 1),
                              model=change.get("model", exact_loss(_yolo(), 8)))
    with pytest.raises(ValueError, match=message):
        _check_trainer(trainer)


def _dataset(root: Path, images: int = 8) -> Path:
    """A YOLO-format dataset of `images` 64x64 grey images with 1 or 2 coloured rectangles each (colour = class)."""
    import cv2
    import numpy as np

    rng = np.random.default_rng(0)
    for split in ("images", "labels"):
        (root / split / "train").mkdir(parents=True)
    for i in range(images):
        image, lines = np.full((64, 64, 3), 128, np.uint8), []
        for _ in range(int(rng.integers(1, 3))):
            c = int(rng.integers(3))
            w, h = rng.uniform(0.2, 0.4, 2)
            x, y = rng.uniform(0.25, 0.75, 2)
            image[int((y - h / 2) * 64):int((y + h / 2) * 64), int((x - w / 2) * 64):int((x + w / 2) * 64), c] = 255
            lines.append(f"{c} {x:.4f} {y:.4f} {w:.4f} {h:.4f}")
        cv2.imwrite(str(root / "images" / "train" / f"{i}.png"), image)
        (root / "labels" / "train" / f"{i}.txt").write_text("\n".join(lines) + "\n")
    data = root / "data.yaml"
    data.write_text(f"path: {root}\ntrain: images/train\nval: images/train\nnames:\n  0: r\n  1: g\n  2: b\n")
    return data


def _recording(trainer_class: type) -> type:
    """trainer_class, keeping the gradients of every optimizer step (before ultralytics clips them)."""
    class Recording(trainer_class):
        def optimizer_step(self):
            self.steps = getattr(self, "steps", []) + [_grads(self.model)]
            super().optimizer_step()

    return Recording


@pytest.mark.slow
def test_ultralytics_trainer_steps_as_with_the_whole_batch(tmp_path, one_thread):
    """2 epochs of 8 images, one step each: the exact trainer in micro-batches of 2 and ultralytics' own trainer
    over the whole batch take the same gradients, and end with the same weights and running statistics; the
    checkpoints are ultralytics' model. With batch < nbs the exact trainer refuses before the first step."""
    data = _dataset(tmp_path / "data")
    common = dict(model="yolov8n.yaml", data=str(data), epochs=2, batch=8, nbs=8, imgsz=64, device="cpu", workers=0,
                  plots=False, val=False, project=str(tmp_path / "runs"), seed=0, deterministic=True, amp=False,
                  optimizer="SGD", verbose=False)
    trained = {}
    for name, trainer_class in (("whole", DetectionTrainer), ("exact", exact_trainer(micro_batch_size=2))):
        trainer = _recording(trainer_class)(overrides={**common, "name": name})
        trainer.train()
        trained[name] = trainer
    whole, exact = trained["whole"], trained["exact"]
    assert type(exact.model).__name__ == "ExactDetectionModel" and len(exact.steps) == len(whole.steps) == 2
    for got, want in zip(exact.steps, whole.steps):
        assert _worst(got, want) < 1e-3
    for (name, b), c in zip(whole.model.state_dict().items(), exact.model.state_dict().values()):
        assert rel_err(c.float(), b.float(), 1e-3) < 1e-3, name
    assert b"accumnorm" not in exact.best.read_bytes()  # best.pt: ultralytics' model, loadable without accumnorm
    assert type(torch.load(exact.best, weights_only=False)["model"]) is DetectionModel

    refusing = exact_trainer(micro_batch_size=2)(overrides={**common, "name": "refused", "batch": 4})
    with pytest.raises(ValueError, match=r"ultralytics would accumulate 2 batches of 4 per optimizer step \(nbs=8\)"):
        refusing.train()
