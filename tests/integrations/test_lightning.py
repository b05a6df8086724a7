"""accumnorm.integrations.lightning: a real lightning.Trainer with micro-batches trains like plain PyTorch
with the whole batch per step, on one process and on two gloo processes; misuse fails at set-up."""
import copy
import csv
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn as nn
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import MixedPrecision

import accumnorm
from accumnorm.integrations.lightning import ExactAccumulation
from helpers import (
    SCHEDULE_OPTIONS,
    assert_ran_with,
    assert_ranks_ended_well,
    assert_ranks_trained_like_whole_batch,
    assert_state_close,
    assert_state_within_rounding,
    launch_ranks,
    sgd_halving,
    train_whole_batch,
)
from models import TinyUnrolled, lit_classifier, small_penalty, timm_model, tiny_bn, tiny_dataset

PROGRAM = Path(__file__).parents[1] / "programs" / "lightning_ddp.py"
CLIP = 0.05  # the gradient norm is ~0.1-1 here: every step is clipped


def trainer(**kwargs) -> pl.Trainer:
    """A quiet one-process CPU trainer of 3 steps, without logger or checkpoints unless asked for."""
    return pl.Trainer(**{**dict(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False), **kwargs})


def batches(dataset, size: int, steps: int) -> list:
    """The whole batches a shuffle-free loader of `size` yields over `steps` steps, epoch after epoch."""
    per_epoch = len(dataset) // size
    return [dataset[(i % per_epoch) * size:(i % per_epoch + 1) * size] for i in range(steps)]


@pytest.mark.slow
def test_trainer_equals_whole_batch_training_and_resumes_from_its_checkpoint(tmp_path):
    """3 steps over batches of 8 as micro-batches 3 + 3 + 2, float64, clipped, the LR halved by a per-step schedule,
    logged and checkpointed, accumnorm's BatchNorm (the two-rank test keeps torch's): parameters, running statistics
    and logged losses are whole-batch PyTorch's; resuming the step-2 checkpoint gives the same step 3."""
    data = tiny_dataset(16)  # 2 batches an epoch: step 3 is the first batch of epoch 2
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model = lit_classifier()(accumnorm.convert(tiny_bn()), micro_batch_size=3)
    checkpoints = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    trainer(precision="64-true", gradient_clip_val=CLIP, logger=CSVLogger(tmp_path, name="log"), log_every_n_steps=1,
            enable_checkpointing=True, callbacks=[checkpoints]).fit(model, loader)

    oracle = tiny_bn()
    losses, norms = train_whole_batch(oracle, batches(data, 8, 3), max_grad_norm=CLIP)
    assert min(norms) > CLIP  # clipping is part of what is compared
    assert_state_close(model.net.state_dict(), oracle.state_dict(), 1e-9)
    with open(tmp_path / "log" / "version_0" / "metrics.csv") as f:
        logged = [float(row["train_loss"]) for row in csv.DictReader(f) if row["train_loss"]]
    assert logged == pytest.approx(losses, rel=1e-12)

    resumed = lit_classifier()(accumnorm.convert(tiny_bn()), micro_batch_size=3)
    trainer(precision="64-true", gradient_clip_val=CLIP).fit(
        resumed, loader, ckpt_path=tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    assert_state_close(resumed.net.state_dict(), model.net.state_dict(), 0.0)


def test_a_batch_that_training_step_skips_steps_with_no_gradient_as_lightning_does():
    """A training_step that returns None skips its batch: Lightning zeroes the gradients after it and back-propagates
    nothing, so the optimizer's step has no gradient. It must not step again with the last batch's."""
    skip = 1

    class Skipping(lit_classifier()):
        def training_step(self, batch, batch_idx):
            return None if batch_idx == skip else super().training_step(batch, batch_idx)

    data = tiny_dataset(24)
    model = Skipping(accumnorm.convert(tiny_bn()), micro_batch_size=3)
    norms = []
    model.on_before_optimizer_step = lambda optimizer: norms.append(
        sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None) ** 0.5)
    trainer(precision="64-true").fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    assert len(norms) == 3 and norms[skip] == 0.0 and min(norms[0], norms[2]) > 0
    oracle = tiny_bn()
    optimizer, scheduler = sgd_halving(oracle.parameters())
    for i, (x, y) in enumerate(batches(data, 8, 3)):
        optimizer.zero_grad(set_to_none=True)
        if i != skip:
            nn.functional.cross_entropy(oracle(x), y).backward()
        optimizer.step()
        scheduler.step()
    assert_state_close(model.net.state_dict(), oracle.state_dict(), 1e-9)


RETURNED = {  # what an override of training_step returns, from the mixin's loss and the module
    "the loss plus a penalty": lambda loss, module: loss + small_penalty(module),
    "a multiple of the loss": lambda loss, module: 0.25 * loss,
    "a multiple of the loss plus a penalty": lambda loss, module: loss / 3 + small_penalty(module),
}


@pytest.mark.parametrize("returned", RETURNED)
def test_what_training_step_returns_is_back_propagated_as_lightning_would(returned):
    """An override of training_step that returns more than the mixin's loss: Lightning back-propagates what it
    returns. The mixin's backward ignored a penalty added to it (its gradient already made without it) and a factor
    on it (0.25 * loss trained as the loss, 0.27 off after 3 steps): silently another loss. Whole-batch training
    back-propagates the same function of its loss."""
    change = RETURNED[returned]

    class Returning(lit_classifier()):
        def training_step(self, batch, batch_idx):
            return change(super().training_step(batch, batch_idx), self)

    data = tiny_dataset(16)
    model = Returning(tiny_bn(), micro_batch_size=3)
    trainer(precision="64-true").fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    oracle = tiny_bn()
    optimizer, scheduler = sgd_halving(oracle.parameters())
    for x, y in batches(data, 8, 3):
        optimizer.zero_grad(set_to_none=True)
        change(nn.functional.cross_entropy(oracle(x), y), oracle).backward()
        optimizer.step()
        scheduler.step()
    assert_state_close(model.net.state_dict(), oracle.state_dict(), 1e-9)


def test_a_returned_value_that_does_not_depend_on_the_loss_is_refused():
    """Lightning back-propagates what training_step returns: a detached loss has nothing to back-propagate (Lightning
    itself raises), and the gradient the mixin made would be another function's."""
    class Detaching(lit_classifier()):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx).detach()

    with pytest.raises(ValueError, match="returned a value that does not depend on the loss"):
        trainer(precision="64-true").fit(Detaching(tiny_bn(), micro_batch_size=3),
                                         torch.utils.data.DataLoader(tiny_dataset(16), batch_size=8))


def test_the_statistics_epoch_leaves_the_gradient_of_a_tensor_outside_the_module_as_it_was():
    """StochasticWeightAveraging's last epoch skips Lightning's backward: the mixin put the module's gradients back
    after its step, but a learnable temperature in the optimizer kept that epoch's. It keeps the last real step's,
    as with a plain LightningModule."""
    def tempered(base: type) -> type:
        class Tempered(base):
            def __init__(self, *args, **kwargs) -> None:
                super().__init__(*args, **kwargs)
                self.temperature = torch.ones((), dtype=torch.float64, requires_grad=True)

            def configure_optimizers(self):
                return torch.optim.SGD([*self.parameters(), self.temperature], lr=0.1)

        return Tempered

    class Plain(pl.LightningModule):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self.net(batch[0]) / self.temperature, batch[1])

    class Ours(lit_classifier()):
        def training_loss(self, batch):
            return nn.functional.cross_entropy(self.net(batch[0]) / self.temperature, batch[1])

    data = tiny_dataset(16)
    ours, plain = tempered(Ours)(tiny_bn(), micro_batch_size=3), tempered(Plain)(tiny_bn())
    for module in (ours, plain):
        averaging = pl.callbacks.StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
        trainer(precision="64-true", max_steps=-1, max_epochs=3, callbacks=[averaging]).fit(
            module, torch.utils.data.DataLoader(data, batch_size=8))
    assert plain.temperature.grad is not None
    torch.testing.assert_close(ours.temperature.grad, plain.temperature.grad, rtol=1e-9, atol=0)


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_a_learnable_tensor_outside_the_module_starts_each_step_from_no_gradient(factor):
    """A temperature held outside the module's parameters, in the optimizer: Lightning zeroes its gradient before
    each step's backward, and the mixin, which keeps Lightning's zeroing off, left it to add up over the steps (the
    network 0.012 off after 3 steps). A factor on the loss training_step returns scales its gradient too. 3 steps
    against whole-batch training, float64."""
    class Tempered(lit_classifier()):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.temperature = torch.ones((), dtype=torch.float64, requires_grad=True)

        def training_loss(self, batch):
            return nn.functional.cross_entropy(self.net(batch[0]) / self.temperature, batch[1])

        def training_step(self, batch, batch_idx):
            return factor * super().training_step(batch, batch_idx)

        def configure_optimizers(self):
            return torch.optim.SGD([*self.parameters(), self.temperature], lr=0.5)

    data = tiny_dataset(24)
    model = Tempered(tiny_bn(), micro_batch_size=3)
    trainer(precision="64-true").fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    oracle, temperature = tiny_bn(), torch.ones((), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.SGD([*oracle.parameters(), temperature], lr=0.5)
    for x, y in batches(data, 8, 3):
        optimizer.zero_grad(set_to_none=True)
        (factor * nn.functional.cross_entropy(oracle(x) / temperature, y)).backward()
        optimizer.step()
    assert_state_close(model.net.state_dict(), oracle.state_dict(), 1e-9)
    assert_state_close({"temperature": model.temperature}, {"temperature": temperature}, 1e-12)


def test_stochastic_weight_averaging_trains_as_with_whole_batches():
    """StochasticWeightAveraging averages the weights of epochs 1 and 2, then runs one more epoch that recomputes the
    BatchNorm statistics with Lightning's backward skipped: the mixin back-propagated there anyway, and its gradient
    moved the averaged weights (0.17 off). Against a plain LightningModule with the whole batches, float64."""
    class Plain(pl.LightningModule):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Averaged(lit_classifier()):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = tiny_dataset(16)
    ours, plain = Averaged(tiny_bn(), micro_batch_size=3), Plain(tiny_bn())
    for module in (ours, plain):
        averaging = pl.callbacks.StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
        trainer(precision="64-true", max_steps=-1, max_epochs=3, callbacks=[averaging]).fit(
            module, torch.utils.data.DataLoader(data, batch_size=8))
    assert int(plain.net[1].num_batches_tracked) == 2  # the statistics recomputed: one epoch of two batches
    assert_state_close(ours.net.state_dict(), plain.net.state_dict(), 1e-9)


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_module_trains_like_whole_batch_training():
    """trainer.fit(torch.compile(module, backend="aot_eager")), 3 steps over batches of 8 as micro-batches 3 + 3 + 2,
    float64, clipped, the LR halved every step: Lightning compiles training_step, which the mixin hands back
    uncompiled for each micro-batch's training_loss to run compiled; dynamo compiles graphs between the BatchNorm
    calls, and the parameters and running statistics are whole-batch PyTorch's."""
    from torch._dynamo.utils import counters

    data = tiny_dataset(16)
    model = lit_classifier()(TinyUnrolled(), micro_batch_size=3)
    trainer(precision="64-true", gradient_clip_val=CLIP).fit(torch.compile(model, backend="aot_eager"),
                                                             torch.utils.data.DataLoader(data, batch_size=8))
    assert counters["stats"]["unique_graphs"] > 0
    oracle = TinyUnrolled()
    _, norms = train_whole_batch(oracle, batches(data, 8, 3), max_grad_norm=CLIP)
    assert min(norms) > CLIP  # clipping is part of what is compared
    assert_state_close(model.net.state_dict(), oracle.state_dict(), 1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_plugins_autocast_and_scale(precision):
    """bf16-mixed, and 16-mixed with Lightning's GradScaler (its CUDA set-up, given to a CPU run as a plugin):
    the forward runs in the low precision, and the trained state is as close to float64 whole-batch training as
    whole-batch PyTorch under the same autocast is (a gradient left scaled, or unscaled twice, would be off by the
    scale, 2**12)."""
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}[precision]
    data = tiny_dataset(16, torch.float32)
    model = lit_classifier()(accumnorm.convert(tiny_bn(torch.float32)), micro_batch_size=3)
    seen = set()
    model.net[0].register_forward_hook(lambda module, inputs, output: seen.add(output.dtype))
    plugin = (dict(plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**12))])
              if precision == "16-mixed" else dict(precision=precision))
    run = trainer(gradient_clip_val=CLIP, **plugin)
    run.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    assert seen == {dtype}
    if precision == "16-mixed":
        assert run.precision_plugin.scaler.get_scale() == 2.0**12  # no step overflowed
    oracle, truth = tiny_bn(torch.float32), tiny_bn(torch.float64)
    train_whole_batch(oracle, batches(data, 8, 3), max_grad_norm=CLIP, autocast=dtype)
    train_whole_batch(truth, [(x.double(), y) for x, y in batches(data, 8, 3)], max_grad_norm=CLIP)
    assert_state_within_rounding(model.net.state_dict(), oracle.state_dict(), truth.state_dict(),
                                 tol=torch.finfo(dtype).eps, slack=2.0)


# name: (class attributes that replace the test module's, Trainer arguments, what to do to the model or
# data, the error, words of its message)
MISUSES = {
    "accumulate_grad_batches": ({}, dict(accumulate_grad_batches=2), None, ValueError,
                                "Trainer(accumulate_grad_batches=2) accumulates with each batch's own BatchNorm"),
    "no optimizer": (dict(configure_optimizers=lambda self: None), {}, None, ValueError,
                     "return an optimizer over self.parameters()"),
    "foreign optimizer": (dict(configure_optimizers=lambda self: torch.optim.SGD(nn.Linear(2, 2).parameters(), 0.1)),
                          {}, None, ValueError, "steps 2 tensors, 2 of them not parameters of Model"),
    "GradientAccumulationScheduler": ({}, dict(callbacks=[GradientAccumulationScheduler({0: 2})]), None, ValueError,
                                      "GradientAccumulationScheduler accumulates with each batch's own BatchNorm"),
    "manual optimization": (dict(automatic_optimization=False), {}, None, ValueError,
                            "sets automatic_optimization = False"),
    "own backward": (dict(backward=lambda self, loss, *args, **kwargs: loss.backward()), {}, None, ValueError,
                     "overrides backward(), which ExactAccumulation implements"),
    "no training_loss": (dict(training_loss=ExactAccumulation.training_loss), {}, None, ValueError,
                         "must implement training_loss(self, batch)"),
    "training_step skips super": (dict(training_step=lambda self, batch, batch_idx: self.training_loss(batch)), {},
                                  None, RuntimeError, "return super().training_step(batch, batch_idx)"),
    "unsplittable batch": ({}, {}, "names", TypeError,
                           "batch[2] must be a Tensor or a list of per-sample items, got tuple"),
}


@pytest.mark.parametrize("misuse", MISUSES)
def test_misuse_raises_before_any_step(misuse):
    """Each wrong set-up raises with a message saying what to change, and no parameter or statistic moves.
    All but two are found at set-up; a batch that cannot be split, when it arrives; a training_step that
    skips the mixin's, at the first backward (Lightning's call that the mixin owns), before the step."""
    attributes, kwargs, change, error, message = MISUSES[misuse]
    net = accumnorm.convert(tiny_bn(torch.float32))
    before = copy.deepcopy(net.state_dict())
    data = tiny_dataset(8, torch.float32)
    if change == "names":  # a list of strings in each batch: nothing accumnorm can cut into micro-batches
        data = [(x, y, "a name") for x, y in data]
    model = type("Model", (lit_classifier(),), attributes)(net, micro_batch_size=3)
    with pytest.raises(error, match=re.escape(message)):
        trainer(**kwargs).fit(model, torch.utils.data.DataLoader(data, batch_size=4))
    if misuse == "training_step skips super":  # found at the first backward: the override's own forward has
        before = {k: v for k, v in before.items() if "running" not in k and "num_batches" not in k}  # moved stats
    assert_state_close({k: net.state_dict()[k] for k in before}, before, 0.0)


def test_the_mixin_after_lightning_module_in_the_bases_is_refused_when_the_class_is_made():
    with pytest.raises(TypeError, match=re.escape("write class Late(ExactAccumulation, L.LightningModule)")):
        type("Late", (pl.LightningModule, ExactAccumulation), {})


def test_a_fit_under_recompute_resumed_from_its_checkpoint_steps_as_one_that_never_stopped(tmp_path):
    """timm's LCNet, whose smallest blocks recompute runs as they are from its second step on (a BatchNorm call there
    rounds otherwise than in a checkpointed block): the checkpoint keeps recompute's measurements, and the resumed
    fit's first step is bit for bit the step of a fit that never stopped. Two steps an epoch, so both see the same
    batches."""
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(24, 3, 32, 32, generator=g), torch.randint(0, 10, (24,),
                                                                                                 generator=g))
    torch.manual_seed(0)
    start = timm_model()

    def fit(steps: int, **kwargs) -> pl.LightningModule:
        module = lit_classifier()(copy.deepcopy(start), micro_batch_size=4, schedule="recompute")
        run = trainer(max_steps=steps)
        run.fit(module, torch.utils.data.DataLoader(data, batch_size=12), **kwargs)
        if steps == 2:
            run.save_checkpoint(tmp_path / "step2.ckpt")
        return module

    never_stopped = fit(3)
    fit(2)
    resumed = fit(3, ckpt_path=tmp_path / "step2.ckpt")
    assert_state_close(resumed.state_dict(), never_stopped.state_dict(), 0.0)


@pytest.mark.parametrize("option", SCHEDULE_OPTIONS)
def test_the_schedules_options_reach_the_step(option):
    options = SCHEDULE_OPTIONS[option]
    model = lit_classifier()(tiny_bn(torch.float32), micro_batch_size=3, **options)
    trainer(max_steps=1).fit(model, torch.utils.data.DataLoader(tiny_dataset(8, torch.float32), batch_size=8))
    assert_ran_with(model, options)


@pytest.mark.parametrize("options, error, message", [
    (dict(micro_batch_size=0), ValueError, "micro_batch_size must be >= 1, got 0"),
    (dict(micro_batch_size=2, bn="exactly"), ValueError, "bn must be one of ('exact', 'micro'), got 'exactly'"),
    (dict(micro_batch_size=2, schedule="fast"), ValueError,
     "schedule must be one of ('auto', 'layerwise', 'recompute', 'segments', 'passes')"),
    (dict(micro_batch_size=2, store=3), TypeError, "store must be None, 'cpu' or a torch.device, got int 3"),
    (dict(micro_batch_size=2, memory_budget=-1), ValueError,
     "memory_budget must be a positive number of bytes, got -1"),
    (dict(micro_batch_size=2, schedule="passes", keep_every=2), ValueError,
     "keep_every is the segments schedule's setting, but schedule is 'passes'"),
])
def test_bad_arguments_fail_when_the_module_is_made(options, error, message):
    with pytest.raises(error, match=re.escape(message)):
        lit_classifier()(tiny_bn(), **options)


@pytest.mark.realtime
@pytest.mark.slow
def test_two_gloo_ranks_under_ddp_equal_one_process_with_the_global_batch(tmp_path):
    """2 ranks x micro-batches 3 + 1 of 4 samples each against plain PyTorch on batches of 8, float64, clipped, torch's
    BatchNorm unconverted and the passes schedule: DDP's own gradient reduction must not add to accumnorm's (a
    second average halves the gradient) nor wait for a backward that never comes (a hang, bounded here by timeouts).
    training_step adds a penalty to the loss it returns: its gradient is the ranks' mean, as DDP's would be."""
    results = launch_ranks([str(PROGRAM), str(tmp_path), str(CLIP)], tmp_path, wait_s=900)
    assert_ranks_ended_well(results)
    assert_ranks_trained_like_whole_batch(tmp_path, 2, tiny_bn(), CLIP, penalty=small_penalty)
