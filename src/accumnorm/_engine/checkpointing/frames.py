"""Where a point of a forward stands against checkpointed regions: the user's `torch.utils.checkpoint(...,
use_reentrant=False)` regions and the recompute schedule's own (`recomputation`).

Either keeps a frame per region call (torch's `_CheckpointFrame`, or a `RegionFrame`): the region's forward runs
under saved-tensor hooks whose pack function holds the frame, and its recomputation, in the backward, runs under
hooks of its own. The thread's stack of saved-tensor hooks at a point therefore says whether the point is inside a
region's forward (`in_region`), inside a recomputation (`in_recomputation`), and in which regions' frames
(`forward_regions`). Both kinds of frame have the `recompute_fn` the step wraps (`recorded`).
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor

from ..memory.budget import Meter
from ..safety.threadstate import saved_tensor_hooks
from .again import RegionStateChanged
from .recomputation import is_recomputation_hook, region_frame

__all__ = ["end_recomputations_here", "forward_regions", "in_recomputation", "in_region", "in_segment",
           "keeping_nothing"]

_FORWARD_HOOK = "_checkpoint_hook.__init__.<locals>.pack_hook"
_RECOMPUTE_HOOK = "_recomputation_hook.__init__.<locals>.pack_hook"


def in_region(hooks: tuple[tuple[Any, Any], ...]) -> bool:
    """Whether a point with these saved-tensor hooks is inside the forward of a checkpointed region."""
    return any(region_frame(pack) is not None or _is_forward_hook(pack) for pack, _ in hooks)


def in_recomputation(hooks: tuple[tuple[Any, Any], ...]) -> bool:
    """Whether a point with these saved-tensor hooks is inside a checkpointed region's recomputation (which runs in
    the backward, under the recomputation's hooks rather than the forward's)."""
    return any(is_recomputation_hook(pack) or getattr(inspect.unwrap(pack), "__qualname__", "") == _RECOMPUTE_HOOK
               for pack, _ in hooks)


def _is_forward_hook(pack: Any) -> bool:
    fn = inspect.unwrap(pack)
    return getattr(fn, "__qualname__", "") == _FORWARD_HOOK and fn.__module__ == "torch.utils.checkpoint"


def end_recomputations_here() -> None:
    """A forward that ends here, inside checkpointed regions (a pass that stops at its target call): each region's
    recomputation in the backward ends once it has saved again what this forward saved, as torch's early stop ends it.
    With early stop off (`set_checkpoint_early_stop(False)`), it would run the region's function on past this point,
    through calls this forward never made."""
    for frame in forward_regions(saved_tensor_hooks()):
        if hasattr(frame, "early_stop"):  # torch's frames; the recompute schedule's own end where their forward did
            frame.early_stop = True


def forward_regions(hooks: tuple[tuple[Any, Any], ...]) -> list[Any]:
    """The frames of the checkpointed regions whose forward encloses this point (whose hooks are `hooks`),
    outermost first."""
    frames: list[Any] = []
    for pack, _ in hooks:
        own = region_frame(pack)
        if own is not None:
            frames.append(own)
            continue
        if not _is_forward_hook(pack):
            continue
        fn = inspect.unwrap(pack)
        cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
        frame = cells["frame"].cell_contents if "frame" in cells else None
        if not hasattr(frame, "recompute_fn"):
            raise RuntimeError("bn='exact' does not know this version of torch.utils.checkpoint, whose region "
                               "holds no recompute_fn: it cannot make BatchNorm inside the region exact")
        frames.append(frame)
    return frames


class _KeepNothing:
    """A segments region's pack hook: its forward keeps no tensor for a backward (`segmented`), and counts the bytes
    it would have kept (`counted`, a meter without a limit), which its recomputation holds in the backward."""

    def __init__(self) -> None:
        self.counted = Meter(None, None, 1)

    def __call__(self, t: Tensor) -> None:
        self.counted.count(t)


def _nothing_kept(_: Any) -> Any:
    raise RegionStateChanged(
        "the segments schedule keeps nothing of a region's forward, but a backward reached a tensor made inside a "
        "region by another way than the region's outputs (a hook's or module's stash): its gradient would be lost")


def keeping_nothing() -> tuple[Any, _KeepNothing]:
    """Saved-tensor hooks that keep nothing: a segments region's forward, whose backward is its recomputation; and
    their pack hook, whose `counted.bytes` are what they did not keep."""
    pack = _KeepNothing()
    return torch.autograd.graph.saved_tensors_hooks(pack, _nothing_kept), pack


def in_segment(hooks: tuple[tuple[Any, Any], ...]) -> bool:
    """Whether a point with these saved-tensor hooks is inside the forward of a segments region."""
    return any(isinstance(pack, _KeepNothing) for pack, _ in hooks)
