"""Whether a region's recomputation gave its forward's outputs again, and the refusal where it did not.

A schedule that runs a region's forward again (recompute in its backward, segments in its region passes, passes
each micro-batch's whole forward) is exact only where the run is the forward again: no number drawn outside torch's
generators, no state one run changed for the next, no draw another thread took from the step's stream. A fingerprint
of each output, taken as the forward made it, vouches for the next run's (`check_outputs`, `RegionStateChanged`).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from ..memory.store import python_tensor

__all__ = ["CannotCheck", "RegionStateChanged", "check_kept", "check_outputs", "fingerprint", "same_outputs",
           "tensor_leaves"]


class RegionStateChanged(Exception):
    """A region's forward changed its module's state, or a run of it gave other outputs than the forward: recomputing
    it would not give the forward's tensors."""


class CannotCheck(RegionStateChanged):
    """A forward's outputs that no fingerprint can vouch for: a run of it again could give others unseen."""


def tensor_leaves(out: Any) -> list[Tensor]:
    """The tensors of a forward's result (a loss, a tensor, a tuple or dict of them, with other values beside): what
    its fingerprint is taken of."""
    return [t for t in tree_leaves(out) if isinstance(t, Tensor)]


def fingerprint(outputs: list[Tensor]) -> Tensor:
    """Four numbers per output (a 2 x 2 block each, in float64): its sum and three sums weighted by where its values
    are (`_sums`), what a later run must give again. Outside every torch-function mode (the step's own, a user's),
    and without grad: the step's bookkeeping, which no mode and no graph has to see."""
    with torch._C.DisableTorchFunction():
        if not outputs:
            return torch.zeros(0, 2, 2, dtype=torch.float64)
        for o in outputs:
            if python_tensor(o):
                raise CannotCheck(
                    f"a forward gave a {type(o).__name__}, a tensor subclass whose ops run in Python "
                    "(__torch_dispatch__), whose values the step cannot read back to check a run of it again")
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            return torch.stack([_sums(_table(o)) for o in outputs])
        finally:
            torch._C._set_grad_enabled(grad)


def _table(o: Tensor) -> Tensor:
    """An output's values as a 2-D table, a row per index of its outermost dimension in memory (one row for a
    scalar, one per value for a vector): a view of any dense tensor (channels-last too), not a copy; of an expanded
    one, its values once. Its rows and columns follow the memory's order and layout, so that a run must give its
    output in the forward's."""
    if o.is_complex():
        o = torch.view_as_real(o)  # the real and imaginary parts side by side, each checked
    if not o.is_floating_point():
        o = o.double()
    if o.dim() < 2:
        return o.reshape(-1, 1)
    if not o.is_contiguous():
        if 0 in o.stride():  # expanded: the values along a dimension of stride 0 are one, read once, not copied
            o = o[tuple(slice(0, 1) if stride == 0 else slice(None) for stride in o.stride())]
        o = o.permute(sorted(range(o.dim()), key=o.stride, reverse=True))
    return o.flatten(1)


def _sums(table: Tensor) -> Tensor:
    """`R.T @ table @ C` in float64: R's columns weigh the rows by 1 and by `_weights`, C's the columns, so that the
    first entry is the sum and the others tell the same values elsewhere. Few ops, whatever the size: a region of
    small tensors takes a fingerprint at every call, where each op costs more than its sums. A small table is read
    in float64 whole; a large one sums over its rows first, in float32 or float64 (a float16 table a piece at a
    time), not copied whole."""
    rows, columns = table.shape
    device = table.device
    if table.numel() <= _SMALL:
        return torch.linalg.multi_dot([_weights(rows, torch.float64, device, True), table.double(),
                                       _weights(columns, torch.float64, device, False)])
    accumulate = _accumulation(table)
    pieces = [table] if table.dtype == accumulate else [
        piece.to(accumulate) for piece in table.split(max(_PIECE // max(rows, 1), 1), 1)]
    by_rows = [_weights(rows, piece.dtype, device, True) @ piece for piece in pieces]
    by_rows = by_rows[0] if len(by_rows) == 1 else torch.cat(by_rows, 1)
    return by_rows.double() @ _weights(columns, torch.float64, device, False)


def _accumulation(table: Tensor) -> torch.dtype:
    """The dtype a large table's sums over its rows are taken in: float64's own, float32 for any other."""
    return torch.float64 if table.dtype == torch.float64 else torch.float32


_SMALL = 1 << 16  # values of a table read in float64 whole (a copy of 512 KiB at most)
_PIECE = 1 << 20  # values of a float16 or bfloat16 table read in float32 at a time


def _weights(length: int, dtype: torch.dtype, device: torch.device, across: bool) -> Tensor:
    """Two columns of `length` (two rows, `across`): ones, whose product is the plain sum; and weights, giving
    another weighted sum where the same values are elsewhere (rows or columns swapped, a flip, a roll, channels
    shuffled by a draw from Python's random). The weights are the fractional parts of multiples of the golden ratio,
    which no reversal or shift maps onto themselves. They are kept, up to a bound: making them costs more than the
    sums."""
    key = (length, dtype, device, across)
    weights = _KEPT.get(key)
    if weights is None:
        multiples = torch.arange(1, length + 1, dtype=torch.float64, device=device)
        weights = torch.stack([torch.ones_like(multiples), multiples.mul_(0.6180339887498949).frac_()], int(not across))
        weights = weights.to(dtype)
        if len(_KEPT) < _MOST_KEPT and sum(w.nbytes for w in _KEPT.values()) + weights.nbytes <= _MOST_BYTES:
            _KEPT[key] = weights
    return weights


_MOST_KEPT = 256  # lengths whose weights are kept: a model of ever new shapes makes the others afresh
_MOST_BYTES = 32 << 20  # and at most this many bytes of them in all
_KEPT: dict[tuple[int, torch.dtype, torch.device, bool], Tensor] = {}


def same_outputs(outputs: list[Tensor], forward: Tensor) -> bool:
    """Whether a run's `outputs` are the forward's, whose fingerprints were `forward`: the same numbers, or, where
    they differ, numbers as near as a kernel's rounding puts them (`_rounding`). A NaN where the forward had one too,
    an overflow a GradScaler skips the step for, is the same overflow again."""
    again, first = _read(fingerprint(outputs), forward)
    return _same(again, first, outputs)


def check_outputs(outputs: list[Tensor], forward: Tensor, refusal: str) -> None:
    """Raise `RegionStateChanged(refusal)` unless a run's `outputs` are the forward's (`same_outputs`); `CannotCheck`
    where the forward's held an inf or a NaN. Their sums are then inf or NaN whatever the other values are, so they
    vouch for nothing: a region that returns scores masked with -inf, or a forward that overflowed, runs under
    layerwise, which runs it once."""
    again, first = _read(fingerprint(outputs), forward)
    if not all(math.isfinite(x) for numbers in first for x in numbers):
        raise CannotCheck("a region's forward gave an output holding an inf or a NaN, whose sums hide its other "
                          "values, so that the step cannot check a run of it again")
    if not _same(again, first, outputs):
        raise RegionStateChanged(refusal)


def check_kept(outputs: list[Tensor], kept: Tensor, refusal: str) -> None:
    """`check_outputs` against `kept`, the forward's one output itself, held by the next region as its input
    (`handoff`): a run that gives it again, value for value in the same layout, is the forward's at the cost of one
    comparison and no fingerprint; another one is judged by the fingerprints, with their tolerance."""
    with torch._C.DisableTorchFunction():
        if len(outputs) == 1:
            again = outputs[0]
            if (type(again) is Tensor and (again.shape, again.dtype, again.device, again.stride())
                    == (kept.shape, kept.dtype, kept.device, kept.stride()) and torch.equal(again, kept)):
                return
        check_outputs(outputs, fingerprint([kept]), refusal)


def _read(again: Tensor, forward: Tensor) -> tuple[list[list[float]], list[list[float]]]:
    """Both fingerprints as Python floats, four per output: a handful of numbers, for which each tensor op would
    cost more than the work."""
    with torch._C.DisableTorchFunction():
        return ([a + b for a, b in again.tolist()], [a + b for a, b in forward.tolist()])


def _same(again: list[list[float]], first: list[list[float]], outputs: list[Tensor]) -> bool:
    return len(again) == len(first) and all(_alike(a, b, o) for a, b, o in zip(again, first, outputs))


def _alike(a: list[float], b: list[float], output: Tensor) -> bool:
    if all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b)):
        return True
    scale = _rounding(output)
    return math.isfinite(scale) and all(abs(x - y) <= scale for x, y in zip(a, b))  # not where one is inf or NaN


def _rounding(output: Tensor) -> float:
    """How far apart two runs' fingerprints of `output` may be, where a kernel rounds differently from one run to
    the next (another algorithm, another order of its sums, another path for a reduced precision under autocast):
    `_SLACK` epsilons of the output's dtype, and of the fingerprint's own sums (float32's or float64's), per value,
    all of one sign: that many epsilons of the sum of its magnitudes. A bound, not a spread: such errors can lean
    one way (they did in a float16/bfloat16 region under autocast), and one value moved by a unit in a large float32
    output still shows."""
    with torch._C.DisableTorchFunction():
        table = _table(output)
        sums = _accumulation(table)
        magnitudes = torch.linalg.vector_norm(table, 1, dtype=None if table.dtype == sums else sums).item()
    dtype = output.dtype.to_real() if output.is_complex() else output.dtype
    values = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return _SLACK * magnitudes * (values + torch.finfo(sums).eps)


_SLACK = 4
