"""What a segments region's recomputation in the backward must be for its passes to be exact.

Each pass runs a micro-batch's region again, alone (`region_passes`). That is exact only where the recomputation
is the forward again: the same outputs, which a fingerprint of each output, taken in the forward, vouches for
(`RegionStateChanged` where state shared between micro-batches, or randomness outside torch's generators, made
them differ); and a graph of its own, whose leaves are the region's arguments, its parameters and tensors made
before the step, with no batch norm the step did not meet.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..safety.graphs import BATCH_NORM_NODES
from .frames import RegionStateChanged

__all__ = ["fingerprint", "check_outputs", "graph_leaves", "next_sequence_nr"]

next_sequence_nr = torch._C._autograd._get_sequence_nr


def fingerprint(outputs: list[Tensor]) -> Tensor:
    """Two numbers per output, the sum of its values and of their magnitudes, in float64 (a row each): what the last
    pass's recomputation must give again."""
    with torch.no_grad():
        if not outputs:
            return torch.zeros(0, 2, dtype=torch.float64)
        return torch.stack([torch.stack([o.sum(dtype=torch.float64), o.abs().sum(dtype=torch.float64)])
                            for o in outputs])


def check_outputs(outputs: list[Tensor], forward: Tensor, refusal: str) -> None:
    """Raise `RegionStateChanged(refusal)` unless a recomputation's `outputs` are the forward's, whose fingerprints
    were `forward`, to the outputs' dtypes' rounding (a NaN where the forward had one too: an overflow a GradScaler
    skips the step for is the same overflow again)."""
    again = fingerprint(outputs)
    if not (again.shape == forward.shape and all(
            bool(torch.allclose(a, b, rtol=_tolerance(o.dtype), atol=0.0, equal_nan=True))
            for a, b, o in zip(again, forward, outputs))):
        raise RegionStateChanged(refusal)


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-9 if dtype == torch.float64 else 1e-4 if dtype == torch.float32 else 1e-2


def graph_leaves(outputs: list[Tensor], start: int, own: set[int], met: set) -> list[Tensor]:
    """The leaves a recomputation's graph reaches from `outputs`, other than the region's arguments (ids in `own`):
    refused where the graph leaves the recomputation, whose nodes were made from sequence number `start` on, by a
    tensor made outside it, or holds a batch norm the step did not meet (`met`: the nodes it did)."""
    found, seen = [], set()
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    end = next_sequence_nr()
    while stack:
        node = stack.pop()
        leaf = getattr(node, "variable", None)
        if leaf is not None:
            if id(leaf) not in own:
                found.append(leaf)
            continue
        if not start <= node._sequence_nr() < end:
            raise RegionStateChanged(
                "the segments schedule recomputes each region alone in the backward, but a region's forward used "
                "a tensor with a graph made outside it (kept in a closure or an attribute, not passed as an "
                "argument): its gradient would reach that graph twice")
        if type(node).__name__ in BATCH_NORM_NODES and getattr(node, "_saved_training", True) and node not in met:
            raise ValueError(
                f"bn='exact' found in a region's graph a batch norm with batch statistics that it did not see "
                f"({type(node).__name__}): a call below F.batch_norm (torch.native_batch_norm, an aten op), in "
                "TorchScript or in C++ normalized with one micro-batch's statistics. Nothing was changed. Call "
                "F.batch_norm or a BatchNorm layer from Python, or pass bn='micro'")
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return found
