"""The K graphs of a step, checked before their backward: each micro-batch's own, joined only at the met calls.

Under the layerwise schedule the K forwards run interleaved on one thread, meeting at every BatchNorm call.
Python state they share (a forward hook's stash, a module attribute, a global) is written by one and read by
another: micro-batch k's loss then holds a tensor that micro-batch j made. And a batch norm with batch
statistics that no TorchFunctionMode reaches (`torch.native_batch_norm`, an aten op, TorchScript, a thread of
its own) normalizes one micro-batch alone. Both show in the autograd graph, and one walk over it finds both:

- autograd numbers the nodes it makes on a thread in order (`Node._sequence_nr`), so the numbers taken at the
  start and end of each micro-batch's turn (`begin`, `end`) say which micro-batch made each node;
- the met calls' nodes are the one place the K graphs may join: micro-batch k may use its own rows of the output
  only (the node's output k), and its walk goes on at its own piece's input (`met`); the batch's cut is a node
  too when the batch has a graph, each micro-batch's samples one of its outputs;
- a batch-norm node with batch statistics in a micro-batch's graph is a call the step did not see (the step's
  own are met calls, whose nodes the walk steps over, and the instance norms it saw, which torch computes as
  batch norms of one sample: `instance_norm`).

`check([(k, result), ...])` walks micro-batch k's graph from its loss or outputs, for each k given, and raises
a ValueError naming what it found. Nodes made before the step, or by the driver, belong to no micro-batch: the
K graphs may share them (parameters, a tensor computed before the step).
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor
from torch.utils._pytree import tree_leaves

__all__ = ["BATCH_NORM_NODES", "Graphs", "holds_user_functions"]

_next_sequence_nr = torch._C._autograd._get_sequence_nr

Edge = tuple[Any, int]  # an autograd node and one of its outputs, as in `Node.next_functions`


def _edge(t: Tensor) -> Edge | None:
    return None if t.grad_fn is None else (t.grad_fn, t.output_nr)


def _leaf_cast(node: Any) -> bool:
    """Whether `node` casts leaves only (autocast's cached copy of a weight)."""
    return type(node).__name__ == "ToCopyBackward0" and all(
        n is None or type(n).__name__ == "AccumulateGrad" for n, _ in node.next_functions)


_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad  # a leaf's node

# Autograd's nodes of the batch-norm ops that normalize with batch statistics when `training` (saved) is true.
BATCH_NORM_NODES = frozenset({
    "NativeBatchNormBackward0", "CudnnBatchNormBackward0", "MiopenBatchNormBackward0", "NativeBatchNormLegitBackward0",
    "NativeBatchNormLegitBackward1", "BatchNormWithUpdateBackward0",
})


class Graphs:
    """Which micro-batch made which autograd node, the met calls' nodes, and the walk (module doc)."""

    def __init__(self, model: nn.Module, micro_batches: Sequence[Any]) -> None:
        self.model = model
        self.starts: list[int] = []  # the first sequence number of each span of turns, in order
        self.owners: list[int | None] = []  # and whose span it is (None: the driver's, between turns)
        # A node whose outputs are the micro-batches' rows -> (output -> its micro-batch, what the rows are)
        self.rows: dict[Any, tuple[dict[int, int | None], str]] = {}
        self.pieces: dict[Any, Sequence[Sequence[Edge]]] = {}  # a met node -> each micro-batch's inputs
        self.seen: set[Any] = set()  # the batch-norm nodes of the instance norms the step saw (one sample each)
        for k, micro_batch in enumerate(micro_batches):
            for t in tree_leaves(micro_batch):
                if isinstance(t, Tensor) and t.grad_fn is not None:
                    whose, _ = self.rows.setdefault(t.grad_fn, ({}, "its samples of the batch"))
                    whose[t.output_nr] = k if whose.get(t.output_nr, k) == k else None  # one tensor in two: no one's

    def begin(self, k: int) -> None:
        """Micro-batch k's turn starts: the nodes made from now on are its own."""
        self._span(k)

    def end(self) -> None:
        self._span(None)

    def _span(self, owner: int | None) -> None:
        start = _next_sequence_nr()
        if self.starts and self.starts[-1] == start:  # nothing was made in the span before
            self.owners[-1] = owner
        else:
            self.starts.append(start)
            self.owners.append(owner)

    def met(self, outputs: Sequence[Tensor], inputs: Sequence[Tensor]) -> None:
        """A met call: `outputs[k]`, micro-batch k's rows of it, from `inputs[k]`, its piece of the input."""
        node = outputs[0].grad_fn
        if node is not None:
            self.rows[node] = ({y.output_nr: k for k, y in enumerate(outputs)}, "its rows of a BatchNorm call's output")
            self.pieces[node] = [[e] if (e := _edge(x)) is not None else [] for x in inputs]

    def met_region(self, outputs: Sequence[Sequence[Tensor]], inputs: Sequence[Sequence[Tensor]]) -> None:
        """A met region (the segments schedule's): `outputs[k]`, micro-batch k's outputs of its node, from `inputs[k]`,
        its arguments."""
        node = next((y.grad_fn for ys in outputs for y in ys if y.grad_fn is not None), None)
        if node is not None:
            self.rows[node] = ({y.output_nr: k for k, ys in enumerate(outputs) for y in ys},
                               "its outputs of a region of the segments schedule")
            self.pieces[node] = [[e for x in xs if (e := _edge(x)) is not None] for xs in inputs]

    def instance_norm(self, output: Tensor) -> None:
        """An instance norm the step saw: torch computes it as a batch norm over a view of one sample."""
        node = output.grad_fn
        for _ in range(2):  # its output is a view of the batch norm's
            if node is None or type(node).__name__ in BATCH_NORM_NODES:
                break
            node = node.next_functions[0][0] if node.next_functions else None
        if node is not None:
            self.seen.add(node)

    def clear(self) -> None:
        """Let go of the nodes held (once the graphs are checked, or the step failed)."""
        self.rows.clear()
        self.pieces.clear()
        self.seen.clear()

    def check(self, results: Sequence[tuple[int, Any]]) -> None:
        """Walk each micro-batch k's graph from its `result` (its loss, or its outputs): raise on another
        micro-batch's node, or on a batch-statistics batch norm the step did not make."""
        walked: dict[Any, int] = {}  # node -> the micro-batch whose walk reached it first
        shared: list[tuple[int, Any, int | None]] = []  # (micro-batch, another's node it reached, whose)
        for k, result in results:
            self._walk(k, result, walked, shared)
        if shared:  # an unseen batch norm is said first: a thread's nodes are numbered apart, and may seem shared
            self._shared(*shared[0])

    def _walk(self, k: int, result: Any, walked: dict[Any, int], shared: list[tuple[int, Any, int | None]]) -> None:
        pieces, rows_of, seen, starts, owners = self.pieces, self.rows, self.seen, self.starts, self.owners
        stack: list[Edge] = [_edge(t) for t in tree_leaves(result) if isinstance(t, Tensor) and t.grad_fn is not None]
        while stack:
            node, output = stack.pop()
            if node is None or type(node) is _ACCUMULATE_GRAD:  # a leaf's: made by no one
                continue
            rows = rows_of.get(node)
            if rows is not None and rows[0].get(output) not in (None, k):  # another micro-batch's rows
                shared.append((k, node, rows[0][output]))
                continue
            piece = pieces.get(node)
            if piece is not None:  # a met node, every micro-batch's: on at this micro-batch's pieces only
                stack.extend(piece[k])
                continue
            first = walked.get(node)  # the micro-batch whose walk reached it first
            if first == k:
                continue
            # The micro-batch whose turn made it (None: before the step, or the driver's, between turns). A cast of a
            # leaf is no one's: autocast's cache makes it once for every micro-batch, and it depends on no sample.
            span = bisect_right(starts, node._sequence_nr()) - 1
            made_by = owners[span] if span >= 0 else None
            if made_by is not None and made_by != k and not _leaf_cast(node):
                shared.append((k, node, made_by))
            if first is not None:
                continue
            walked[node] = k
            if type(node).__name__ in BATCH_NORM_NODES and getattr(node, "_saved_training", True) \
                    and node not in seen:
                self._unseen(k, node)
            stack.extend(node.next_functions)

    def _shared(self, k: int, node: Any, j: int | None) -> None:
        rows = self.rows.get(node)
        what = rows[1] if rows is not None else type(node).__name__
        raise ValueError(
            f"bn='exact': micro-batch {k} used a tensor that micro-batch {j} made "
            f"({what}{self._where(node)}). The micro-batches' forwards run interleaved, meeting at "
            "every BatchNorm call, so Python state one of them writes (a forward hook's stash, a module attribute, "
            "a global, a closure) is overwritten by another before it is read. Nothing was changed. Keep such "
            "state local to the call (return it from the forward), or use schedule='passes', which runs each "
            "micro-batch's forward alone")

    def _unseen(self, k: int, node: Any) -> None:
        raise ValueError(
            f"bn='exact' found in micro-batch {k}'s graph a batch norm with batch statistics that it did not see "
            f"({type(node).__name__}{self._layer(node)}): a call below F.batch_norm (torch.native_batch_norm, an aten "
            "op), in TorchScript, in a thread of its own or in C++ normalized with one micro-batch's statistics. "
            "Nothing was changed. Call F.batch_norm or a BatchNorm layer from Python on the calling thread, or pass "
            "bn='micro'")

    def _layer(self, node: Any) -> str:
        """The layer whose running statistics the node's batch norm updated, if the model holds them."""
        running_mean = getattr(node, "_saved_running_mean", None)
        if running_mean is not None:
            for name, m in self.model.named_modules():
                held = m._buffers.get("running_mean")
                if held is not None and held.data_ptr() == running_mean.data_ptr():
                    return f", on the running statistics of {type(m).__name__} {name or '(the model)'}"
        return ""

    def _where(self, node: Any) -> str:
        """Where the tensor is kept, if the model holds it: `, kept in 0.stash`."""
        for name, m in self.model.named_modules():
            for attr, value in vars(m).items():
                if isinstance(value, Tensor) and value.grad_fn is node:
                    return f", kept in the module attribute {name + '.' if name else ''}{attr}"
        return ", kept outside the model: a global, a closure or another object"


def holds_user_functions(roots: Sequence[Tensor]) -> bool:
    """Whether the graph from `roots` holds the node of a custom `autograd.Function` of yours (not the step's own),
    whose backward may not be linear in its gradient (`intercept.guards.backward_hooked`)."""
    stack = [t.grad_fn for t in roots if isinstance(t, Tensor) and t.grad_fn is not None]
    seen = set(stack)
    while stack:
        node = stack.pop()
        if isinstance(node, torch.autograd.function.BackwardCFunction) and not getattr(
                node._forward_cls, "__module__", "").startswith("accumnorm."):
            return True
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return False
