"""The forwards torch's own layers get for a step (`_engine/intercept/forwards.py`): the BatchNorm one follows
torch's `_BatchNorm.forward` line for line, so torch changing its own must not pass unseen."""
import hashlib
import inspect

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

import accumnorm
from accumnorm._engine.intercept.forwards import TORCH_FORWARD_SHA256
from helpers import ce_loss


def test_torchs_batchnorm_forward_is_the_one_the_step_forward_follows():
    source = inspect.getsource(_BatchNorm.forward)
    assert hashlib.sha256(source.encode()).hexdigest() == TORCH_FORWARD_SHA256, (
        "torch's _BatchNorm.forward changed: read it against _batch_norm_in_step in "
        "src/accumnorm/_engine/intercept/forwards.py, bring the copy in line, then record the new hash")


def test_a_step_leaves_torchs_layers_their_class_forward():
    """The step forwards live on the layers for the length of a step only."""
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(3))
    model(torch.randn(2, 1, 6, 6))
    batch = (torch.randn(8, 1, 6, 6), torch.randint(0, 3, (8,)))
    accumnorm.backward(model, batch, ce_loss, micro_batch_size=2)
    assert all("forward" not in vars(m) for m in model.modules())
