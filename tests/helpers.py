"""Shared test helpers: the whole-batch oracle and a relative-error measure."""
from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import accumnorm


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """max |a - b| / max(max |b|, floor): relative error against the oracle b."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / max(float(b.abs().max()), floor, 1e-300))


def ce_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def oracle_and_ours(ref: nn.Module) -> tuple[nn.Module, nn.Module]:
    """ref (torch norms) and an independent accumnorm copy of it with the same tensors' values."""
    return ref, accumnorm.convert(copy.deepcopy(ref))


def compare(ref: nn.Module, ours: nn.Module, tol: float) -> dict[str, float]:
    """Worst relative error of gradients and buffers of `ours` against `ref`; asserts each is <= tol.

    Gradients of tensors whose true gradient is ~0 (a conv bias right before BatchNorm) are compared
    against 1% of the largest gradient in the model rather than their own rounding noise.
    """
    grads_ref = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    scale = max(float(g.abs().max()) for g in grads_ref.values())
    errs = {}
    for (n, p), (n2, q) in zip(ref.named_parameters(), ours.named_parameters()):
        assert n == n2
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            errs[f"grad {n}"] = rel_err(q.grad, p.grad, 1e-2 * scale)
    for (n, b), (n2, c) in zip(ref.named_buffers(), ours.named_buffers()):
        assert n == n2 and b.dtype == c.dtype and b.shape == c.shape, n
        errs[f"buffer {n}"] = rel_err(c, b, 1e-6)
    worst = max(errs, key=errs.get)
    assert errs[worst] <= tol, f"{worst}: relative error {errs[worst]:.3g} > {tol}"
    return errs


def exact_vs_whole_batch(ref: nn.Module, ours: nn.Module, batch, micro_batch_size: int, tol: float) -> dict[str, float]:
    """One forward/backward of `ref` over the whole batch against accumnorm.backward(bn="exact") on `ours`:
    the loss, every gradient and every buffer within `tol` (relative)."""
    expected = ce_loss(ref, batch)
    expected.backward()
    loss = accumnorm.backward(ours, batch, ce_loss, micro_batch_size=micro_batch_size, bn="exact")
    assert rel_err(loss, expected) <= tol
    return compare(ref, ours, tol)


def child_env() -> dict[str, str]:
    """The environment of a program run as a subprocess: it imports this accumnorm."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(accumnorm.__file__).parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
