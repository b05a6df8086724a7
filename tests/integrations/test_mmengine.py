"""accumnorm.integrations.mmengine: a real mmengine Runner with the exact loops trains like plain PyTorch with
the whole batch per step, on one process and on two gloo processes; a count-normalized loss is exact through the
whole-batch form; misuse fails before the first step, and a failing step changes nothing."""
import copy
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.hooks import Hook
from mmengine.optim import OptimWrapper
from mmengine.runner import Runner

import accumnorm.integrations.mmengine  # noqa: F401  (registers the loops, as custom_imports does)
from helpers import (
    SCHEDULE_OPTIONS,
    assert_ran_with,
    assert_ranks_ended_well,
    assert_ranks_trained_like_whole_batch,
    assert_state_close,
    failing_forward,
    launch_ranks,
    sgd_halving,
    train_whole_batch,
)
from models import TinyUnrolled, mm_classifier, mm_samples, timm_model, tiny_bn, tiny_dataset

PROGRAM = Path(__file__).parents[1] / "programs" / "mmengine_ddp.py"
CLIP = 0.05  # the gradient norm is ~0.1-1 here: every step is clipped


def runner(work_dir: Path, model: nn.Module, data, *, loop: str = "ExactEpochBasedTrainLoop", batch_size: int = 8,
           optim_wrapper=None, cfg: dict | None = None, **train_cfg) -> Runner:
    """A quiet CPU Runner: 2 epochs over `data` in order, SGD with momentum clipped to CLIP, the LR halved every
    iteration, a checkpoint every epoch; micro-batches of 3 unless train_cfg says otherwise; `cfg` the full config
    (for what the Runner reads only from it, such as `compile`)."""
    by_epoch = "Epoch" in loop
    train_cfg = {"type": loop, "micro_batch_size": 3, **({"max_epochs": 2} if by_epoch else {"max_iters": 4}),
                 **train_cfg}
    return Runner(
        model=model, work_dir=str(work_dir), experiment_name=work_dir.name,
        train_dataloader=dict(dataset=data, sampler=dict(type="DefaultSampler", shuffle=False), batch_size=batch_size,
                              collate_fn=dict(type="default_collate"), num_workers=0),
        train_cfg=train_cfg,
        optim_wrapper=optim_wrapper or dict(optimizer=dict(type="SGD", lr=0.2, momentum=0.9),
                                            clip_grad=dict(max_norm=CLIP)),
        param_scheduler=dict(type="StepLR", step_size=1, gamma=0.5, by_epoch=False),
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=1 if by_epoch else 2, by_epoch=by_epoch),
                           logger=dict(type="LoggerHook", interval=1)),
        randomness=dict(seed=0), log_level="WARNING", cfg=cfg)


def in_order(data, batch_size: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The whole batches a shuffle-free loader of `batch_size` yields over `steps` steps, epoch after epoch."""
    starts = [i for i in range(0, len(data), batch_size)]
    parts = [data[s:s + batch_size] for s in starts]
    return [parts[i % len(parts)] for i in range(steps)]


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["ExactEpochBasedTrainLoop", "ExactIterBasedTrainLoop"])
def test_runner_equals_whole_batch_training_and_resumes_bit_identically(loop, tmp_path, monkeypatch):
    """4 iterations over batches of 8, 4, 8, 4 (12 samples, 2 epochs) as micro-batches of 3, float64, clipped, the
    LR halved every iteration: parameters and running statistics are whole-batch PyTorch's; resuming the
    checkpoint after 2 iterations (epoch 1) ends in the very same state."""
    data = tiny_dataset(12)
    model = mm_classifier()(tiny_bn())
    first = runner(tmp_path / "run", model, mm_samples(data), loop=loop)
    first.train()
    oracle = tiny_bn()
    losses, norms = train_whole_batch(oracle, in_order(data, 8, 4), max_grad_norm=CLIP)
    assert min(norms) > CLIP  # clipping is part of what is compared
    assert_state_close(model.net.state_dict(), oracle.state_dict(), 1e-9)
    # the log variables of the last step (batch of 4 as 3 + 1): the whole batch's, micro-batches weighed by samples
    for name in ("train/loss", "train/loss_cls"):
        assert first.message_hub.get_scalar(name).current() == pytest.approx(losses[-1], rel=1e-9)

    # mmengine 0.10's checkpoints hold its own classes, which torch.load's weights_only default (torch >= 2.6) refuses
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    checkpoint = "epoch_1.pth" if "Epoch" in loop else "iter_2.pth"
    resumed = mm_classifier()(tiny_bn())
    second = runner(tmp_path / "resumed", resumed, mm_samples(data), loop=loop)
    second._load_from, second._resume = str(tmp_path / "run" / checkpoint), True
    second.train()
    assert_state_close(resumed.net.state_dict(), model.net.state_dict(), 0.0)


def test_a_run_under_recompute_resumed_from_its_checkpoint_steps_as_one_that_never_stopped(tmp_path, monkeypatch):
    """timm's LCNet, whose smallest blocks recompute runs as they are from its second step on (a BatchNorm call there
    rounds otherwise than in a checkpointed block): the checkpoint keeps recompute's measurements, and the run
    resumed after epoch 1 ends bit for bit as the one that never stopped."""
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,),
                                                                                                 generator=g))
    torch.manual_seed(0)
    start = timm_model()
    model = mm_classifier()(copy.deepcopy(start))
    runner(tmp_path / "run", model, mm_samples(data), micro_batch_size=4, schedule="recompute").train()
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # mmengine's classes in its checkpoints
    resumed = mm_classifier()(copy.deepcopy(start))
    second = runner(tmp_path / "resumed", resumed, mm_samples(data), micro_batch_size=4, schedule="recompute")
    second._load_from, second._resume = str(tmp_path / "run" / "epoch_1.pth"), True
    second.train()
    assert_state_close(resumed.state_dict(), model.state_dict(), 0.0)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("whole_batch_loss", [False, True])
def test_the_runners_compile_config_compiles_the_model_and_trains_like_whole_batch_torch(whole_batch_loss, tmp_path):
    """cfg compile=dict(backend="aot_eager"): mmengine compiles model.train_step, which the exact loop bypasses; the
    loop compiles the model in place, dynamo compiles graphs between its BatchNorm calls, and 4 iterations over
    batches of 8, 4, 8, 4 as micro-batches of 3, float64, clipped, give whole-batch PyTorch's parameters and running
    statistics, in both loss forms. The checkpoints keep the uncompiled model's keys."""
    from torch._dynamo.utils import counters

    data = tiny_dataset(12)
    model = mm_classifier()(TinyUnrolled())
    keys = model.state_dict().keys()
    runner(tmp_path, model, mm_samples(data), cfg=dict(compile=dict(backend="aot_eager")),
           whole_batch_loss=whole_batch_loss).train()
    assert vars(model).get("_compiled_call_impl") is not None and counters["stats"]["unique_graphs"] > 0
    oracle = TinyUnrolled()
    train_whole_batch(oracle, in_order(data, 8, 4), max_grad_norm=CLIP)
    assert_state_close(model.net.state_dict(), oracle.state_dict(), 1e-9)
    checkpoint = torch.load(tmp_path / "epoch_2.pth", weights_only=False)
    assert checkpoint["state_dict"].keys() == keys


def count_normalized_oracle(net: nn.Module, batches) -> None:
    """Whole-batch PyTorch with the count-normalized loss, clipped, SGD halving its LR."""
    optimizer, scheduler = sgd_halving(net.parameters())
    for x, y in batches:
        optimizer.zero_grad()
        counted = y >= 0
        loss = F.cross_entropy(net(x), y.clamp(min=0), reduction="none")[counted].sum() / counted.sum()
        loss.backward()
        nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        optimizer.step()
        scheduler.step()


@pytest.mark.slow
def test_a_count_normalized_loss_is_exact_through_the_whole_batch_form(tmp_path):
    """The loss divides by the labelled samples of the whole batch (a third unlabelled, -1; micro-batches hold 1 to 3):
    whole_batch_loss=True is whole-batch PyTorch; the per-micro-batch form divides by each micro-batch's count."""
    x, y = tiny_dataset(12)[:]
    y = torch.where(torch.arange(12) % 3 == 0, -1, y)
    data = torch.utils.data.TensorDataset(x, y)
    oracle = tiny_bn()
    count_normalized_oracle(oracle, in_order(data, 8, 4))
    exact = mm_classifier()(tiny_bn(), count_normalized=True)
    runner(tmp_path / "exact", exact, mm_samples(data), whole_batch_loss=True).train()
    assert_state_close(exact.net.state_dict(), oracle.state_dict(), 1e-9)
    per_micro_batch = mm_classifier()(tiny_bn(), count_normalized=True)
    runner(tmp_path / "micro", per_micro_batch, mm_samples(data)).train()
    with pytest.raises(AssertionError, match="relative error"):
        assert_state_close(per_micro_batch.net.state_dict(), oracle.state_dict(), 1e-3)


@pytest.mark.parametrize("whole_batch_loss", [False, True])
@pytest.mark.parametrize("option", SCHEDULE_OPTIONS)
def test_the_schedules_options_reach_the_step(option, whole_batch_loss, tmp_path):
    options = SCHEDULE_OPTIONS[option]
    model = mm_classifier()(tiny_bn())
    runner(tmp_path, model, mm_samples(tiny_dataset(8)), max_epochs=1, whole_batch_loss=whole_batch_loss,
           **options).train()
    assert_ran_with(model, options)


@pytest.mark.parametrize("micro_batch_size", [1, 3])
def test_data_samples_collated_as_one_tensor_reach_loss_by_feat_as_the_whole_batchs(micro_batch_size, tmp_path):
    """default_collate stacks data samples that are tensors (labels) into one: loss_by_feat gets the whole batch's,
    concatenated, as mmengine's own loop gives it (a micro-batch of one label 0 was dropped as false, and a tensor of
    several raised)."""
    x, y = tiny_dataset(12)[:]
    y = torch.where(torch.arange(12) % 3 == 0, -1, y)
    data = torch.utils.data.TensorDataset(x, y)
    oracle = tiny_bn()
    count_normalized_oracle(oracle, in_order(data, 8, 4))

    class TensorLabels(mm_classifier()):
        def loss_by_feat(self, logits, labels):
            assert isinstance(labels, torch.Tensor) and len(labels) == len(logits)
            counted = labels >= 0
            return {"loss_cls": F.cross_entropy(logits, labels.clamp(min=0), reduction="none")[counted].sum()
                    / counted.sum().clamp(min=1)}

    exact = TensorLabels(tiny_bn())
    runner(tmp_path / "exact", exact, [{"inputs": x, "data_samples": y} for x, y in data], whole_batch_loss=True,
           micro_batch_size=micro_batch_size).train()
    assert_state_close(exact.net.state_dict(), oracle.state_dict(), 1e-9)


@pytest.mark.parametrize("where", [0, 7])
def test_a_loss_term_some_micro_batches_lack_is_trained_and_logged_as_the_whole_batchs(where, tmp_path):
    """A head whose loss has a term only where its samples call for it (one for the positives): the loop took the log
    variables' names from micro-batch 0, so a term only a later micro-batch had was left out of the log, and one a
    later micro-batch lacked raised KeyError after the step had written .grad. The one sample of class 0 is in
    micro-batch 0 (of 3, 3, 2), or in the last: parameters and logged terms are whole-batch PyTorch's (a micro-batch
    without the term adds 0 to it, as to the loss)."""
    x, _ = tiny_dataset(8)[:]
    y = torch.ones(8, dtype=torch.long)
    y[where] = 0

    class Positives(mm_classifier()):
        def loss_by_feat(self, logits, data_samples):
            losses = super().loss_by_feat(logits, data_samples)
            labels = torch.stack([s.gt_label for s in data_samples])
            if (labels == 0).any():
                losses["loss_pos"] = logits[labels == 0].pow(2).sum() / len(logits)
            return losses

    model = Positives(tiny_bn())
    run = runner(tmp_path, model, mm_samples(torch.utils.data.TensorDataset(x, y)), loop="ExactIterBasedTrainLoop",
                 max_iters=1)
    run.train()
    oracle = tiny_bn()
    optimizer = torch.optim.SGD(oracle.parameters(), lr=0.2, momentum=0.9)
    logits = oracle(x)
    terms = {"loss_cls": F.cross_entropy(logits, y), "loss_pos": logits[y == 0].pow(2).sum() / 8}
    sum(terms.values()).backward()
    assert nn.utils.clip_grad_norm_(oracle.parameters(), CLIP) > CLIP  # clipping is part of what is compared
    optimizer.step()
    assert_state_close(model.net.state_dict(), oracle.state_dict(), 1e-9)
    for name, value in {**terms, "loss": sum(terms.values())}.items():
        assert run.message_hub.get_scalar(f"train/{name}").current() == pytest.approx(float(value), rel=1e-9)


class Poison(Hook):
    """After iteration 2, the model's loss turns NaN (or its forward raises): iteration 3 fails."""

    def __init__(self, failure: str) -> None:
        self.failure, self.after_2 = failure, None

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        if runner.iter == 1:
            self.after_2 = copy.deepcopy((runner.model.state_dict(), runner.optim_wrapper.state_dict(),
                                          runner.param_schedulers[0].state_dict()))
            runner.model.net[0].register_forward_hook(failing_forward(self.failure))


@pytest.mark.parametrize("failure", ["nan", "exception"])
def test_a_failing_step_changes_nothing(failure, tmp_path):
    """Iteration 3 fails: train() raises, and the model (parameters, running statistics, .grad), the optimizer, the
    scheduler, the loop's iteration and the optim wrapper's count are those after iteration 2."""
    model = mm_classifier()(tiny_bn())
    poison = Poison(failure)
    run = runner(tmp_path, model, mm_samples(tiny_dataset(12)))
    run.register_hook(poison, priority="LOWEST")  # after the scheduler hook has stepped
    error = (ValueError, "is not finite") if failure == "nan" else (RuntimeError, "the model failed")
    with pytest.raises(error[0], match=error[1]):
        run.train()
    model_state, optim_state, scheduler_state = poison.after_2
    assert run.iter == 2 and run.optim_wrapper._inner_count == 2
    assert_state_close(model.state_dict(), model_state, 0.0)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    assert run.param_schedulers[0].state_dict() == scheduler_state
    for key, value in run.optim_wrapper.state_dict()["state"].items():
        assert torch.equal(value["momentum_buffer"], optim_state["state"][key]["momentum_buffer"])


class OwnTrainStep(nn.Module):
    pass


MISUSES = {  # name: (runner arguments, the error, its words)
    "accumulative_counts": (dict(optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1), accumulative_counts=2)),
                            ValueError, "optim_wrapper accumulative_counts=2 accumulates with each batch's own"),
    "foreign optimizer": (dict(optim_wrapper="foreign"), ValueError, "steps 2 tensors, 2 of them not parameters"),
    "own train_step": (dict(model="own train_step"), ValueError, "has its own train_step, which the exact loop would"),
    "whole_batch_loss without loss_by_feat": (dict(model="no loss_by_feat", whole_batch_loss=True), ValueError,
                                              "loss_by_feat(outputs, data_samples), which Plain does not define"),
    "micro_batch_size": (dict(micro_batch_size=0), ValueError, "micro_batch_size must be >= 1, got 0"),
    "memory_budget": (dict(memory_budget=2.0 ** 30), TypeError, "memory_budget must be a number of bytes (an int)"),
    "keep_every": (dict(schedule="segments", keep_every=-1), ValueError, "keep_every must be >= 1, got -1"),
    "compile fullgraph": (dict(cfg=dict(compile=dict(backend="aot_eager", fullgraph=True))), ValueError,
                          "the runner's compile={'fullgraph': True} makes each graph break an error, but bn='exact'"),
}


@pytest.mark.parametrize("misuse", MISUSES)
def test_misuse_is_refused_before_the_first_step(misuse, tmp_path):
    args, error, message = dict(MISUSES[misuse][0]), *MISUSES[misuse][1:]
    base = mm_classifier()
    kind = args.pop("model", None)
    if kind == "own train_step":
        model = type("OwnStep", (base,), {"train_step": lambda self, data, optim_wrapper: {}})(tiny_bn())
    elif kind == "no loss_by_feat":
        plain = type("Plain", (base,), {"loss_by_feat": None})
        model = plain(tiny_bn())
    else:
        model = base(tiny_bn())
    if args.get("optim_wrapper") == "foreign":
        args["optim_wrapper"] = OptimWrapper(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(error, match=re.escape(message)):
        runner(tmp_path, model, mm_samples(tiny_dataset(12)), **args).train()
    assert_state_close(model.state_dict(), before, 0.0)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.realtime
@pytest.mark.slow
def test_two_cpu_processes_equal_one_process_with_the_global_batch(tmp_path):
    """launcher='pytorch', 2 gloo processes x batches of 4 as micro-batches 3 + 1 against plain PyTorch on batches of
    8, float64, clipped, torch's BatchNorm unconverted: MMDistributedDataParallel must not reduce a second time."""
    results = launch_ranks([str(PROGRAM), str(tmp_path), str(CLIP)], tmp_path, wait_s=900)
    assert_ranks_ended_well(results)
    assert_ranks_trained_like_whole_batch(tmp_path, 2, tiny_bn(), CLIP)
