"""torch's `tree_flatten`, without the garbage cycle it leaves at every call: for the regions' calls in a step.

torch's `tree_flatten` recurses through a function it defines at each call, which refers to itself through its
closure: each call leaves a cycle (the function, its cells, its annotations) that only Python's collector frees.
The collector is off while a step runs (`backward`), and the recompute and segments schedules flatten each
region call's arguments, and segments its outputs, for every micro-batch: on a deep net of tiny tensors at 32
micro-batches, 4,600 cycles, 3 MiB held to the step's end. `flatten` gives torch's leaves and spec; for tuples,
lists and dicts of tensors, None, numbers and strings (a call's arguments and keywords, a module's outputs), it
walks the tree itself and makes each shape's spec once; anything else goes to torch's.
"""
from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.utils._pytree import SUPPORTED_NODES, TreeSpec, tree_flatten

__all__ = ["flatten"]

_CONTAINERS = (tuple, list, dict)
_LEAVES = (type(None), bool, int, float, str)  # besides tensors: leaves of torch's pytrees, each a spec's "*"
_SPECS: dict[Any, TreeSpec] = {}  # a tree's shape (`_shape`) -> its spec, as torch's `tree_flatten` makes it
_MOST = 4096  # shapes kept in `_SPECS`: a model whose calls make ever new ones (dicts of new keys) gets torch's after


def flatten(tree: Any) -> tuple[list[Any], TreeSpec]:
    """`torch.utils._pytree.tree_flatten(tree)`: its leaves, and the spec that `tree_unflatten` takes (module doc)."""
    leaves: list[Any] = []
    shape = _shape(tree, leaves)
    if shape is None:
        return tree_flatten(tree)
    spec = _SPECS.get(shape)
    if spec is None:
        spec = tree_flatten(tree)[1]
        if len(_SPECS) < _MOST:
            _SPECS[shape] = spec
    return leaves, spec


def _shape(tree: Any, leaves: list[Any]) -> Any:
    """A hashable key of the tree's shape, its leaves appended in torch's order; None for a tree of another kind."""
    kind = type(tree)
    if kind in _CONTAINERS:
        values = tree.values() if kind is dict else tree
        children = tuple(_shape(child, leaves) for child in values)
        if None in children:
            return None
        return (kind, tuple((type(key), key) for key in tree), children) if kind is dict else (kind, children)
    if (kind in _LEAVES or isinstance(tree, Tensor)) and kind not in SUPPORTED_NODES:
        leaves.append(tree)
        return ()
    return None
