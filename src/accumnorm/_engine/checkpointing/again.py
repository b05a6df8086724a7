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

__all__ = ["CannotCheck", "RegionStateChanged", "check_outputs", "fingerprint", "same_outputs", "tensor_leaves"]


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
    """Three numbers per output (a row each, in float64): the sum of its values, the sum of them weighted by where
    they are (`_weights`), and the sum of their magnitudes: what a later run must give again. Outside every
    torch-function mode (the step's own, a user's): the step's bookkeeping, which no mode has to see."""
    with torch._C.DisableTorchFunction():
        if not outputs:
            return torch.zeros(0, 3, dtype=torch.float64)
        for o in outputs:
            if python_tensor(o):
                raise CannotCheck(
                    f"a forward gave a {type(o).__name__}, a tensor subclass whose ops run in Python "
                    "(__torch_dispatch__), whose values the step cannot read back to check a run of it again")
        return torch.stack([_sums(o.detach()) for o in outputs]).double()



def _sums(o: Tensor) -> Tensor:
    """The sums, reduced in the tensor's own float32 or float64, and in float32 from a lower precision. Not with
    `dtype=torch.float64` on a float32 tensor: on the CPU that makes a copy of it, twice its size, at the moment a
    recomputation holds the most. Few ops: a region of small tensors takes a fingerprint of each output at every
    call, where each op costs more than its sums."""
    if o.is_complex():
        o = torch.view_as_real(o)  # the real and imaginary parts side by side, each checked
    if not o.is_floating_point():
        o = o.double()
    accumulate = None if o.dtype in (torch.float32, torch.float64) else torch.float32
    if o.dim() < 2:
        o = o.reshape(-1, 1)
    rows = o.sum(dim=tuple(range(1, o.dim())), dtype=accumulate)  # a pass over the values, as the sum's would be
    sums = torch.cat([rows, o.sum(dim=0, dtype=accumulate).reshape(-1)])  # each row's, and each place's
    return torch.cat([sums @ _weights(len(rows), sums), torch.linalg.vector_norm(o, 1, dtype=accumulate).reshape(1)])


def _weights(rows: int, sums: Tensor) -> Tensor:
    """Two columns for `sums`, each of an output's `rows` row sums and then each place's sum over the rows: ones
    for the rows, whose product is the plain sum; and weights, the same values elsewhere (rows or places swapped,
    a flip, a roll, channels shuffled by a draw from Python's random) giving another weighted sum, where the plain
    sums stay. The weights are the fractional parts of multiples of the golden ratio, which no reversal or shift
    maps onto themselves. Short ones are kept, per dtype and device: making them would cost more than the sums."""
    key = (rows, len(sums), sums.dtype, sums.device)
    weights = _KEPT.get(key)
    if weights is None:
        weights = torch.zeros(len(sums), 2, dtype=sums.dtype, device=sums.device)
        weights[:rows, 0] = 1
        multiples = torch.arange(1, len(sums) + 1, dtype=sums.dtype, device=sums.device)
        weights[:, 1] = multiples.mul_(0.6180339887498949).frac_()
        if len(sums) <= _KEPT_UP_TO and len(_KEPT) < _MOST_KEPT:
            _KEPT[key] = weights
    return weights


_KEPT_UP_TO = 4096  # weights for at most this many sums are kept (32 KB each in float32)
_MOST_KEPT = 256  # shapes whose weights are kept: a model of ever new shapes makes the others afresh
_KEPT: dict[tuple[int, int, torch.dtype, torch.device], Tensor] = {}


def same_outputs(outputs: list[Tensor], forward: Tensor) -> bool:
    """Whether a run's `outputs` are the forward's, whose fingerprints were `forward`, to the outputs' dtypes'
    rounding of their magnitude (a sum that cancels to near zero is judged against the sum of magnitudes, not itself;
    a NaN where the forward had one too, an overflow a GradScaler skips the step for, is the same overflow again)."""
    again, first = _read(fingerprint(outputs), forward)
    return _same(again, first, outputs)


def check_outputs(outputs: list[Tensor], forward: Tensor, refusal: str) -> None:
    """Raise `RegionStateChanged(refusal)` unless a run's `outputs` are the forward's (`same_outputs`); `CannotCheck`
    where the forward's held an inf or a NaN. Their sums are then inf or NaN whatever the other values are, so they
    vouch for nothing: a region that returns scores masked with -inf, or a forward that overflowed, runs under
    layerwise, which runs it once."""
    again, first = _read(fingerprint(outputs), forward)
    if not all(math.isfinite(x) for row in first for x in row):
        raise CannotCheck("a region's forward gave an output holding an inf or a NaN, whose sums hide its other "
                          "values, so that the step cannot check a run of it again")
    if not _same(again, first, outputs):
        raise RegionStateChanged(refusal)


def _read(again: Tensor, forward: Tensor) -> tuple[list[list[float]], list[list[float]]]:
    """Both fingerprints as Python floats: a handful of numbers, for which each tensor op would cost more than the
    work."""
    with torch._C.DisableTorchFunction():
        return again.tolist(), forward.tolist()


def _same(again: list[list[float]], first: list[list[float]], outputs: list[Tensor]) -> bool:
    return len(again) == len(first) and all(_alike(a, b, _tolerance(o.dtype)) for a, b, o in zip(again, first, outputs))


def _alike(a: list[float], b: list[float], tolerance: float) -> bool:
    scale = max(abs(a[2]), abs(b[2]))  # the sums of magnitudes
    return all(x == y or abs(x - y) <= tolerance * scale or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def _tolerance(dtype: torch.dtype) -> float:
    dtype = dtype.to_real() if dtype.is_complex else dtype
    return 1e-9 if dtype == torch.float64 else 1e-4 if dtype == torch.float32 else 1e-2
