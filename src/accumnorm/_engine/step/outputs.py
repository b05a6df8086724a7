"""A whole-batch loss: the micro-batches' outputs put together, and their gradients handed back.

With `forward_fn` and `batch_loss_fn`, each micro-batch's forward returns its outputs (a tensor, or any
nesting of tuples, lists, namedtuples and dicts of tensors, one row per sample along dim 0), and the loss
is taken once, over the whole batch's outputs: `concatenate` joins the K outputs tensor by tensor along
dim 0 (`BatchLoss.forward` holds each tensor to one row per sample). A schedule that keeps one
micro-batch at a time computes the outputs first, letting their graph go (`without_graph`), the loss and its
gradient at every output (`OutputGrads`), then each micro-batch's forward again and its backward from those
gradients.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map, tree_unflatten

__all__ = ["concatenate", "OutputGrads", "without_graph"]


def concatenate(outputs: list[Any]) -> Any:
    """The K micro-batches' outputs as one output of the whole batch: each tensor concatenated along dim 0.

    Raises TypeError/ValueError, naming the output and the micro-batch, where they cannot be put together.
    """
    flat = [tree_flatten_with_path(out) for out in outputs]
    paths, spec = [f" {keystr(path)}" if path else "" for path, _ in flat[0][0]], flat[0][1]  # "" for a Tensor
    if not paths:
        raise TypeError(f"forward_fn must return a Tensor, or tuples, lists, namedtuples or dicts of them (one row "
                        f"per sample), got {type(outputs[0]).__name__} {outputs[0]!r:.80} for micro-batch 0")
    for k, (_, other) in enumerate(flat):
        if other != spec:
            raise ValueError(f"forward_fn must return outputs of the same structure for every micro-batch: "
                             f"micro-batch {k} returned {other}, micro-batch 0 {spec}")
    joined = []
    for i, path in enumerate(paths):
        pieces = [leaves[i][1] for leaves, _ in flat]
        for k, t in enumerate(pieces):
            if not isinstance(t, Tensor):
                raise TypeError(f"forward_fn's output{path} must be a Tensor (with one row per sample), got "
                                f"{type(t).__name__} for micro-batch {k}")
            if t.dim() == 0:
                raise ValueError(f"forward_fn's output{path} is 0-dim for micro-batch {k}: outputs need one row "
                                 "per sample along dim 0, to be put together over the whole batch")
            if t.shape[1:] != pieces[0].shape[1:] or t.dtype != pieces[0].dtype:
                raise ValueError(f"forward_fn's output{path} cannot be concatenated over the micro-batches: "
                                 f"micro-batch {k} gave {tuple(t.shape)} {t.dtype}, micro-batch 0 "
                                 f"{tuple(pieces[0].shape)} {pieces[0].dtype}")
        joined.append(torch.cat(pieces))
    return tree_unflatten(joined, spec)


def without_graph(outputs: Any) -> Any:
    """A micro-batch's outputs as leaves of no graph, each requiring grad where it did: the graph behind them goes
    now, and whether the loss reaches the parameters through them is kept."""
    return tree_map(lambda t: t.detach().requires_grad_(t.requires_grad) if isinstance(t, Tensor) else t, outputs)


class OutputGrads:
    """The whole-batch loss of outputs without their graph (`without_graph`), and its gradient at each micro-batch's
    outputs.

    `loss(batch_loss)` takes the loss over the concatenated outputs (leaves that require grad), back-propagates
    it to them, and keeps each micro-batch's slice of their gradients for `backward(k, outputs)`.
    """

    def __init__(self, outputs: list[Any], backward: Callable[..., None]) -> None:
        self._backward = backward  # torch.autograd.backward, or the step's, which takes every leaf it reaches
        whole = concatenate(outputs)  # checks every output first
        self.sizes = [tree_flatten(out)[0][0].shape[0] for out in outputs]
        leaves, self.spec = tree_flatten(whole)
        # An output that does not require grad (detached, or made under no_grad) gets no gradient, as in the
        # whole batch's forward; if none does, the loss does not require grad, and `BatchLoss.loss` says so.
        self.leaves = [t.detach().requires_grad_(t.requires_grad) for t in leaves]
        self.whole = tree_unflatten(self.leaves, self.spec)

    def loss(self, batch_loss: Any) -> Tensor:
        """`batch_loss(whole outputs)`, back-propagated to the outputs; returns the (unscaled) loss."""
        loss, scaled = batch_loss(self.whole)
        if any(t.grad is not None for t in self.leaves):
            raise ValueError(
                "bn='exact': a backward inside batch_loss_fn (a .backward() or torch.autograd.backward there) reached "
                "the outputs. This schedule runs batch_loss_fn on the outputs without their graph, and hands the "
                "gradient of the loss it returns back to each micro-batch: that backward's would be lost. Nothing "
                "was changed. Add its term to the loss you return, or use schedule='layerwise', which runs "
                "batch_loss_fn on the outputs with their graph")
        # Everything the loss reaches gets its gradient: the outputs, and any parameter the loss uses itself (a
        # learnable temperature).
        self._backward(scaled)
        return loss

    def backward(self, k: int, outputs: Any, inputs: list[Tensor] | None = None) -> None:
        """Back-propagate micro-batch k's share of the loss's gradient from its `outputs` (this forward's)."""
        start = sum(self.sizes[:k])
        tensors, grads = [], []
        for out, leaf in zip(tree_flatten(outputs)[0], self.leaves):
            if leaf.grad is not None and out.requires_grad:
                tensors.append(out)
                grads.append(leaf.grad[start:start + self.sizes[k]])
        if tensors:
            self._backward(tensors, grads, inputs=inputs)
