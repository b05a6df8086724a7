"""Cases no schedule can make exact, refused under every schedule before anything changes: a micro-batch whose
BatchNorm call runs under torch.no_grad while the others' run with grad; a batch norm the step did not make that
runs during its backward (a custom autograd.Function recomputing an untracked BatchNorm there)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import accumnorm
from helpers import STEP_SCHEDULES, assert_unchanged, snapshot


class _NoGradForOne(nn.Module):
    """The micro-batch whose first feature is marked runs the BatchNorm call under torch.no_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn, self.head = nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)

    def forward(self, x):
        h = self.lin(x)
        if bool(x[0, 0] > 100):
            with torch.no_grad():
                h = self.bn(h)
        else:
            h = self.bn(h)
        return self.head(torch.tanh(h))


@pytest.mark.parametrize("schedule", STEP_SCHEDULES)
def test_a_batch_norm_call_under_no_grad_in_one_micro_batch_only_is_refused(schedule):
    torch.manual_seed(0)
    model = _NoGradForOne()
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    x[2:4, 0] = 1000.0  # micro-batch 1
    accumnorm.backward(model, (torch.randn(6, 4), y), lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                       micro_batch_size=2, schedule=schedule)  # gradients and statistics to keep
    snap, rng = snapshot(model), torch.random.get_rng_state()
    with pytest.raises(ValueError, match="micro-batch 1 differs in grad mode"):
        accumnorm.backward(model, (x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]), micro_batch_size=2,
                           schedule=schedule)
    assert_unchanged(model, snap)
    assert torch.equal(torch.random.get_rng_state(), rng)
