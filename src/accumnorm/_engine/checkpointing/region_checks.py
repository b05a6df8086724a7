"""What a segments region's recomputation in the backward must be for its passes to be exact.

Each pass runs a micro-batch's region again, alone (`region_passes`). That is exact only where the recomputation
is the forward again: the same outputs (`again`); and a graph of its own, whose leaves are the region's arguments,
its parameters and tensors made before the step, with no batch norm the step did not meet.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..safety.graphs import BATCH_NORM_NODES
from .again import RegionStateChanged

__all__ = ["graph_leaves", "next_sequence_nr"]

next_sequence_nr = torch._C._autograd._get_sequence_nr


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
