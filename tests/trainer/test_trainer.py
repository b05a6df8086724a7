"""The Trainer in one process: exact steps against whole-batch PyTorch, the fit loop and its logs,
checkpoints that resume bit for bit after a real SIGKILL, bf16 autocast, and clear errors.

The killed and resumed runs are tests/programs/trainer_resume.py, each in a fresh process.
"""
import contextlib
import copy
import csv
import json
import os
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import accumnorm
from accumnorm import Trainer
from helpers import (
    SCHEDULE_OPTIONS,
    assert_ran_with,
    assert_state_close,
    ce_loss,
    child_env,
    rel_err,
    sgd_halving,
    train_whole_batch,
)
from models import NoisyDigits, TinyUnrolled, small_net, timm_model, tiny_dataset, vgg
from programs.trainer_resume import KILL_IN_STEP, RESUME_STEPS

PROGRAM = Path(__file__).parents[1] / "programs" / "trainer_resume.py"
pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def read_metrics(directory: Path) -> list[dict]:
    with open(directory / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


# ---------------------------------------------------------------- exactness in one process
def test_step_equals_whole_batch_pytorch_including_a_short_last_batch():
    """micro_batch_size 4 on batches of 12, 12 and 7 (a short last batch: 4 + 3), with clipping and a
    scheduler, against one forward/backward per whole batch with torch's BatchNorm."""
    sizes = [12, 12, 7]
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes]

    def make(model):
        model.eval()  # no dropout: the two runs draw different random masks
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    oracle = small_net()
    opt, sched = make(oracle)
    oracle_losses = []
    for b in data:
        opt.zero_grad()
        loss = ce_loss(oracle, b)
        loss.backward()
        nn.utils.clip_grad_norm_(oracle.parameters(), 0.5)
        opt.step()
        sched.step()
        oracle_losses.append(loss.item())

    model = accumnorm.convert(small_net())
    opt, sched = make(model)
    trainer = Trainer(model, opt, ce_loss, micro_batch_size=4, scheduler=sched, max_grad_norm=0.5)
    losses = [trainer.step(b) for b in data]
    assert losses == pytest.approx(oracle_losses, rel=1e-5)
    assert trainer.step_count == 3 and sched.get_last_lr() == [0.2 * 0.5 ** 3]
    for key, want in oracle.state_dict().items():
        assert rel_err(model.state_dict()[key], want) < 1e-5, key


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_model_trains_like_whole_batch_pytorch_and_checkpoints_its_uncompiled_keys(tmp_path):
    """compile={"backend": "aot_eager"}, float64, micro-batches of 3 over batches of 8, 8 and 5, clipped, the LR
    halved every step, torch's BatchNorm unconverted: dynamo compiles graphs, and the losses, parameters and running
    statistics are whole-batch PyTorch's. The checkpoint holds the uncompiled model's keys, and a compiled trainer
    loaded from it takes the next step as the trainer that wrote it does."""
    from torch._dynamo.utils import counters

    x, y = tiny_dataset(21)[:]
    data = [(x[:8], y[:8]), (x[8:16], y[8:16]), (x[16:], y[16:])]
    clip = 0.05
    model = TinyUnrolled()
    optimizer, scheduler = sgd_halving(model.parameters())
    trainer = Trainer(model, optimizer, ce_loss, micro_batch_size=3, scheduler=scheduler, max_grad_norm=clip,
                      compile={"backend": "aot_eager"})
    losses = [trainer.step(b) for b in data]
    assert counters["stats"]["unique_graphs"] > 0  # the forward ran compiled, between its BatchNorm calls
    oracle = TinyUnrolled()
    want, norms = train_whole_batch(oracle, data, max_grad_norm=clip)
    assert min(norms) > clip  # clipping is part of what is compared
    assert losses == pytest.approx(want, rel=1e-12)
    assert_state_close(model.state_dict(), oracle.state_dict(), 1e-9)

    trainer.save(tmp_path / "ckpt.pt")
    assert torch.load(tmp_path / "ckpt.pt")["model"].keys() == TinyUnrolled().state_dict().keys()
    resumed = TinyUnrolled()
    optimizer, scheduler = sgd_halving(resumed.parameters())
    loaded = Trainer.load(tmp_path / "ckpt.pt", resumed, optimizer, ce_loss, scheduler=scheduler,
                          compile={"backend": "aot_eager"})
    assert loaded.step(data[0]) == trainer.step(data[0])
    assert_state_close(resumed.state_dict(), model.state_dict(), 0.0)


@pytest.mark.parametrize("option", SCHEDULE_OPTIONS)
def test_the_schedules_options_reach_every_step_a_resumed_one_and_config_json(option, tmp_path):
    """memory_budget and keep_every go to each step, as schedule does: the steps run with them and stay whole-batch
    PyTorch's; config.json says them; a checkpoint does not keep them (they are the machine's), load takes them."""
    options = SCHEDULE_OPTIONS[option]
    x, y = tiny_dataset(16)[:]
    data = [(x[:8], y[:8]), (x[8:], y[8:])]
    model = TinyUnrolled()
    optimizer, scheduler = sgd_halving(model.parameters())
    trainer = Trainer(model, optimizer, ce_loss, micro_batch_size=3, scheduler=scheduler, **options)
    trainer.fit(data, steps=1, log=tmp_path)
    assert_ran_with(model, options)
    config = json.loads((tmp_path / "config.json").read_text())
    assert {k: config[k] for k in options} == options
    resumed = TinyUnrolled()
    optimizer, scheduler = sgd_halving(resumed.parameters())
    loaded = Trainer.load(tmp_path, resumed, optimizer, ce_loss, scheduler=scheduler, **options)
    assert loaded.step(data[1]) == trainer.step(data[1])
    assert_ran_with(resumed, options)
    oracle = TinyUnrolled()
    train_whole_batch(oracle, data)
    assert_state_close(model.state_dict(), oracle.state_dict(), 1e-9)
    assert_state_close(resumed.state_dict(), model.state_dict(), 0.0)


def test_a_recompute_run_resumed_from_its_checkpoint_steps_as_the_run_that_never_stopped(tmp_path):
    """Recompute chooses its regions from the last step's measurements (timm's LCNet: its smallest blocks run as they
    are from the second step on), and a BatchNorm call rounds otherwise in a checkpointed region than in one that runs
    as it is: the checkpoint keeps the measurements, so that the resumed process's first step chooses as the next step
    of the run that wrote it does, bit for bit."""
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(12, 3, 32, 32, generator=g), torch.randint(0, 10, (12,), generator=g)) for _ in range(3)]
    torch.manual_seed(0)
    start = timm_model()

    def trainer(model: nn.Module) -> Trainer:
        return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), ce_loss,
                       micro_batch_size=4, schedule="recompute")

    model = copy.deepcopy(start)
    run = trainer(model)
    for batch in data[:2]:
        run.step(batch)
    run.save(tmp_path / "ckpt.pt")
    resumed = copy.deepcopy(start)
    Trainer.load(tmp_path / "ckpt.pt", resumed, torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9),
                 ce_loss, schedule="recompute").step(data[2])
    run.step(data[2])
    assert_state_close(resumed.state_dict(), model.state_dict(), 0.0)


@pytest.mark.parametrize("stop", [5, 4, 2, "an epoch"])
def test_a_run_whose_loader_shuffles_with_its_own_generator_resumes_as_it_never_stopped(tmp_path, stop):
    """A DataLoader(generator=...) draws its shuffle from its own generator, which the process's RNG states leave out:
    a run resumed in epoch 2 (stop 5, of 4 batches an epoch) replayed epoch 1's order, and one saved after
    fit(epochs=1) shuffled epoch 2 as epoch 1: 0.48 off the run that never stopped, without a word. The checkpoint
    keeps the loader's generators, at the epoch's start and now."""
    g = torch.Generator().manual_seed(5)
    dataset = torch.utils.data.TensorDataset(torch.randn(38, 6, generator=g, dtype=torch.float64),
                                             torch.randint(0, 3, (38,), generator=g))

    def run() -> tuple[nn.Module, Trainer, torch.utils.data.DataLoader]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).double()
        loader = torch.utils.data.DataLoader(dataset, batch_size=10, shuffle=True,
                                             generator=torch.Generator().manual_seed(3))
        return model, Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), ce_loss,
                              micro_batch_size=4), loader

    model, trainer, loader = run()
    trainer.fit(loader, steps=7, log=None)
    _, first, loader = run()
    if stop == "an epoch":
        first.fit(loader, epochs=1, log=None)
        first.save(tmp_path / "run.pt")
    else:
        first.fit(loader, steps=stop, log=tmp_path / "run", checkpoint_every=stop)
    resumed_model, _, loader = run()
    resumed = Trainer.load(tmp_path / ("run.pt" if stop == "an epoch" else "run"), resumed_model,
                           torch.optim.SGD(resumed_model.parameters(), lr=0.1, momentum=0.9), ce_loss)
    resumed.fit(loader, steps=7, log=None if stop == "an epoch" else tmp_path / "run")
    assert_state_close(resumed_model.state_dict(), model.state_dict(), 0.0)


@pytest.mark.parametrize("options, error, message", [
    (dict(memory_budget=1.5e9), TypeError, "memory_budget must be a number of bytes (an int) or None, got float"),
    (dict(memory_budget=0), ValueError, "memory_budget must be a positive number of bytes, got 0"),
    (dict(keep_every=2), ValueError, "keep_every is the segments schedule's setting, but schedule is 'auto'"),
    (dict(schedule="segments", keep_every=0), ValueError, "keep_every must be >= 1, got 0"),
])
def test_bad_schedule_options_are_refused_when_the_trainer_is_made(options, error, message):
    model = TinyUnrolled()
    with pytest.raises(error, match=re.escape(message)):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), ce_loss, micro_batch_size=2,
                compile={"backend": "aot_eager"}, **options)
    assert all(vars(m).get("_compiled_call_impl") is None for m in model.modules())


def test_a_compile_that_is_not_torch_compiles_keywords_is_refused_and_changes_nothing(tmp_path):
    model = accumnorm.convert(small_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = TinyUnrolled()
    Trainer(other, torch.optim.SGD(other.parameters(), lr=0.1), ce_loss, micro_batch_size=2).save(tmp_path / "other.pt")
    with pytest.raises(ValueError, match="other.pt: "):  # a checkpoint of another model
        Trainer.load(tmp_path / "other.pt", model, opt, ce_loss, compile={"backend": "aot_eager"})
    with pytest.raises(TypeError, match=re.escape("compile must be None or a dict of torch.compile's keyword "
                                                  "arguments, e.g. {'backend': 'aot_eager'}, got bool True")):
        Trainer(model, opt, ce_loss, micro_batch_size=2, compile=True)
    with pytest.raises(TypeError, match=r"compile must hold keyword arguments of torch.compile \(fullgraph, dynamic, "
                                        r"backend, mode.*got \['backnd'\]"):
        Trainer(model, opt, ce_loss, micro_batch_size=2, compile={"backnd": "aot_eager"})
    with pytest.raises(ValueError, match=re.escape("compile={'fullgraph': True} makes each graph break an error, but "
                                                   "bn='exact' needs one at each BatchNorm call")):
        Trainer(model, opt, ce_loss, micro_batch_size=2, compile={"fullgraph": True})
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1, got 0"):  # the other checks come first
        Trainer(model, opt, ce_loss, micro_batch_size=0, compile={"backend": "aot_eager"})
    assert all(vars(m).get("_compiled_call_impl") is None for m in model.modules())


# ---------------------------------------------------------------- fit, logs, errors
def test_fit_runs_epochs_logs_and_evaluates(tmp_path):
    model = accumnorm.convert(small_net())
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), 1e-2), ce_loss, micro_batch_size=3)
    loader = torch.utils.data.DataLoader(NoisyDigits(20), batch_size=8)  # 8, 8, 4 per epoch
    evals = []
    final = trainer.fit(loader, epochs=2, eval_fn=lambda m: evals.append(m.training) or 0.5, eval_every=4,
                        log=tmp_path)
    assert (trainer.step_count, trainer.epoch, trainer.batch_in_epoch) == (6, 2, 0)
    assert evals == [False, False] and final["eval"] == 0.5 and model.training  # at step 4 and at the end
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["effective_batch_size"], config["accumulation_steps"], config["world_size"]) == (8, 3, 1)
    rows = read_metrics(tmp_path)
    assert [int(r["step"]) for r in rows if r["name"] == "loss"] == [1, 2, 3, 4, 5, 6]
    assert [int(r["step"]) for r in rows if r["name"] == "eval"] == [4, 6]
    assert any(tmp_path.glob("events.out.tfevents.*"))  # tensorboard is installed with the dev extra


def test_fit_gives_a_distributed_sampler_each_epoch_number():
    """DistributedSampler shuffles by epoch number: without set_epoch every epoch repeats the first."""
    data = torch.utils.data.TensorDataset(torch.randn(12, 1, 8, 8), torch.arange(12) % 3, torch.arange(12))
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    seen = []

    def recording_loss(model, batch):
        seen.extend(batch[2].tolist())
        return ce_loss(model, batch[:2])

    model = accumnorm.convert(small_net())
    # bn="micro" runs loss_fn once per micro-batch (exact runs it once per pass), so each batch is seen once
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), recording_loss, micro_batch_size=6,
                      bn="micro")
    trainer.fit(torch.utils.data.DataLoader(data, batch_size=6, sampler=sampler), epochs=2, log=None)
    want = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        want += list(sampler)
    assert seen == want and want[:12] != want[12:]


def _sgd_trainer(**kwargs):
    model = accumnorm.convert(small_net())
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), ce_loss, micro_batch_size=4, **kwargs)


def _load(path):
    model = accumnorm.convert(small_net())
    return Trainer.load(path, model, torch.optim.SGD(model.parameters(), lr=0.1), ce_loss)


@pytest.mark.parametrize("checkpoint_every", [3, None])
def test_fit_saves_a_checkpoint_when_it_ends(tmp_path, checkpoint_every):
    """The last checkpoint of steps=10, checkpoint_every=3 was step 9's, and checkpoint_every=None saved none."""
    loader = torch.utils.data.DataLoader(NoisyDigits(24), batch_size=8)
    trainer = _sgd_trainer()
    trainer.fit(loader, steps=10, log=tmp_path, checkpoint_every=checkpoint_every)
    resumed = _load(tmp_path)  # the run's directory: its checkpoint.pt
    assert (resumed.step_count, resumed.epoch, resumed.batch_in_epoch) == (10, 3, 1)
    assert all(torch.equal(v, resumed.model.state_dict()[k]) for k, v in trainer.model.state_dict().items())


def test_fit_stopped_by_an_interrupt_keeps_its_last_periodic_checkpoint(tmp_path):
    """An interrupt may come between the optimizer's update and the step count: no checkpoint is taken then."""
    def interrupted_at_step_4(model):
        if trainer.step_count == 4:
            raise KeyboardInterrupt
        return 0.0

    trainer = _sgd_trainer()
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(torch.utils.data.DataLoader(NoisyDigits(24), batch_size=8), steps=10, eval_fn=interrupted_at_step_4,
                    eval_every=1, log=tmp_path, checkpoint_every=3)
    assert _load(tmp_path / "checkpoint.pt").step_count == 3


def test_the_effective_batch_is_the_loaders_not_the_first_after_a_resume(tmp_path, capsys):
    """Resumed before an epoch's short last batch (8, 8, 4), the header and config.json said "effective batch 4"."""
    loader = torch.utils.data.DataLoader(NoisyDigits(20), batch_size=8)
    _sgd_trainer().fit(loader, steps=2, log=tmp_path)
    capsys.readouterr()
    trainer = _load(tmp_path)
    trainer.fit(loader, steps=3, log=tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["effective_batch_size"], config["accumulation_steps"], config["start_step"]) == (8, 2, 2)
    assert "effective batch 8 = micro-batch 4 x 2 accumulation steps" in capsys.readouterr().out


def test_a_loader_that_does_not_say_its_batch_size_reports_the_largest_batch_seen(tmp_path):
    batches = [(torch.randn(n, 1, 8, 8), torch.randint(0, 3, (n,))) for n in (4, 12, 8)]
    _sgd_trainer().fit(batches, steps=3, log=tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["effective_batch_size"], config["accumulation_steps"]) == (12, 3)


def test_a_fresh_run_into_the_log_of_another_is_refused_and_its_resume_is_not(tmp_path):
    """A second run into runs/accumnorm rewrote metrics.csv from its own step 1 and added TensorBoard files."""
    loader = torch.utils.data.DataLoader(NoisyDigits(16), batch_size=8)
    _sgd_trainer().fit(loader, steps=2, log=tmp_path)
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    fresh = _sgd_trainer()
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    found = ", ".join(sorted(files))
    with pytest.raises(ValueError, match=rf"log '{re.escape(str(tmp_path))}' already holds a run "
                                         rf"\({re.escape(found)}\), which this fresh run would overwrite: pass "
                                         r"another log=, resume"):
        fresh.fit(loader, steps=2, log=tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files and fresh.step_count == 0
    assert all(torch.equal(v, before[k]) for k, v in fresh.model.state_dict().items())
    resumed = _load(tmp_path / "checkpoint.pt")
    resumed.fit(loader, steps=4, log=tmp_path)
    resumed.fit(loader, steps=5, log=tmp_path)  # the trainer that wrote a run carries on in it
    assert [int(r["step"]) for r in read_metrics(tmp_path) if r["name"] == "loss"] == [1, 2, 3, 4, 5]
    other = tmp_path / "other"
    _sgd_trainer().fit(loader, steps=1, log=other)  # a directory of other files than a run's is no run
    assert (other / "checkpoint.pt").exists()


def test_a_run_that_failed_before_its_first_checkpoint_is_replaced_by_the_rerun(tmp_path):
    """A loss_fn with a typo fails at step 1, after the run's logs are open: no checkpoint, nothing to resume. The
    fixed rerun into the same log replaces those files, saying so, where it used to be refused with advice to
    resume a run that had no checkpoint."""
    loader = torch.utils.data.DataLoader(NoisyDigits(16), batch_size=8)
    broken = _sgd_trainer()
    broken.loss_fn = lambda m, b: F.cross_entropy(m(b[0]), b[1].float())
    with pytest.raises(RuntimeError):
        broken.fit(loader, steps=2, log=tmp_path)
    assert "checkpoint.pt" not in {p.name for p in tmp_path.iterdir()} and any(tmp_path.iterdir())
    with pytest.warns(UserWarning, match=r"holds a run that left no checkpoint .* this run replaces its files"):
        _sgd_trainer().fit(loader, steps=2, log=tmp_path)
    assert [int(r["step"]) for r in read_metrics(tmp_path) if r["name"] == "loss"] == [1, 2]
    assert (tmp_path / "checkpoint.pt").exists()
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("events.out.")]) <= 1


def test_a_resume_with_another_batch_size_mid_epoch_says_so_and_keeps_the_runs_config(tmp_path):
    """A run stopped 2 batches into an epoch of batches of 8, resumed with batches of 4: the position in the epoch
    counts batches, so the rest of the epoch is other data. A warning says so (none with the same batches), and
    config.json keeps the configuration the run had under "previous"."""
    _sgd_trainer().fit(torch.utils.data.DataLoader(NoisyDigits(32), batch_size=8), steps=2, log=tmp_path)
    same = tmp_path / "same"
    _sgd_trainer().fit(torch.utils.data.DataLoader(NoisyDigits(32), batch_size=8), steps=2, log=same)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same batches: nothing to say
        _load(same / "checkpoint.pt").fit(torch.utils.data.DataLoader(NoisyDigits(32), batch_size=8), steps=3, log=same)
    resumed = _load(tmp_path / "checkpoint.pt")
    with pytest.warns(UserWarning, match=r"with batches of 4 samples per rank where it had 8, 2 batches into an epoch"):
        resumed.fit(torch.utils.data.DataLoader(NoisyDigits(32), batch_size=4), steps=3, log=tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["batch_per_rank"], config["start_step"]) == (4, 2)
    assert (config["previous"]["batch_per_rank"], config["previous"]["start_step"]) == (8, 0)


def test_a_failing_eval_fn_keeps_the_checkpoint_and_names_its_result(tmp_path):
    """eval_fn at the end of a fit returns a matrix: the run's checkpoint is written before it, and the error
    names the result."""
    loader = torch.utils.data.DataLoader(NoisyDigits(16), batch_size=8)
    trainer = _sgd_trainer()
    with pytest.raises(ValueError, match=r"eval_fn returned Tensor of shape \(3, 3\) for 'confusion'"):
        trainer.fit(loader, steps=3, eval_fn=lambda m: {"acc": 0.5, "confusion": torch.zeros(3, 3)}, log=tmp_path)
    assert _load(tmp_path / "checkpoint.pt").step_count == 3


@pytest.mark.parametrize("fails", [False, True], ids=["eval_fn", "eval_fn raising"])
def test_after_an_evaluation_the_model_trains_in_train_mode(fails, tmp_path):
    """eval_fn runs the model in eval mode; after it, returned or raised, every layer is back in the mode it trained
    in, so that a training step updates the BatchNorm statistics (not normalizes with them, silently)."""
    loader = torch.utils.data.DataLoader(NoisyDigits(16), batch_size=8)
    trainer = _sgd_trainer()
    norms = [m for m in trainer.model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    seen = []

    def eval_fn(model):
        seen.append([m.training for m in model.modules()])
        if fails:
            raise RuntimeError("the evaluation fails")
        return 0.5

    with contextlib.nullcontext() if not fails else pytest.raises(RuntimeError, match="the evaluation fails"):
        trainer.fit(loader, steps=1, eval_fn=eval_fn, log=tmp_path)
    assert seen and not any(seen[0])
    assert all(m.training for m in trainer.model.modules())
    counted = [int(m.num_batches_tracked) for m in norms]
    trainer.step(next(iter(loader)))
    assert [int(m.num_batches_tracked) for m in norms] == [n + 1 for n in counted]


def test_a_layer_frozen_in_eval_mode_stays_frozen_through_fit(tmp_path):
    """fit put the whole model in train mode, and a BatchNorm the user froze (eval mode, its running statistics used
    and kept) trained: its running mean moved, and the steps were another model's (1.9e3 off). It stays in eval mode,
    as in a plain PyTorch loop, and the rest of the model trains; the model in eval mode as a whole trains."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    model = small_net()
    model[5].p = 0.0  # no dropout: the two runs would draw other masks
    model[1].eval()  # frozen
    oracle = copy.deepcopy(model)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), ce_loss, micro_batch_size=4)
    trainer.fit(loader, steps=2, log=None)
    assert not model[1].training and model[7].training and model.training
    optimizer = torch.optim.SGD(oracle.parameters(), lr=0.1)
    for batch in loader:
        optimizer.zero_grad()
        ce_loss(oracle, batch).backward()
        optimizer.step()
    assert_state_close(model.state_dict(), oracle.state_dict(), 1e-5)

    model.eval()
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), ce_loss, micro_batch_size=4).fit(
        loader, steps=1, log=None)
    assert all(m.training for m in model.modules())


def test_evaluations_show_in_the_progress_bar_and_in_a_line_each(tmp_path, capsys):
    trainer = _sgd_trainer()
    scores = iter([0.25, 0.5, 0.75])
    trainer.fit(torch.utils.data.DataLoader(NoisyDigits(16), batch_size=8), steps=5,
                eval_fn=lambda m: {"acc": next(scores)}, eval_every=2, log=None)
    out, err = capsys.readouterr()
    assert [line for line in out.splitlines() if line.startswith("step ")] == [
        "step 2: acc 0.25", "step 4: acc 0.5", "step 5: acc 0.75"]
    assert "acc=0.25" in err and "acc=0.75" in err.split("\r")[-1]  # the bar's postfix, up to its last refresh


def test_an_optimizer_that_also_steps_a_learnable_temperature_of_the_loss_trains_it_as_torch_does():
    """The optimizer's check refused any tensor outside the model, saying accumnorm computes no gradient for it; the
    step computes one wherever the loss reaches it, as torch does. Only an optimizer over none of the model's
    parameters (built for a copy) is refused."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 3)).double()
    ours = copy.deepcopy(ref)
    temperatures = [nn.Parameter(torch.tensor(2.0, dtype=torch.float64)) for _ in range(2)]

    def loss_fn(temperature):
        return lambda model, batch: F.cross_entropy(model(batch[0]) / temperature, batch[1])

    x, y = torch.randn(8, 1, 8, 8, dtype=torch.float64), torch.randint(0, 3, (8,))
    optimizers = [torch.optim.SGD([*m.parameters(), t], lr=0.5) for m, t in zip((ref, ours), temperatures)]
    trainer = Trainer(ours, optimizers[1], loss_fn(temperatures[1]), micro_batch_size=2)
    for _ in range(2):  # the temperature's gradient starts from none at each step, as the model's does
        optimizers[0].zero_grad()
        loss_fn(temperatures[0])(ref, (x, y)).backward()
        optimizers[0].step()
        trainer.step((x, y))
    assert_state_close(ours.state_dict(), ref.state_dict(), 1e-10)
    torch.testing.assert_close(temperatures[1], temperatures[0], rtol=1e-12, atol=0)
    assert float(temperatures[1]) != 2.0


def test_bad_arguments_are_clear_errors(tmp_path):
    model = accumnorm.convert(small_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="amp='fp16' needs the model on a CUDA device.*on cpu"):
        Trainer(model, opt, ce_loss, micro_batch_size=2, amp="fp16")
    with pytest.raises(ValueError, match="amp must be None, 'bf16' or 'fp16', got 'fp8'"):
        Trainer(model, opt, ce_loss, micro_batch_size=2, amp="fp8")
    with pytest.raises(ValueError, match=r"the optimizer \(SGD\) steps \d+ tensors, \d+ of them not parameters of "
                                         r"Sequential.*after any copy of the model"):
        Trainer(copy.deepcopy(model), opt, ce_loss, micro_batch_size=2)  # an optimizer built before the copy
    with pytest.raises(TypeError, match=r"scheduler ReduceLROnPlateau needs arguments to step.*Step it yourself"):
        Trainer(model, opt, ce_loss, micro_batch_size=2, scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    with pytest.raises(TypeError, match="max_grad_norm must be a number or None, got str '1'"):
        Trainer(model, opt, ce_loss, micro_batch_size=2, max_grad_norm="1")
    trainer = Trainer(model, opt, ce_loss, micro_batch_size=2)
    (tmp_path / "afile").write_text("")
    with pytest.raises(ValueError, match=r"log must be a directory, but .*afile is a file \(in the path .*sub\)"):
        trainer.fit([], steps=3, log=tmp_path / "afile" / "sub")
    with pytest.raises(ValueError, match="steps=, epochs="):
        trainer.fit([], log=None)
    with pytest.raises(ValueError, match="checkpoint_every needs a log directory"):
        trainer.fit([], steps=3, log=None, checkpoint_every=1)
    with pytest.raises(ValueError, match="the loader yielded no batches in epoch 0"):
        trainer.fit([], steps=3, log=tmp_path)
    assert trainer.step_count == 0


def test_checkpoint_of_another_model_names_the_keys_and_changes_nothing(tmp_path):
    model = accumnorm.convert(small_net())
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), ce_loss,
                      micro_batch_size=2).save(tmp_path / "ckpt.pt")
    torch.manual_seed(5)
    other = accumnorm.convert(nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
                                            nn.MaxPool2d(2), nn.Flatten(), nn.Dropout(), nn.Linear(6 * 4 * 4, 32)))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError) as error:
        Trainer.load(tmp_path / "ckpt.pt", other, torch.optim.SGD(other.parameters(), lr=0.1), ce_loss)
    message = str(error.value)
    assert "missing in checkpoint" not in message
    assert ("not in model: 7.bias; 7.num_batches_tracked; 7.running_mean; 7.running_var; 7.weight; 9.bias; 9.weight"
            in message)
    assert "shapes differ: 6.weight (16, 96) in checkpoint, (32, 96) in model; 6.bias (16,) in checkpoint" in message
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


def test_save_is_atomic(tmp_path, monkeypatch):
    """A save that dies half way leaves the previous checkpoint whole and no temporary file."""
    model = accumnorm.convert(small_net())
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), ce_loss, micro_batch_size=2)
    path = tmp_path / "ckpt.pt"
    trainer.save(path)
    good = path.read_bytes()
    trainer.step_count = 7

    def dies_half_way(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(OSError, match="disk full"):
        trainer.save(path)
    assert path.read_bytes() == good and os.listdir(tmp_path) == ["ckpt.pt"]


def test_a_step_with_inf_gradients_is_skipped_as_grad_scaler_does():
    """The fp16 path's scaler handling, run on CPU with torch.amp.GradScaler("cpu") in place of the
    CUDA one that amp="fp16" makes: an inf gradient skips the optimizer and the scheduler and halves
    the scale; the next finite step goes through."""
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def sqrt_bias_loss(model, batch):  # d sqrt(b)/db is inf at b = 0, while the loss stays finite
        return F.mse_loss(model(batch[0]), batch[1]) + model.bias.sqrt().sum()

    trainer = Trainer(model, opt, sqrt_bias_loss, micro_batch_size=2, scheduler=sched, max_grad_norm=1.0)
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    batch = (torch.randn(4, 2), torch.randn(4, 1))
    with torch.no_grad():
        model.bias.zero_()
    before = [p.clone() for p in model.parameters()]
    trainer.step(batch)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert (trainer.scaler.get_scale(), sched.get_last_lr(), trainer.step_count) == (512.0, [0.1], 1)
    with torch.no_grad():
        model.bias.fill_(1.0)
    model.zero_grad()
    sqrt_bias_loss(model, batch).backward()
    true_norm = nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    trainer.step(batch)
    assert not torch.equal(model.weight, before[0])
    assert (trainer.scaler.get_scale(), sched.get_last_lr(), trainer.step_count) == (512.0, [0.05], 2)
    assert trainer.grad_norm == pytest.approx(true_norm, rel=1e-5)  # unscaled before clipping, not 512x


# ---------------------------------------------------------------- bf16 autocast
def test_bf16_autocast_on_cpu_trains_the_study_net():
    model = accumnorm.convert(vgg(widths=(32, 64, 128, 256)))  # the study's net at full width
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), 1e-3), ce_loss, micro_batch_size=4,
                                amp="bf16")
    g = torch.Generator().manual_seed(2)
    batch = (torch.randn(16, 1, 16, 16, generator=g), torch.randint(0, 10, (16,), generator=g))
    losses = [trainer.step(batch) for _ in range(8)]
    assert all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0], losses  # it learns the batch
    for name, tensor in model.state_dict().items():
        assert torch.isfinite(tensor.float()).all(), name
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(norms) == 4
    for m in norms:
        assert m.running_mean.dtype == m.running_var.dtype == torch.float32
        assert m.num_batches_tracked == 8 and m.running_var.min() > 0


# ---------------------------------------------------------------- kill and resume
@pytest.mark.realtime
def test_resume_after_sigkill_is_bit_identical(tmp_path):
    """20 steps, against: killed by SIGKILL in step 12, resumed from the step-10 checkpoint in a fresh
    process, 10 more steps. Parameters, optimizer state, RNG and every logged loss are bit-identical."""
    def run(mode, out):
        env = {**child_env(), "CUDA_VISIBLE_DEVICES": ""}
        return subprocess.run([sys.executable, PROGRAM, mode, str(out)], env=env, timeout=600,
                              capture_output=True, text=True)

    full, broken = tmp_path / "full", tmp_path / "broken"
    full.mkdir(), broken.mkdir()
    proc = run("full", full)
    assert proc.returncode == 0, proc.stderr
    proc = run("killed", broken)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not (broken / "final.pt").exists()
    assert max(int(r["step"]) for r in read_metrics(broken)) == KILL_IN_STEP - 1  # logged past the checkpoint
    proc = run("resumed", broken)
    assert proc.returncode == 0, proc.stderr
    want, got = torch.load(full / "final.pt"), torch.load(broken / "final.pt")
    for key, value in want["model"].items():
        assert torch.equal(value, got["model"][key]), key
    for i, state in want["optimizer"]["state"].items():
        assert all(torch.equal(v, got["optimizer"]["state"][i][k]) for k, v in state.items())
    assert want["optimizer"]["param_groups"] == got["optimizer"]["param_groups"]
    assert torch.equal(want["rng"], got["rng"])
    def logged(d):
        return [(r["step"], r["name"], r["value"]) for r in read_metrics(d) if r["name"] != "samples_per_s"]
    assert logged(full) == logged(broken)
    assert [r[0] for r in logged(full) if r[1] == "loss"] == [str(s) for s in range(1, RESUME_STEPS + 1)]
