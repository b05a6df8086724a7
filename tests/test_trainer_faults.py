"""The Trainer against bad input: each is refused with an error that names what was expected, before a
step trains or a tensor changes."""

import pytest
import torch
import torch.nn as nn

import accumnorm
from accumnorm import Trainer
from helpers import ce_loss
from models import small_net

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
    (dict(schedule="fast"), ValueError, r"schedule must be one of \('auto', 'layerwise', 'passes'\), got 'fast'"),
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


def test_the_trainer_refuses_a_model_without_parameters_and_a_non_optimizer():
    with pytest.raises(ValueError, match=r"the model \(ReLU\) has no parameters"):
        Trainer(nn.ReLU(), torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), ce_loss, micro_batch_size=2)
    model = small_net()
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer, got list"):
        Trainer(model, list(model.parameters()), ce_loss, micro_batch_size=2)
