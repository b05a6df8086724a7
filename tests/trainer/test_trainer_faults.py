"""The Trainer against bad input and damaged files: each is refused with an error that names what was
expected (and the file), before a step trains or a tensor changes; what a killed run leaves behind
does not block the next one."""
import os
import re

import pytest
import torch
import torch.nn as nn

import accumnorm
from accumnorm import Trainer
from helpers import ce_loss
from models import NoisyDigits, small_net

pytestmark = pytest.mark.usefixtures("one_thread")


def _trainer(optimizer=torch.optim.SGD, scheduler=None, groups=1, **kwargs):
    model = accumnorm.convert(small_net())
    params = list(model.parameters())
    opt = optimizer([{"params": params[i::groups]} for i in range(groups)], lr=0.1)
    sched = scheduler(opt) if scheduler is not None else None
    return Trainer(model, opt, ce_loss, micro_batch_size=kwargs.pop("micro_batch_size", 4), scheduler=sched, **kwargs)


def _batch(n=8):
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def _state(trainer):
    """Everything that must not change when a call is refused: tensors, optimizer state, step, RNG."""
    return ({k: v.clone() for k, v in trainer.model.state_dict().items()}, repr(trainer.optimizer.state_dict()),
            trainer.step_count, torch.get_rng_state().clone())


def _unchanged(trainer, before):
    tensors, optimizer, step, rng = before
    now = trainer.model.state_dict()
    return (all(torch.equal(now[k], v) for k, v in tensors.items()) and trainer.step_count == step
            and repr(trainer.optimizer.state_dict()) == optimizer and torch.equal(torch.get_rng_state(), rng))


# ---------------------------------------------------------------- construction
@pytest.mark.parametrize("kwargs, error, message", [
    (dict(micro_batch_size=0), ValueError, "micro_batch_size must be >= 1, got 0"),
    (dict(micro_batch_size=2.5), TypeError, "micro_batch_size must be an int, got float 2.5"),
    (dict(micro_batch_size=True), TypeError, "micro_batch_size must be an int, got bool True"),
    (dict(bn="exactly"), ValueError, r"bn must be one of \('exact', 'micro'\), got 'exactly'"),
    (dict(schedule="fast"), ValueError,
     r"schedule must be one of \('auto', 'layerwise', 'recompute', 'segments', 'passes'\), got 'fast'"),
    (dict(store="disk"), ValueError, "store must be None, 'cpu' or a torch.device, got the string 'disk'"),
])
def test_trainer_and_load_refuse_what_backward_would_refuse(tmp_path, kwargs, error, message):
    with pytest.raises(error, match=message):
        _trainer(**kwargs)
    saved = _trainer()
    saved.save(tmp_path / "ckpt.pt")
    other = _trainer()
    before = _state(other)
    with pytest.raises(error, match=message):
        Trainer.load(tmp_path / "ckpt.pt", other.model, other.optimizer, ce_loss, **kwargs)
    assert _unchanged(other, before)


# ---------------------------------------------------------------- fit's arguments
@pytest.mark.parametrize("kwargs, error, message", [
    (dict(checkpoint_every=0), ValueError, "checkpoint_every must be >= 1 or None, got 0"),
    (dict(checkpoint_every=-5), ValueError, "checkpoint_every must be >= 1 or None, got -5"),
    (dict(checkpoint_every=2.5), TypeError, "checkpoint_every must be an int or None, got float 2.5"),
    (dict(eval_every=0), ValueError, "eval_every must be >= 1 or None, got 0"),
    (dict(eval_every=True), TypeError, "eval_every must be an int or None, got bool True"),
    (dict(steps=-1), ValueError, "steps must be >= 0 or None, got -1"),
    (dict(epochs=1.5), TypeError, "epochs must be an int or None, got float 1.5"),
    (dict(epochs="2"), TypeError, "epochs must be an int or None, got str '2'"),
])
def test_fit_refuses_bad_periods_before_a_step_trains(tmp_path, kwargs, error, message):
    """A value of the wrong type is a TypeError, as the Trainer's own arguments' are; one out of range a
    ValueError."""
    trainer = _trainer()
    before = _state(trainer)
    loader = torch.utils.data.DataLoader(NoisyDigits(16), batch_size=8, shuffle=True)
    with pytest.raises(error, match=re.escape(message)):
        trainer.fit(loader, **{"steps": 3, **kwargs}, eval_fn=lambda m: 0.0, log=tmp_path / "log")
    assert _unchanged(trainer, before) and not (tmp_path / "log").exists()


def test_fit_refuses_a_log_that_is_a_file(tmp_path):
    trainer = _trainer()
    (tmp_path / "log").write_text("mine")
    with pytest.raises(ValueError, match=f"log must be a directory, but {re.escape(str(tmp_path / 'log'))} is a file"):
        trainer.fit([_batch()], steps=1, log=tmp_path / "log")
    assert trainer.step_count == 0 and (tmp_path / "log").read_text() == "mine"


# ---------------------------------------------------------------- checkpoints that do not fit
def test_load_refuses_a_checkpoint_of_another_optimizer_saying_what_differs(tmp_path):
    """An Adam checkpoint used to load into an SGD trainer, whose first step then raised KeyError: 'momentum'."""
    adam = _trainer(torch.optim.Adam)
    adam.step(_batch())
    adam.save(tmp_path / "adam.pt")
    for optimizer, groups, message in [
        (torch.optim.SGD, 1, r"optimizer: a Adam in checkpoint, a SGD in this trainer; resume with the optimizer"),
        (torch.optim.Adam, 2, r"optimizer: 1 param group of 10 tensors in checkpoint, 2 param groups of 5, 5 tensors"),
    ]:
        other = _trainer(optimizer, groups=groups)
        before = _state(other)
        with pytest.raises(ValueError, match=rf"{re.escape(str(tmp_path / 'adam.pt'))}: the checkpoint does not fit "
                                             rf"this trainer:\n  {message}"):
            Trainer.load(tmp_path / "adam.pt", other.model, other.optimizer, ce_loss)
        assert _unchanged(other, before)


def test_load_refuses_a_checkpoint_of_another_scheduler(tmp_path):
    def step_lr(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2)

    def exponential(opt):
        return torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)

    _trainer(scheduler=step_lr).save(tmp_path / "ckpt.pt")
    other = _trainer(scheduler=exponential)
    before = _state(other)
    with pytest.raises(ValueError, match="scheduler: a StepLR in checkpoint, a ExponentialLR in this trainer"):
        Trainer.load(tmp_path / "ckpt.pt", other.model, other.optimizer, ce_loss, scheduler=other.scheduler)
    assert _unchanged(other, before) and other.scheduler.get_last_lr() == [0.1]


# ---------------------------------------------------------------- damaged checkpoint files
def _flip_a_weight_bit(raw: bytes, weight: torch.Tensor) -> bytes:
    at = raw.find(weight.detach().numpy().tobytes())
    assert at > 0
    return raw[:at] + bytes([raw[at] ^ 0x10]) + raw[at + 1:]


@pytest.mark.parametrize("damage", ["truncated", "empty", "bit-flipped", "text"])
def test_load_of_a_damaged_checkpoint_names_the_file(tmp_path, damage):
    """torch.load raised OSError Errno 22 (truncated), EOFError (empty), KeyError (text), and loaded a flipped bit in a
    weight as a wrong number without a word: torch does not check its zip records' CRC-32."""
    saved = _trainer()
    path = tmp_path / "checkpoint.pt"
    saved.save(path)
    raw = path.read_bytes()
    path.write_bytes({"truncated": raw[: len(raw) // 2], "empty": b"", "text": b"step,loss\n1,0.5\n",
                      "bit-flipped": _flip_a_weight_bit(raw, saved.model[0].weight)}[damage])
    other = _trainer()
    before = _state(other)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))} is truncated or corrupt"):
        Trainer.load(path, other.model, other.optimizer, ce_loss)
    assert _unchanged(other, before)


def test_load_of_a_file_that_is_no_checkpoint_or_none_at_all(tmp_path):
    other = _trainer()
    torch.save({"a": 1}, tmp_path / "plain.pt")
    with pytest.raises(ValueError, match=rf"{re.escape(str(tmp_path / 'plain.pt'))} is not an accumnorm checkpoint "
                                         r"\(it has no config, model, optimizer"):
        Trainer.load(tmp_path / "plain.pt", other.model, other.optimizer, ce_loss)
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "missing.pt"))):
        Trainer.load(tmp_path / "missing.pt", other.model, other.optimizer, ce_loss)


def test_a_checkpoint_written_before_measurements_were_kept_loads_and_resumes(tmp_path):
    saved = _trainer()
    state = saved.state_dict()
    del state["measurements"]
    torch.save(state, tmp_path / "older.pt")
    other = _trainer()
    loaded = Trainer.load(tmp_path / "older.pt", other.model, other.optimizer, ce_loss)
    batch = next(iter(torch.utils.data.DataLoader(NoisyDigits(8), batch_size=8)))
    losses = []
    for trainer in (loaded, saved):
        torch.manual_seed(0)  # the same dropout masks
        losses.append(trainer.step(batch))
    assert losses[0] == losses[1]
    assert all(torch.equal(a, b) for a, b in zip(other.model.state_dict().values(), saved.model.state_dict().values()))


def test_load_of_a_checkpoint_whose_recompute_measurements_are_damaged_changes_nothing(tmp_path):
    saved = _trainer()
    state = saved.state_dict()
    state["measurements"] = {"saved": [1.0]}
    torch.save(state, tmp_path / "odd.pt")
    other = _trainer()
    before = _state(other)
    with pytest.raises(ValueError, match=rf"{re.escape(str(tmp_path / 'odd.pt'))}: its recompute measurements are not "
                                         r"a dict of saved, handed_on, output_bytes"):
        Trainer.load(tmp_path / "odd.pt", other.model, other.optimizer, ce_loss)
    assert _unchanged(other, before)


# ---------------------------------------------------------------- what a killed run leaves behind
def test_save_removes_the_temporary_files_that_killed_saves_left(tmp_path):
    """kill -9 during torch.save leaves .checkpoint.pt.<pid>.tmp behind; the next save of that checkpoint removes
    every such file, whatever pid wrote it, and leaves other files alone."""
    stale = [f".checkpoint.pt.{pid}.tmp" for pid in (12345, os.getpid())]
    others = [".other.pt.12345.tmp", ".checkpoint.pt.notes.tmp", "checkpoint.pt.12345.tmp"]
    for name in stale + others:
        (tmp_path / name).write_bytes(b"half a checkpoint")
    trainer = _trainer()
    trainer.save(tmp_path / "checkpoint.pt")
    assert sorted(os.listdir(tmp_path)) == sorted(["checkpoint.pt", *others])
    assert Trainer.load(tmp_path / "checkpoint.pt", trainer.model, trainer.optimizer, ce_loss).step_count == 0


@pytest.mark.parametrize("damage", ["garbage", "cut short"])
def test_a_damaged_metrics_row_is_named_skipped_and_written_out(tmp_path, damage):
    """A garbled row of metrics.csv used to stop the resume with `invalid literal for int()`."""
    loader = torch.utils.data.DataLoader(NoisyDigits(16), batch_size=8)
    _trainer().fit(loader, steps=2, log=tmp_path, checkpoint_every=2)
    path = tmp_path / "metrics.csv"
    lines = path.read_text().splitlines(keepends=True)
    if damage == "garbage":
        lines.insert(3, "x7,lo\x00ss,,\n")
        expect = "line 4: 4 values, expected 3"
    else:  # a run killed while it logged: the last line has no end
        lines.append("3,los")
        expect = "line 8: cut short"
    path.write_text("".join(lines))
    model = accumnorm.convert(small_net())
    trainer = Trainer.load(tmp_path / "checkpoint.pt", model, torch.optim.SGD(model.parameters(), lr=0.1), ce_loss)
    with pytest.warns(UserWarning, match=rf"{re.escape(str(path))}: skipped .*{expect}.*without them"):
        trainer.fit(loader, steps=4, log=tmp_path)
    lines = path.read_bytes().split(b"\r\n")  # csv's line end, also in the rows written back
    assert lines[0] == b"step,name,value" and lines[-1] == b""
    rows = [(int(step), name, float(value)) for step, name, value in (line.split(b",") for line in lines[1:-1])]
    assert [step for step, name, _ in rows if name == b"loss"] == [1, 2, 3, 4]


def test_fit_is_the_same_loop_after_the_split_into_helpers(tmp_path):
    """Evaluation at eval_every and at the end, checkpoints at checkpoint_every and at the end, one row per metric
    and step."""
    trainer = _trainer()
    evals = []
    last = trainer.fit(torch.utils.data.DataLoader(NoisyDigits(24), batch_size=8), steps=5,
                       eval_fn=lambda m: evals.append(m.training) or {"acc": 0.25}, eval_every=2, log=tmp_path,
                       checkpoint_every=2)
    assert evals == [False] * 3 and last["acc"] == 0.25 and set(last) >= {"loss", "lr", "samples_per_s"}
    assert Trainer.load(tmp_path / "checkpoint.pt", trainer.model, trainer.optimizer, ce_loss).step_count == 5
    assert (trainer.epoch, trainer.batch_in_epoch) == (1, 2)


def test_the_trainer_refuses_a_model_without_parameters_and_a_non_optimizer():
    with pytest.raises(ValueError, match=r"the model \(ReLU\) has no parameters"):
        Trainer(nn.ReLU(), torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), ce_loss, micro_batch_size=2)
    model = small_net()
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer, got list"):
        Trainer(model, list(model.parameters()), ce_loss, micro_batch_size=2)


def test_a_step_that_fails_leaves_the_gradients_as_they_were():
    """A step set every gradient aside before its backward, and one that failed (a NaN loss here) left none: a failed
    step changes nothing, the gradients included."""
    trainer = _trainer()
    for p in trainer.model.parameters():
        p.grad = torch.full_like(p, 7.0)
    before = _state(trainer)
    x, y = _batch()
    with pytest.raises(ValueError, match="loss is not finite"):
        trainer.step((x * float("nan"), y))
    _unchanged(trainer, before)
    assert all(p.grad is not None and bool((p.grad == 7.0).all()) for p in trainer.model.parameters())
