"""Cases no schedule can make exact, refused under every schedule before anything changes: a micro-batch whose
BatchNorm call runs under torch.no_grad while the others' run with grad; a batch norm that
runs inside a custom autograd.Function, whose backward is its own (a setup_context-style one defined inside a
function, recomputing an untracked BatchNorm in its backward)."""
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
    with pytest.raises(ValueError, match="micro-batch 1 differs in grad mode.*Nothing was changed.*bn='micro'"):
        accumnorm.backward(model, (x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]), micro_batch_size=2,
                           schedule=schedule)
    assert_unchanged(model, snap)
    assert torch.equal(torch.random.get_rng_state(), rng)


def _recomputing_batch_norm() -> type[torch.autograd.Function]:
    """A setup_context-style Function, defined inside a function, whose forward runs an untracked batch norm under
    no_grad and whose backward recomputes it with grad: a batch norm of the backward's own."""

    class RecomputedNorm(torch.autograd.Function):
        @staticmethod
        def forward(x, weight):
            with torch.no_grad():
                return F.batch_norm(x, None, None, weight, None, training=True)

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(*inputs)

        @staticmethod
        def backward(ctx, grad):
            x, weight = ctx.saved_tensors
            with torch.enable_grad():
                x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
                y = F.batch_norm(x, None, None, weight, None, training=True)
                return torch.autograd.grad(y, (x, weight), grad)

    return RecomputedNorm


class _FunctionNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(4, 6), nn.Linear(6, 3)
        self.weight = nn.Parameter(torch.rand(6) + 0.5)
        self.norm = _recomputing_batch_norm()

    def forward(self, x):
        return self.head(torch.tanh(self.norm.apply(self.lin(x), self.weight)))


@pytest.mark.parametrize("whole", [False, True], ids=["loss per micro-batch", "whole-batch loss"])
@pytest.mark.parametrize("schedule", STEP_SCHEDULES)
def test_a_batch_norm_in_a_custom_function_defined_in_a_function_is_refused(schedule, whole):
    torch.manual_seed(0)
    model = _FunctionNorm()
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    snap, rng = snapshot(model), torch.random.get_rng_state()
    with pytest.raises(ValueError, match="inside the forward of the custom autograd.Function RecomputedNorm.*Nothing"):
        if whole:
            accumnorm.backward(model, x, micro_batch_size=2, forward_fn=lambda m, b: m(b),
                               batch_loss_fn=F.cross_entropy, targets=y, schedule=schedule)
        else:
            accumnorm.backward(model, (x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]), micro_batch_size=2,
                               schedule=schedule)
    assert_unchanged(model, snap)
    assert torch.equal(torch.random.get_rng_state(), rng)
