"""accumnorm.integrations.transformers: a real transformers.Trainer with gradient_accumulation_steps trains like
plain PyTorch with the whole batch of each step, on one process and on two gloo processes; misuse fails at set-up,
a failing step changes nothing. Models are built from configs: nothing is downloaded."""
import copy
import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

os.environ["HF_HUB_OFFLINE"] = "1"
from transformers import (  # noqa: E402
    MobileNetV2Config,
    MobileNetV2ForImageClassification,
    ResNetConfig,
    ResNetForImageClassification,
    SegformerConfig,
    SegformerForSemanticSegmentation,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from accumnorm.integrations.transformers import ExactTrainer  # noqa: E402
from helpers import (  # noqa: E402
    SCHEDULE_OPTIONS,
    assert_ran_with,
    assert_ranks_ended_well,
    assert_ranks_trained_like_whole_batch,
    assert_state_close,
    assert_state_within_rounding,
    failing_forward,
    launch_ranks,
    rel_err,
    sgd_halving,
)
from models import KeywordClassifier, TinyUnrolled, keyword_samples, timm_model, tiny_bn, tiny_dataset  # noqa: E402

PROGRAM = Path(__file__).parents[1] / "programs" / "transformers_ddp.py"
CLIP = 0.5  # below the gradient norms of these models: every step is clipped


def images(n: int, channels: int = 1, size: int = 16) -> list[dict[str, torch.Tensor]]:
    """n float64 images with labels, the same every call."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(n, channels, size, size, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 10, (n,), generator=generator)
    return [{"pixel_values": x[i], "labels": y[i]} for i in range(n)]


def hf_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "resnet":
        config = ResNetConfig(num_channels=1, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                              layer_type="basic", num_labels=10)
        return ResNetForImageClassification(config).double()
    config = MobileNetV2Config(num_channels=1, image_size=8, depth_multiplier=0.25, num_labels=10,
                               classifier_dropout_prob=0.0)  # dropout would draw other numbers than the oracle
    return MobileNetV2ForImageClassification(config).double()


def arguments(out: Path, batch: int, steps: int, **kwargs) -> TrainingArguments:
    """Quiet CPU arguments for `steps` optimizer steps of `steps` micro-batches of `batch`, clipped."""
    return TrainingArguments(str(out), **{**dict(
        use_cpu=True, per_device_train_batch_size=batch, gradient_accumulation_steps=steps, max_steps=4,
        max_grad_norm=CLIP, report_to="none", save_strategy="no", disable_tqdm=True, seed=0), **kwargs})


class Recording:
    """Mixin for a Trainer: keeps each optimizer step's micro-batches, for the oracle to join."""

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.steps.append([dict(b) for b in batches])
        return batches, num_items


def train(cls: type, model: nn.Module, args: TrainingArguments, data, **kwargs):
    """Train `model` (in place) with a Recording `cls` over SGD whose LR halves every step; returns the trainer."""
    optimizer, scheduler = sgd_halving(model.parameters())
    trainer = type(f"Recording{cls.__name__}", (Recording, cls), {})(
        model=model, args=args, train_dataset=data, optimizers=(optimizer, scheduler), **kwargs)
    trainer.steps = []
    trainer.train()
    return trainer


def whole_batch(model: nn.Module, steps, loss=lambda model, batch: model(**batch)["loss"],
                autocast: torch.dtype | None = None, clip: float = CLIP) -> list[float]:
    """The oracle: the steps' micro-batches joined, one forward/backward each (under CPU autocast to `autocast` if
    given), clipped to `clip` (0: not clipped), SGD halving its LR. Returns the losses."""
    optimizer, scheduler = sgd_halving(model.parameters())
    norms, losses = [], []
    for micro_batches in steps:
        batch = {key: torch.cat([b[key] for b in micro_batches]) for key in micro_batches[0]}
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=autocast or torch.float32, enabled=autocast is not None):
            value = loss(model, batch)
        value.backward()
        losses.append(value.item())
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip or float("inf"))))
        optimizer.step()
        scheduler.step()
    assert not clip or min(norms) > clip  # clipping is part of what is compared
    return losses


def worst(state, want, floor: float = 0.0) -> float:
    """The largest relative error of a float entry of `state` against `want`'s, at least `floor` as its scale."""
    return max(rel_err(state[k], v, floor) for k, v in want.items() if v.is_floating_point())


def assert_trained_alike(state, want, tol: float) -> None:
    """`state` within `tol` of `want`, every entry measured against at least 1e-6: MobileNetV2's BatchNorm after a
    BatchNorm has a bias and a running mean that are 0 but for rounding (1e-17), whoever computes them."""
    assert worst(state, want, 1e-6) <= tol
    assert all(torch.equal(state[k], v) for k, v in want.items() if not v.is_floating_point())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet", "mobilenet_v2"])
def test_trainer_equals_whole_batch_torch_and_the_stock_trainer_does_not(name, tmp_path):
    """4 steps of 2 micro-batches of 3 over 23 images, float64, clipped, the LR halved every step; the last step
    is short (3 + 2). ExactTrainer's parameters and running statistics are whole-batch PyTorch's; the stock
    Trainer with the same arguments is visibly off (BatchNorm over 3 images, and ResNet's loss counted twice;
    run on ResNet only, MobileNetV2's float64 depthwise convolutions being slow on a CPU). Within 1e-8: whole-batch
    PyTorch itself moves by 2.1e-9 between 1 and 2 intra-op threads, on MobileNetV2's last running variance (of 6
    values at a 1x1 map, after 4 steps)."""
    data, start = images(23, size=16 if name == "resnet" else 8), hf_model(name)
    ours = copy.deepcopy(start)
    trainer = train(ExactTrainer, ours, arguments(tmp_path / "ours", 3, 2), data)
    assert [[len(b["labels"]) for b in step] for step in trainer.steps] == [[3, 3]] * 3 + [[3, 2]]
    oracle = copy.deepcopy(start)
    losses = whole_batch(oracle, trainer.steps)
    assert_trained_alike(ours.state_dict(), oracle.state_dict(), 1e-8)
    # the Trainer's mean of the losses training_step returned (1 per step, 0 for the other micro-batch), in float32
    assert trainer.state.log_history[-1]["train_loss"] == pytest.approx(sum(losses) / 4, rel=1e-6)

    if name != "resnet":
        return
    stock = copy.deepcopy(start)
    train(Trainer, stock, arguments(tmp_path / "stock", 3, 2), data)
    assert worst(stock.state_dict(), oracle.state_dict()) > 1e-2


def count_normalized(outputs, labels, num_items_in_batch=None):
    """A token-level loss, as compute_loss_func: summed over the labels that are not -100, divided by their count."""
    return F.cross_entropy(outputs["logits"], labels, ignore_index=-100, reduction="sum") / num_items_in_batch


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["compute_loss_func", "the model's own mean"])
@pytest.mark.parametrize("unlabelled", ["every third sample", "a whole micro-batch"])
def test_a_count_normalized_loss_equals_the_stock_trainer_with_one_whole_batch(unlabelled, loss, tmp_path):
    """compute_loss_func normalized by num_items_in_batch, or the model's own loss, a mean over its labels that are
    not -100 (a model without **kwargs: the Trainer counts no items for it), a third of the labels -100: every third
    sample (shuffled: micro-batches hold 1 to 3 counted items), or samples 0-2 and 9-11 in order (a micro-batch without
    any). ExactTrainer with micro-batches of 3, 2 per step, is the stock Trainer with batches of 6 and no accumulation
    (the same order), and whole-batch PyTorch."""
    options = {"compute_loss_func": count_normalized} if loss == "compute_loss_func" else {}
    data = keyword_samples(tiny_dataset(24))
    order = {"every third sample": "random", "a whole micro-batch": "sequential"}[unlabelled]
    for i in range(0, 24, 3) if order == "random" else [0, 1, 2, 9, 10, 11]:
        data[i] = {**data[i], "labels": torch.tensor(-100)}
    start = KeywordClassifier(tiny_bn())
    ours, stock = copy.deepcopy(start), copy.deepcopy(start)
    if not options and order == "sequential":  # the model's mean over a micro-batch without a label: torch's 0/0
        with pytest.raises(ValueError, match="loss is not finite.*micro-batch 0.*nothing was changed"):
            train(ExactTrainer, ours, arguments(tmp_path / "ours", 3, 2, train_sampling_strategy=order), data)
        assert_state_close(ours.state_dict(), start.state_dict(), 0.0)
        return
    trainer = train(ExactTrainer, ours, arguments(tmp_path / "ours", 3, 2, train_sampling_strategy=order), data,
                    **options)
    stock_trainer = train(Trainer, stock, arguments(tmp_path / "stock", 6, 1, train_sampling_strategy=order), data,
                          **options)
    assert all(torch.equal(one[0]["labels"], torch.cat([b["labels"] for b in micro]))
               for one, micro in zip(stock_trainer.steps, trainer.steps, strict=True))
    assert_state_close(ours.state_dict(), stock.state_dict(), 1e-9)
    oracle = copy.deepcopy(start)
    whole_batch(oracle, trainer.steps, lambda model, batch: F.cross_entropy(
        model(batch["pixel_values"])["logits"], batch["labels"], ignore_index=-100))
    assert_state_close(ours.state_dict(), oracle.state_dict(), 1e-9)


def segformer(labels: int) -> nn.Module:
    """A tiny SegformerForSemanticSegmentation in float64 (BatchNorm in its decode head), its loss ignoring the
    label 255 (`semantic_loss_ignore_index`, the config's default)."""
    torch.manual_seed(0)
    config = SegformerConfig(num_channels=1, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                             hidden_sizes=[8, 16], num_attention_heads=[1, 1], decoder_hidden_size=8,
                             num_labels=labels, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                             classifier_dropout_prob=0.0, drop_path_rate=0.0)
    return SegformerForSemanticSegmentation(config).double()


def masks(n: int, labels: int) -> list[dict[str, torch.Tensor]]:
    """n float64 16x16 images with a class per pixel (0 or 1 for a binary head); in every other sample the first 2 to
    14 rows are 255, unlabelled, so that the micro-batches hold different numbers of labelled pixels."""
    generator = torch.Generator().manual_seed(1)
    samples = []
    for i in range(n):
        x = torch.randn(1, 16, 16, generator=generator, dtype=torch.float64)
        y = torch.randint(0, max(labels, 2), (16, 16), generator=generator)
        y[: 2 + 3 * (i % 5) if i % 2 else 0] = 255
        samples.append({"pixel_values": x, "labels": y})
    return samples


@pytest.mark.slow
@pytest.mark.parametrize("labels", [3, 1])
def test_a_segmentation_loss_that_ignores_the_configs_label_equals_whole_batch_torch(labels, tmp_path):
    """Hugging Face's segmentation models leave out the pixels labelled with their config's ignore index (255), a
    mean over the others; Segformer's binary head (one label) takes the mean over every pixel. Micro-batches of 2, 2
    per step, with different numbers of unlabelled pixels: the parameters and running statistics are whole-batch
    PyTorch's (measured against at least 1e-6: the attention's key bias has a gradient of 0 but for rounding), where
    weights counting the labels that are not -100 were 0.78 off."""
    data, start = masks(12, labels), segformer(labels)
    ours, oracle = copy.deepcopy(start), copy.deepcopy(start)
    trainer = train(ExactTrainer, ours, arguments(tmp_path, 2, 2, max_steps=3, max_grad_norm=0.0), data)
    counted = [[int((b["labels"] != 255).sum()) for b in step] for step in trainer.steps]
    assert any(a != b for a, b in counted)  # the micro-batches' labelled pixels differ, and so would the weights
    whole_batch(oracle, trainer.steps, clip=0.0)
    assert_trained_alike(ours.state_dict(), oracle.state_dict(), 1e-9)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("compiled", ["torch_compile=True", "model.compile()"])
def test_a_compiled_model_trains_like_whole_batch_torch(compiled, tmp_path):
    """TrainingArguments(torch_compile=True, torch_compile_backend="aot_eager"), or a model compiled in place by hand
    (torch.compile's wrapper would hide the forward's signature, by which the Trainer picks the dataset's columns):
    4 steps of 2 micro-batches of 3 over 23 samples, float64, clipped, the LR halved every step. Dynamo compiles
    graphs between the BatchNorm calls, and the parameters and running statistics are whole-batch PyTorch's."""
    from torch._dynamo.utils import counters

    data = keyword_samples(tiny_dataset(23))
    start = KeywordClassifier(TinyUnrolled())
    ours = copy.deepcopy(start)
    if compiled == "torch_compile=True":
        args = arguments(tmp_path, 3, 2, torch_compile=True, torch_compile_backend="aot_eager")
        trainer = train(ExactTrainer, ours, args, data)
        assert type(trainer.model_wrapped).__name__ == "OptimizedModule"
    else:
        ours.compile(backend="aot_eager")
        trainer = train(ExactTrainer, ours, arguments(tmp_path, 3, 2), data)
    assert counters["stats"]["unique_graphs"] > 0
    oracle = copy.deepcopy(start)
    whole_batch(oracle, trainer.steps)
    assert_state_close(ours.state_dict(), oracle.state_dict(), 1e-9)


@pytest.mark.slow
def test_resuming_a_checkpoint_continues_bit_identically(tmp_path):
    """Checkpoints every 2 steps of 4; a fresh ExactTrainer resumed from the step-2 one (model, optimizer, scheduler,
    RNG and sampler position) ends in the very same state."""
    data = images(23)
    first = hf_model("resnet")
    args = arguments(tmp_path / "run", 3, 2, save_strategy="steps", save_steps=2)
    train(ExactTrainer, first, args, data)
    resumed = hf_model("resnet")
    optimizer, scheduler = sgd_halving(resumed.parameters())
    ExactTrainer(model=resumed, args=args, train_dataset=data, optimizers=(optimizer, scheduler)).train(
        resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert_state_close(resumed.state_dict(), first.state_dict(), 0.0)


def test_a_run_under_recompute_resumed_from_a_checkpoint_steps_as_one_that_never_stopped(tmp_path):
    """timm's LCNet, whose smallest blocks recompute runs as they are from its second step on (a BatchNorm call there
    rounds otherwise than in a checkpointed block): the checkpoint keeps recompute's measurements, and the run
    resumed from step 2 ends bit for bit as the one that never stopped."""
    g = torch.Generator().manual_seed(0)
    data = keyword_samples(torch.utils.data.TensorDataset(torch.randn(24, 3, 32, 32, generator=g),
                                                          torch.randint(0, 10, (24,), generator=g)))
    torch.manual_seed(0)
    start = KeywordClassifier(timm_model())
    args = arguments(tmp_path / "run", 4, 3, max_steps=3, save_strategy="steps", save_steps=2, max_grad_norm=0.0)
    first = copy.deepcopy(start)
    train(ExactTrainer, first, args, data, schedule="recompute")
    resumed = copy.deepcopy(start)
    optimizer, scheduler = sgd_halving(resumed.parameters())
    ExactTrainer(model=resumed, args=args, train_dataset=data, optimizers=(optimizer, scheduler),
                 schedule="recompute").train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert_state_close(resumed.state_dict(), first.state_dict(), 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_autocasts_and_scales(precision, tmp_path):
    """bf16=True, and fp16=True with the GradScaler Accelerate makes on CUDA (given to this CPU run, its autocast on):
    the convolutions run in the low precision, and the trained state is as close to float64 whole-batch training as
    whole-batch PyTorch under the same autocast is. Not clipped: a gradient left scaled, or unscaled twice, would be
    off by the scale, 2**12."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    data = [{k: v.float() if v.is_floating_point() else v for k, v in d.items()} for d in images(23)]
    start = hf_model("resnet").float()
    ours = copy.deepcopy(start)
    seen = set()
    ours.resnet.embedder.embedder.convolution.register_forward_hook(lambda m, i, out: seen.add(out.dtype))
    optimizer, scheduler = sgd_halving(ours.parameters())
    trainer = type("RecordingExactTrainer", (Recording, ExactTrainer), {})(
        model=ours, args=arguments(tmp_path, 3, 2, max_grad_norm=0.0, **{precision: True}), train_dataset=data,
        optimizers=(optimizer, scheduler))
    trainer.steps = []
    if precision == "fp16":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
        trainer.accelerator.native_amp, trainer.accelerator.scaler = True, scaler
    trainer.train()
    assert seen == {dtype}
    if precision == "fp16":
        assert trainer.accelerator.scaler.get_scale() == 2.0**12  # no step overflowed
    oracle, truth = copy.deepcopy(start), copy.deepcopy(start).double()
    whole_batch(oracle, trainer.steps, autocast=dtype, clip=0.0)
    whole_batch(truth, [[{k: v.double() if v.is_floating_point() else v for k, v in b.items()} for b in step]
                        for step in trainer.steps], clip=0.0)
    assert_state_within_rounding(ours.state_dict(), oracle.state_dict(), truth.state_dict(),
                                 tol=torch.finfo(dtype).eps, slack=2.0)


class Poison(TrainerCallback):
    """After step 2, the model's loss turns NaN (or its forward raises): step 3 fails."""

    def __init__(self, model: nn.Module, failure: str) -> None:
        self.model, self.failure, self.after_step_2 = model, failure, None

    def on_step_end(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        if state.global_step == 2:
            self.after_step_2 = copy.deepcopy((self.model.state_dict(), optimizer.state_dict(),
                                               lr_scheduler.state_dict()))
            self.model.net[0].register_forward_hook(failing_forward(self.failure))


@pytest.mark.parametrize("failure", ["nan", "exception"])
def test_a_failing_step_changes_nothing(failure, tmp_path):
    """Step 3 fails: train() raises, and the model (parameters, running statistics, .grad), optimizer, scheduler
    and global_step are those after step 2."""
    model = KeywordClassifier(tiny_bn())
    optimizer, scheduler = sgd_halving(model.parameters())
    poison = Poison(model, failure)
    trainer = ExactTrainer(model=model, args=arguments(tmp_path, 3, 2), train_dataset=keyword_samples(tiny_dataset(24)),
                           optimizers=(optimizer, scheduler), callbacks=[poison])
    error = (ValueError, "is not finite") if failure == "nan" else (RuntimeError, "the model failed")
    with pytest.raises(error[0], match=error[1]):
        trainer.train()
    model_state, optimizer_state, scheduler_state = poison.after_step_2
    assert trainer.state.global_step == 2
    assert_state_close(model.state_dict(), model_state, 0.0)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    assert scheduler.state_dict() == scheduler_state
    for key, value in optimizer.state_dict()["state"].items():
        assert torch.equal(value["momentum_buffer"], optimizer_state["state"][key]["momentum_buffer"])


def _transforming(how: str) -> type:
    """An ExactTrainer whose training_step override doubles its inputs' images before calling ExactTrainer's."""
    class Transforming(ExactTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            if how == "in place":
                inputs["pixel_values"].mul_(2.0)
            elif how == "replaced":
                inputs["pixel_values"] = inputs["pixel_values"] * 2.0
            else:
                inputs = {**inputs, "pixel_values": inputs["pixel_values"] * 2.0}
            return super().training_step(model, inputs, num_items_in_batch)
    return Transforming


@pytest.mark.parametrize("how", ["in place", "replaced", "a new dict"])
def test_an_override_that_transforms_training_steps_inputs_is_refused_before_anything_changes(how, tmp_path):
    """ExactTrainer runs the step's K micro-batches at its first call, from the batches the Trainer gathered: an
    override that changed the first one's images (in place, or in the same dict) trained micro-batch 0 transformed
    and the others not, silently; one that passed a new dict was refused saying to call trainer.train(). Each is
    refused at the first step, naming what to do, with the model as it was."""
    model = KeywordClassifier(tiny_bn())
    before = copy.deepcopy(model.state_dict())
    trainer = _transforming(how)(model=model, args=arguments(tmp_path, 3, 2), train_dataset=keyword_samples(
        tiny_dataset(24)), optimizers=sgd_halving(model.parameters()))
    error = RuntimeError if how == "a new dict" else ValueError
    with pytest.raises(error, match="an override of training_step that changes its inputs.*compute_loss"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert_state_close(model.state_dict(), before, 0.0)


@pytest.mark.parametrize("option", SCHEDULE_OPTIONS)
def test_the_schedules_options_reach_the_step(option, tmp_path):
    options = SCHEDULE_OPTIONS[option]
    model = KeywordClassifier(tiny_bn())
    train(ExactTrainer, model, arguments(tmp_path, 3, 2, max_steps=1), keyword_samples(tiny_dataset(8)), **options)
    assert_ran_with(model, options)


def test_misuse_is_refused_when_the_trainer_is_made(tmp_path, monkeypatch):
    data = keyword_samples(tiny_dataset(8))
    with monkeypatch.context() as m:  # as under torchrun with 2 processes
        m.setattr(TrainingArguments, "world_size", property(lambda self: 2))
        with pytest.raises(ValueError, match=re.escape("TrainingArguments(torch_compile=True) on 2 processes: "
                                                       "Accelerate compiles the DDP wrapper")):
            ExactTrainer(model=KeywordClassifier(tiny_bn()), args=arguments(tmp_path, 3, 2, torch_compile=True),
                         train_dataset=data)
    foreign = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=re.escape("steps 2 tensors, 2 of them not parameters of KeywordClassifier")):
        ExactTrainer(model=KeywordClassifier(tiny_bn()), args=arguments(tmp_path, 3, 2), train_dataset=data,
                     optimizers=(foreign, None))
    with pytest.raises(ValueError, match=re.escape("schedule must be one of ('auto', 'layerwise'")):
        ExactTrainer(model=KeywordClassifier(tiny_bn()), args=arguments(tmp_path, 3, 2), train_dataset=data,
                     schedule="fast")
    with pytest.raises(TypeError, match=re.escape("memory_budget must be a number of bytes (an int) or None, got str")):
        ExactTrainer(model=KeywordClassifier(tiny_bn()), args=arguments(tmp_path, 3, 2), train_dataset=data,
                     memory_budget="8GB")
    with pytest.raises(ValueError, match=re.escape("keep_every is the segments schedule's setting, but schedule is")):
        ExactTrainer(model=KeywordClassifier(tiny_bn()), args=arguments(tmp_path, 3, 2), train_dataset=data,
                     schedule="recompute", keep_every=3)


@pytest.mark.realtime
@pytest.mark.slow
def test_two_cpu_processes_equal_one_process_with_the_global_batch(tmp_path):
    """torchrun-style, 2 gloo processes x 2 micro-batches of 3 per step against plain PyTorch on batches of 12,
    float64, clipped, torch's BatchNorm unconverted: the Trainer's DDP wrapper must not reduce a second time."""
    results = launch_ranks([str(PROGRAM), str(tmp_path), "0.05"], tmp_path, wait_s=900)
    assert_ranks_ended_well(results)
    assert_ranks_trained_like_whole_batch(tmp_path, 2, tiny_bn(), 0.05)
