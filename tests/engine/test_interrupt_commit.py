"""A Ctrl-C that lands as a step commits and returns: at every moment from the commit to the return where Python
would run SIGINT's handler (a function's start, the end of a call into C), the step either undoes everything and
raises KeyboardInterrupt, or has returned; never a KeyboardInterrupt with the step's changes made. And one that lands
as the step puts its own SIGINT handler in place: a KeyboardInterrupt, with the caller's handler back."""
from __future__ import annotations

import signal
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import accumnorm
from accumnorm._engine.safety.transaction import Transaction

PATHS = {"layerwise": dict(schedule="layerwise"), "recompute": dict(schedule="recompute"),
         "passes": dict(schedule="passes"), "auto": dict(schedule="auto"), "micro": dict(bn="micro")}


class _Net(nn.Module):
    def __init__(self, norms: bool) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8) if norms else nn.Identity(), nn.Tanh())
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(checkpoint(self.block, x, use_reentrant=False))


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in (*(p.grad for p in model.parameters()), *model.buffers())]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class _SigintAt:
    """Calls SIGINT's handler, as Python would for a SIGINT landing there, at the n-th moment while `armed` (after the
    step's commit, while it takes SIGINT) where Python runs signal handlers: a Python function's start, or the return
    of a call into C."""

    def __init__(self, n: int) -> None:
        self.n, self.armed, self.seen = n, False, 0

    def __call__(self, frame, event: str, arg) -> None:
        if not self.armed or event not in ("call", "c_return"):
            return
        self.seen += 1
        if self.seen == self.n + 1:
            sys.setprofile(None)
            handler = signal.getsignal(signal.SIGINT)
            if callable(handler):
                handler(signal.SIGINT, frame)


@pytest.mark.parametrize("whole", [False, True], ids=["loss per micro-batch", "whole-batch loss"])
@pytest.mark.parametrize("path", PATHS)
def test_a_sigint_as_the_step_commits_undoes_it_or_comes_after_the_return(path, whole, monkeypatch, one_thread):
    torch.manual_seed(0)
    # With a whole-batch loss, "auto" on a model without norm statistics runs one micro-batch at a time (GradCache).
    model = _Net(norms=not (whole and path == "auto"))
    x, y = torch.randn(6, 6), torch.randint(0, 4, (6,))
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)

    def step() -> None:
        if whole:
            accumnorm.backward(model, x, micro_batch_size=2, forward_fn=lambda m, b: m(b),
                               batch_loss_fn=F.cross_entropy, targets=y, **PATHS[path])
        else:
            accumnorm.backward(model, (x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]), micro_batch_size=2,
                               **PATHS[path])

    injected: list[_SigintAt] = []
    commit = Transaction.commit

    def committing(self) -> None:
        commit(self)
        if injected:
            injected[-1].armed = True

    monkeypatch.setattr(Transaction, "commit", committing)
    try:
        step()  # gradients to keep
        before, rng = _state(model), torch.random.get_rng_state()
        late = []
        for n in range(10_000):
            torch.random.set_rng_state(rng)
            injected.append(_SigintAt(n))
            sys.setprofile(injected[-1])
            try:
                step()
            except KeyboardInterrupt:
                if not (_same(_state(model), before) and torch.equal(torch.random.get_rng_state(), rng)):
                    late.append(n)
                continue
            finally:
                sys.setprofile(None)
            assert injected[-1].seen <= n, f"moment {n}: the handler was called and the step returned"
            break
    finally:
        signal.signal(signal.SIGINT, previous)
    assert n > 0
    assert late == [], f"a KeyboardInterrupt with the step's changes made, at moments {late} of {n} after the commit"


@pytest.mark.parametrize("path", ["layerwise", "micro"])
def test_a_sigint_as_the_step_takes_sigint_raises_it_and_gives_the_handler_back(path, monkeypatch, one_thread):
    """A SIGINT at every moment while the step puts its handler in place (the moment after the handler is set, inside
    `signal.signal`, among them): the step raises KeyboardInterrupt with nothing changed, and SIGINT's handler is the
    caller's again, so that the next Ctrl-C is a KeyboardInterrupt too."""
    from accumnorm._engine.safety.interrupts import SigintDeferred

    torch.manual_seed(0)
    model = _Net(norms=True)
    x, y = torch.randn(6, 6), torch.randint(0, 4, (6,))
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)

    def step() -> None:
        accumnorm.backward(model, (x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]), micro_batch_size=2,
                           **PATHS[path])

    injected: list[_SigintAt] = []
    start = SigintDeferred.start

    def starting(self) -> None:
        injected[-1].armed = True
        try:
            start(self)
        finally:
            injected[-1].armed = False

    monkeypatch.setattr(SigintDeferred, "start", starting)
    try:
        injected.append(_SigintAt(-1))
        step()  # gradients to keep
        before = _state(model)
        outcomes = []
        for n in range(1000):
            injected.append(_SigintAt(n))
            sys.setprofile(injected[-1])
            try:
                step()
                outcomes.append("returned")
            except KeyboardInterrupt:
                outcomes.append("interrupted" if _same(_state(model), before) else "interrupted, changed")
            except Exception as e:  # an interrupt must come out as itself
                outcomes.append(f"{type(e).__name__}: {e}")
            finally:
                sys.setprofile(None)
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, f"moment {n}: SIGINT's handler"
            if injected[-1].seen <= n:  # the step took SIGINT before this moment came
                break
            with torch.no_grad():
                for t, saved in zip((*(p.grad for p in model.parameters()), *model.buffers()), before):
                    t.copy_(saved)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert outcomes[-1] == "returned" and len(outcomes) > 2
    assert set(outcomes[:-1]) == {"interrupted"}, outcomes
