"""Which parts of a model the recompute schedule checkpoints: its regions.

A region is a module (a residual block, an inverted-residual block, a detector's stage), or a `Run` of
consecutive children of an `nn.Sequential` (a stem's conv-BN-ReLU-pool; a VGG-like stack, which has no
block at all). `choose_regions` walks the module tree from the top. A module that holds about the square
root of the model's layers, or fewer, is a region as a whole; in a larger one the walk goes down to its
children, and in a larger `nn.Sequential` (one that runs torch's own forward) the children of one layer each
are gathered, in order, into runs of about that many layers. Children of more layers stay regions of their
own: a model may loop over a Sequential's children itself (ultralytics' detectors do), and a run only
exists where the Sequential's forward is called. A container without a forward (`nn.ModuleList`,
`nn.ModuleDict`), which only its parent's forward iterates, is never a region: the walk goes down to its
children. A region's recomputation is then small against the whole and the regions' inputs are few. A region
of a single layer gains nothing and runs as it is.

Once a step has measured what each region's forward saves (`record_saved`), the measured regions that save least
run as they are, as long as together they save no more than a quarter of the largest one: their recomputation
would cost time for little memory (the late, low-resolution blocks of a convolutional net, and its head,
save little for as much compute). The last region is no exception: the backward recomputes it at once, but
by then the loss's backward has let go of what the loss kept (a per-pixel loss keeps as much as a layer),
which its saved tensors would be held beside until the forward's end. A region that no step has measured (a run
of a Sequential whose parent loops over its children, so that the run never runs) stays a region and is not
weighed.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

__all__ = ["SAVED", "Run", "Region", "RegionMemo", "choose_regions", "keep_allowance", "largest_saved",
           "measured_saved", "record_saved", "region_modules"]

_SHARE = 0.25  # of the largest region's saved bytes, what the regions left as they are may keep together
# of the largest region's saved bytes per sample, what the kept convolution outputs may take (`kept`): they stay
# from the forward to the backward, and the heap they are spread over with them
_KEEP_SHARE = 0.1


@dataclass(frozen=True, eq=False)
class Run:
    """Children `start` to `stop` (excluded) of an `nn.Sequential` that runs torch's own forward, checkpointed as
    one region."""

    parent: nn.Sequential
    start: int
    stop: int

    def children(self) -> list[nn.Module]:
        return list(self.parent._modules.values())[self.start:self.stop]


Region = nn.Module | Run


def region_modules(region: Region) -> list[nn.Module]:
    """The modules a region's forward runs: the module itself, or the run's children."""
    return region.children() if isinstance(region, Run) else [region]


def _layers(model: nn.Module) -> dict[nn.Module, int]:
    """Each module's number of layers: modules with parameters of their own or no children, each counted once."""
    counts: dict[nn.Module, int] = {}
    _count(model, counts, set())
    return counts


def _count(m: nn.Module, counts: dict[nn.Module, int], seen: set[nn.Module]) -> int:
    if m in counts:
        return counts[m] if m not in seen else 0
    seen.add(m)
    own = 1 if (next(iter(m._parameters.values()), None) is not None or not m._modules) else 0
    counts[m] = own + sum(_count(c, counts, seen) for c in m.children())
    return counts[m]


def wrappable(m: nn.Module) -> bool:
    """A module the step can give a checkpointed forward: plain Python, with no forward of its own set on it."""
    return "forward" not in vars(m) and not isinstance(m, torch.jit.ScriptModule)


def has_forward(m: nn.Module) -> bool:
    """A module that can be called: not a container that only its parent's forward iterates (`nn.ModuleList`)."""
    return type(m).forward is not nn.Module.forward


def runs_torch_sequential(m: nn.Module) -> bool:
    """An `nn.Sequential` whose forward is torch's own (each child called on the last one's output), which the step
    can run with some of its children in checkpointed runs."""
    return isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward and wrappable(m)


class _Walk:
    """The walk down the module tree that finds the regions (module doc). A class, not nested functions: those would
    call each other through their closures, a cycle left for Python's collector after every step."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.layers = model, _layers(model)
        self.target = max(2, math.isqrt(self.layers[model]))
        self.regions: list[Region] = []

    def add(self, m: nn.Module) -> None:
        if self.layers[m] >= 2 and m is not self.model and wrappable(m):
            self.regions.append(m)

    def visit(self, m: nn.Module) -> None:
        if not has_forward(m):
            for child in m.children():
                self.visit(child)
        elif self.layers[m] <= self.target or not m._modules:
            self.add(m)
        elif runs_torch_sequential(m):
            self.gather(m)
        else:
            for child in m.children():
                self.visit(child)

    def gather(self, seq: nn.Sequential) -> None:
        """Children too small alone gathered into runs of about `target` layers; larger ones visited."""
        children = list(seq._modules.values())
        start = total = 0
        for i, child in enumerate(children):
            if self.layers[child] >= 2:  # a region alone, or visited: as in any other module (module doc)
                self.close(seq, children, start, i, total)
                self.visit(child)
                start, total = i + 1, 0
            elif total + self.layers[child] > self.target and total > 0:
                self.close(seq, children, start, i, total)
                start, total = i, self.layers[child]
            else:
                total += self.layers[child]
        self.close(seq, children, start, len(children), total)

    def close(self, seq: nn.Sequential, children: list[nn.Module], start: int, stop: int, total: int) -> None:
        """The run of children `start` to `stop` (excluded), of `total` layers, ended. Its first children that change
        their argument in place (a `ReLU(inplace=True)` after the run or block before) run as they are, before it:
        they would change the run's argument, which its recomputation starts from."""
        while start < stop and getattr(children[start], "inplace", False) is True:
            total -= self.layers[children[start]]
            start += 1
        if stop - start == 1:
            self.add(children[start])
        elif stop > start and total >= 2:
            self.regions.append(Run(seq, start, stop))


def choose_regions(model: nn.Module, weigh: bool = True) -> list[Region]:
    """The regions the step checkpoints, in the model's order (module doc); with `weigh` False, every region, the
    measured ones that keep little too (for a schedule whose backward holds one micro-batch's recomputation, not the
    whole batch's: the small regions' whole-batch saved tensors would stand beside far less)."""
    walk = _Walk(model)
    walk.visit(model)
    unique = _unique(walk.regions)
    measured = [(size, i) for i, size in enumerate(measured_saved(unique)) if size is not None]
    if not measured or not weigh:
        return unique
    # Regions that keep little run as they are, as long as together they keep a small share of the largest
    # region, whose recomputation the backward holds anyway: their recomputation would cost time for little memory.
    kept, budget = set(), _SHARE * max(size for size, _ in measured)
    for size, i in sorted(measured):
        if size > budget:
            break
        budget -= size
        kept.add(i)
    return [r for i, r in enumerate(unique) if i not in kept]


def keep_allowance(regions: list[Region]) -> float:
    """The bytes per sample the regions' kept convolution outputs may take (`kept`): a tenth of the largest region's
    saved bytes, once a step has measured them; nothing before."""
    return _KEEP_SHARE * largest_saved(regions)


def largest_saved(regions: list[Region]) -> float:
    """The largest of the regions' saved bytes per sample, as their last checkpointed forwards measured them (0 before
    any): what the backward's recomputation of that region holds per sample, for every micro-batch at once."""
    return max((size for size in measured_saved(regions) if size is not None), default=0.0)


def measured_saved(regions: list[Region]) -> list[float | None]:
    """Each region's saved bytes per sample, as its last checkpointed forward measured them (None: not yet)."""
    return [SAVED.get(r) for r in regions]


def _unique(regions: list[Region]) -> list[Region]:
    """Each region once (a module reached by two paths: shared, or wrapped by `torch.compile`), in order."""
    seen: set[nn.Module | tuple[nn.Module, int, int]] = set()
    out = []
    for r in regions:
        key = (r.parent, r.start, r.stop) if isinstance(r, Run) else r
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


class RegionMemo:
    """A value per region kept across steps (each step chooses its regions afresh, as new `Run`s): by the region's
    first module, weakly, and its length in modules."""

    def __init__(self) -> None:
        # a region's first module -> {its length: the value}, weakly (`measurements` saves and restores it by name)
        self.by_module: weakref.WeakKeyDictionary[nn.Module, dict[int, Any]] = weakref.WeakKeyDictionary()

    def get(self, region: Region) -> Any:
        return self.by_module.get(_first(region), {}).get(_length(region))

    def set(self, region: Region, value: Any) -> None:
        self.by_module.setdefault(_first(region), {})[_length(region)] = value


def _first(region: Region) -> nn.Module:
    return region.children()[0] if isinstance(region, Run) else region


def _length(region: Region) -> int:
    return region.stop - region.start if isinstance(region, Run) else 0


# the bytes per sample each region's forward saved for the backward, as its last checkpointed forward measured them
# (what `choose_regions` weighs)
SAVED = RegionMemo()


def record_saved(region: Region, per_sample: float) -> None:
    """What a region's forward saved, per sample, for the next steps' choice."""
    SAVED.set(region, per_sample)
