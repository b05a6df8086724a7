"""The recompute schedule: layerwise, with the model's forward cut into checkpointed regions.

Layerwise keeps every micro-batch's graph until the one backward: the saved tensors of the whole batch.
Here, for the length of the step, chosen modules ("regions") run their forward in
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False, preserve_rng_state=True)`, which keeps only
the region's inputs and recomputes the rest when the backward reaches it. `checkpoint.Regions` makes each
recomputation exact (the forward's whole-batch BatchNorm outputs again, no running-statistics update), and
`pieces` keeps each BatchNorm input in its region's place. The step then holds the regions' inputs of the
whole batch, what runs outside regions, and, during the backward, one region's recomputed tensors for all K
micro-batches at once (a met BatchNorm call's backward needs every piece); it costs about one more forward.

Regions (`choose_regions`) are modules at the frontier of the module tree where each holds about the square
root of the model's layers (a residual block, an inverted-residual block, a detector's stage), so that a
region's recomputation is small against the whole and the region inputs are few. Modules of a single layer
gain nothing from it and stay as they are, as does the last region (the backward recomputes it at once: it
would cost time and save nothing). Once a step has measured what each region's forward saves, the regions
that save least run as they are, as long as together they save no more than the largest one: the backward
holds that one's recomputation anyway, and theirs would cost time (the late, low-resolution blocks of a
convolutional net save little for as much compute). A region called inside a region the user already
checkpointed, or without grad, runs as it is.

A region is exact only if running its forward twice gives the same result: `check_unchanged` refuses a step
whose forward changed a region module's Python attributes or buffers (other than the BatchNorm state the step
itself keeps), before the backward runs, so that the caller can fall back to layerwise.
"""
from __future__ import annotations

import math
import types
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from .checkpoint import in_recomputation, in_region, region_frames
from .lockstep import layerwise
from .step import Step
from .store import Store
from .threadstate import saved_tensor_hooks

__all__ = ["recompute", "choose_regions", "RegionStateChanged"]

_STEP_STATE = ("running_mean", "running_var", "num_batches_tracked")  # a BatchNorm's, kept by the step itself


class RegionStateChanged(Exception):
    """A region's forward changed its module's state: recomputing it would not give the forward's tensors."""


def _layers(model: nn.Module) -> dict[nn.Module, int]:
    """Each module's number of layers: modules with parameters of their own or no children, each counted once."""
    counts: dict[nn.Module, int] = {}

    def count(m: nn.Module, seen: set[nn.Module]) -> int:
        if m in counts:
            return counts[m] if m not in seen else 0
        seen.add(m)
        own = 1 if (next(iter(m._parameters.values()), None) is not None or not m._modules) else 0
        counts[m] = own + sum(count(c, seen) for c in m.children())
        return counts[m]

    count(model, set())
    return counts


def choose_regions(model: nn.Module) -> list[nn.Module]:
    """The modules whose forwards the step checkpoints, in the model's order (module doc)."""
    layers = _layers(model)
    target = max(2, math.isqrt(layers[model]))
    regions: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        if layers[m] <= target or not m._modules:
            if layers[m] >= 2 and m is not model and _wrappable(m):
                regions.append(m)
            return
        for child in m.children():
            visit(child)

    visit(model)
    unique = list(dict.fromkeys(regions))[:-1]
    sizes = [_SAVED.get(m) for m in unique]
    if None in sizes or not unique:
        return unique
    # Regions that keep little run as they are, as long as together they keep no more than the largest region,
    # whose recomputation the backward holds anyway: their recomputation would cost time for little memory.
    kept, budget = set(), max(sizes)
    for size, i in sorted(zip(sizes, range(len(unique)))):
        if size > budget:
            break
        budget -= size
        kept.add(i)
    return [m for i, m in enumerate(unique) if i not in kept]


# region module -> the bytes per sample its forward saved for the backward, as its last checkpointed forward
# measured them (what `choose_regions` weighs)
_SAVED: weakref.WeakKeyDictionary[nn.Module, float] = weakref.WeakKeyDictionary()


def _saved_bytes(frame: Any, module: nn.Module, rows: int) -> float:
    """The bytes per sample a region's forward saved (its frame's metadata of each saved tensor), its module's
    parameters left out."""
    saved = sum(math.prod(meta["shape"]) * meta["dtype"].itemsize for meta in frame.x_metadatas
                if isinstance(meta, dict) and "shape" in meta)
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    return max(0, saved - params) / max(1, rows)


def _wrappable(m: nn.Module) -> bool:
    """A module the step can give a checkpointed forward: plain Python, with no forward of its own set on it."""
    return "forward" not in vars(m) and not isinstance(m, torch.jit.ScriptModule)


def _region_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The module's forward in a checkpointed region. Its arguments go in as their tensors, which the region saves,
    and a structure built afresh around them: a list the caller appends to after the call (DenseNet's features)
    is recomputed as the forward saw it. A forward that changes its tensors or containers in place is refused."""
    forward = type(self).forward
    hooks = saved_tensor_hooks()
    # Inside a region of the user's, in its forward or in its recomputation in the backward: as it is, both times.
    if not torch.is_grad_enabled() or in_region(hooks) or in_recomputation(hooks):
        return forward(self, *args, **kwargs)
    leaves, spec = tree_flatten((args, kwargs))
    tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
    versions = [leaves[i]._version for i in tensors]
    given: list[Any] = [None]  # the arguments the forward (not a recomputation) was given

    def run(*inputs: Tensor) -> Any:
        filled = list(leaves)
        for i, t in zip(tensors, inputs):
            filled[i] = t
        a, kw = tree_unflatten(filled, spec)
        if given[0] is not None:  # a recomputation
            return forward(self, *a, **kw)
        given[0] = (a, kw)
        frame = region_frames(saved_tensor_hooks())[-1]
        out = forward(self, *a, **kw)
        _SAVED[self] = _saved_bytes(frame, self, inputs[0].shape[0] if inputs and inputs[0].dim() else 1)
        return out

    out = checkpoint(run, *[leaves[i] for i in tensors], use_reentrant=False, preserve_rng_state=True)
    (after, after_spec), given[0] = tree_flatten(given[0]), False
    if after_spec != spec or [leaves[i]._version for i in tensors] != versions or any(
            a is not b for i, (a, b) in enumerate(zip(after, leaves)) if i not in tensors):
        raise RegionStateChanged(f"the recompute schedule runs a region's forward again in the backward, but the "
                                 f"forward of {type(self).__name__} changed its arguments in place: its "
                                 "recomputation would not be exact")
    return out


@contextmanager
def checkpointed(regions: list[nn.Module]) -> Iterator[None]:
    """The regions' forwards checkpointed until the block ends."""
    for m in regions:
        m.forward = types.MethodType(_region_forward, m)
    try:
        yield
    finally:
        for m in regions:
            vars(m).pop("forward", None)


class _State:
    """What a forward must leave alone in the regions' modules: their attributes and their buffers' versions."""

    def __init__(self, regions: list[nn.Module]) -> None:
        modules = list(dict.fromkeys(d for r in regions for d in r.modules()))
        self.attributes = [(m, dict(vars(m))) for m in modules]
        self.buffers = [(m, name, b, b._version) for m in modules for name, b in m._buffers.items()
                        if b is not None and not (isinstance(m, _BatchNorm) and name in _STEP_STATE)]

    def changed(self, names: dict[nn.Module, str]) -> str | None:
        for m, before in self.attributes:
            now = vars(m)
            for key in before.keys() | now.keys():
                if before.get(key, _MISSING) is not now.get(key, _MISSING):
                    return f"{type(m).__name__} {names.get(m, '')} set its attribute {key!r}"
        for m, name, b, version in self.buffers:
            if m._buffers.get(name) is not b or b._version != version:
                return f"{type(m).__name__} {names.get(m, '')} changed its buffer {name!r}"
        return None


_MISSING = object()


def recompute(step: Step, store: Store | None) -> None:
    """Exact BatchNorm in lockstep with checkpointed regions (module doc); fills `step.losses` and the step's calls.

    Raises RegionStateChanged, before any backward, if a region's forward changed its module's state.
    """
    regions = choose_regions(step.model)
    with checkpointed(regions):
        state = _State(regions)

        def check_unchanged() -> None:
            problem = state.changed(step.names)
            if problem is not None:
                raise RegionStateChanged(f"the recompute schedule runs a region's forward again in the backward, but "
                                         f"in the forward {problem}: its recomputation would not be exact")

        layerwise(step, store, before_backward=check_unchanged)
