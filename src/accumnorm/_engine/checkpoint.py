"""BatchNorm inside `torch.utils.checkpoint(..., use_reentrant=False)` regions.

A checkpointed region saves none of its activations in the forward; in the backward, unpacking one of
them runs the region's function again (its "recomputation") to save them then. A BatchNorm call inside
the region thus runs twice: in the step's forward, where the schedule normalizes it with the whole
batch's statistics, and in the recomputation, which runs in the backward, outside the step's
TorchFunctionMode (torch does not carry modes into the backward), where torch's BatchNorm would
normalize the micro-batch alone and update the running statistics again.

torch's checkpoint keeps a `_CheckpointFrame` per region: the forward runs under its hooks, whose pack
function holds the frame, and the recomputation calls the frame's `recompute_fn`. `Regions` records,
in the forward, the BatchNorm calls each region makes, in order, with a way to give each one's output
again; and wraps the frame's `recompute_fn` so that its recomputation runs under the step's
TorchFunctionMode, where the i-th BatchNorm call gets the i-th recorded output (and no running
statistic moves). A region with an InstanceNorm call that tracks running statistics recomputes under it
too, for the same reason. The wrapper lives on the frame, which lives as long as the step's graph.
"""
from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from .calls import BNCall, INCall, NormCalls
from .kept import Kept
from .threadstate import saved_tensor_hooks

__all__ = ["Regions", "in_region", "region_frames"]

Recompute = Callable[[Tensor], Tensor]
_FORWARD_HOOK = "_checkpoint_hook.__init__.<locals>.pack_hook"
_RECOMPUTE_HOOK = "_recomputation_hook.__init__.<locals>.pack_hook"


class Regions:
    """The checkpointed regions of one step and the BatchNorm calls each made in its forward.

    `norm_calls(on_batch_norm, on_instance_norm)` makes the step's TorchFunctionMode for a recomputation.
    """

    def __init__(self, norm_calls: Callable[..., NormCalls]) -> None:
        # Weakly: it is a method of the step that holds these regions, and a cycle would keep the step, and what its
        # transaction copied, until Python's next full collection.
        self._norm_calls = weakref.WeakMethod(norm_calls)
        # id(frame) -> (a weak reference to the frame, its calls in order, the frame's own recompute_fn). Weak: a
        # frame holds its region's inputs, which the backward frees region by region as it goes down, as torch's
        # checkpoint would.
        self.calls: dict[int, tuple[weakref.ref, list[Recompute], Any]] = {}
        self.kept: Kept | None = None  # the recompute schedule's kept convolution outputs, while it runs

    def keep_convolutions(self, modules: Iterable[Any], allowance: float, micro_batches: int) -> None:
        """Let the convolutions among `modules` keep their outputs for the recomputation of the regions that `own`
        names, in `allowance` bytes per sample, over the step's `micro_batches` (`kept`), until `clear`."""
        self.kept = Kept(modules, allowance, micro_batches)

    def own(self, frame: Any) -> None:
        """A region frame of the recompute schedule's own (not the user's checkpoint)."""
        if self.kept is not None:
            self.kept.own(frame)

    def convolution(self, module: Any, forward: Callable[..., Tensor], args: tuple, kwargs: dict) -> Tensor:
        """A convolution layer's call in a micro-batch's forward: measured and perhaps kept, in an owned region."""
        if self.kept is not None and module in self.kept.candidates and len(args) == 1 and not kwargs:
            top = torch._C._autograd._top_saved_tensors_default_hooks(False)
            frames = _forward_regions((top,)) if top is not None else ()  # in the region, no hooks of the user's
            if frames and self.kept.owns(frames[0]):
                return self.kept.run(frames[0], module, forward, args[0])
        return forward(module, *args, **kwargs)

    def enter_forward_call(self, recompute: Recompute, hooks: tuple[tuple[Any, Any], ...] | None = None) -> None:
        """Record a forward call, with how to give its output again, in every region it is made in (`hooks`: the
        thread's saved-tensor hooks, when the caller has just read them)."""
        for frame in _forward_regions(saved_tensor_hooks() if hooks is None else hooks):
            self._recorded(frame).append(recompute)

    def enter_instance_norm(self) -> None:
        """An InstanceNorm call with running statistics in a forward: every region it is made in recomputes under the
        step's mode too, where the call gives the same output (the path without running statistics, as in the
        forward: torch's, with them, saves other tensors) and moves no statistic a second time."""
        for frame in _forward_regions(saved_tensor_hooks()):
            self._recorded(frame)

    def _recorded(self, frame: Any) -> list[Recompute]:
        """The calls recorded for `frame`'s region, its recomputation made to run under the step's mode."""
        key = id(frame)
        entry = self.calls.get(key)
        if entry is None or entry[0]() is not frame:
            entry = self.calls[key] = (weakref.ref(frame, lambda _, key=key: self.calls.pop(key, None)), [],
                                       frame.recompute_fn)
            self._recompute_in_step(frame, entry[1])
        return entry[1]

    def _recompute_in_step(self, frame: Any, recorded: list[Recompute]) -> None:
        """Make the region's recomputation run under the step's mode, replaying the recorded calls in order."""
        original, frame_ref = frame.recompute_fn, weakref.ref(frame)  # weak: the frame holds this function

        def recompute_fn(*args: Any) -> Any:
            pending = iter(recorded)

            def batch_norm(call: BNCall) -> Tensor:
                recompute = next(pending, None)
                if recompute is None:
                    raise ValueError("bn='exact': a checkpointed region's recomputation made more BatchNorm calls "
                                     "than its forward; the region's function must make the same calls each time")
                return recompute(call.input)

            # The mode is no local of this frame: torch's early stop ends the recomputation with an exception, whose
            # traceback would keep the mode, and through it what the recorded calls hold, past the recomputation.
            with self._recomputation_mode(frame_ref, batch_norm):
                out = original(*args)
            # Ran to its end (torch's early stop ends it with an exception once everything is saved again).
            if next(pending, None) is not None:
                raise ValueError("bn='exact': a checkpointed region's recomputation made fewer BatchNorm calls than "
                                 "its forward; the region's function must make the same calls each time")
            return out

        frame.recompute_fn = recompute_fn

    def _recomputation_mode(self, frame_ref: weakref.ref, batch_norm: Callable[[BNCall], Tensor]) -> NormCalls:
        """The step's mode for a region's recomputation: the recorded BatchNorm outputs, and the kept convolutions'."""
        mode = self._norm_calls()(batch_norm, INCall.output)  # InstanceNorm: the same output, no update
        if self.kept is not None:
            mode.convolutions = functools.partial(self._replay, frame_ref)
        return mode

    def _replay(self, frame_ref: weakref.ref, module: Any, forward: Callable[..., Tensor], args: tuple,
                kwargs: dict) -> Tensor:
        """A convolution layer's call in a region's recomputation: the kept output, if the call kept one."""
        frame = frame_ref()
        if self.kept is not None and frame is not None and module in self.kept.modules and len(args) == 1 and \
                not kwargs:
            top = torch._C._autograd._top_saved_tensors_default_hooks(False)
            if top is not None and in_recomputation((top,)):  # the region's own, not a region inside it
                return self.kept.replay(frame, module, forward, args[0])
        return forward(module, *args, **kwargs)

    def clear(self) -> None:
        """Let go of the recorded calls, and give each frame its own recompute_fn back, at the end of the step.

        A recorded call holds the whole batch's graph, which holds the region's frame through its saved tensors: a
        cycle through autograd's C++ graph, which Python's collector cannot see. A step that fails before its
        backward would keep it, and every tensor of its forwards, for good."""
        for ref, recorded, own in list(self.calls.values()):
            recorded.clear()
            frame = ref()
            if frame is not None:
                frame.recompute_fn = own
        self.calls.clear()
        if self.kept is not None:
            self.kept.clear()
            self.kept = None


def in_region(hooks: tuple[tuple[Any, Any], ...]) -> bool:
    """Whether a point with these saved-tensor hooks is inside the forward of a checkpointed region."""
    return any(_is_forward_hook(pack) for pack, _ in hooks)


def in_recomputation(hooks: tuple[tuple[Any, Any], ...]) -> bool:
    """Whether a point with these saved-tensor hooks is inside a checkpointed region's recomputation (which runs in
    the backward, under the recomputation's hooks rather than the forward's)."""
    return any(getattr(inspect.unwrap(pack), "__qualname__", "") == _RECOMPUTE_HOOK for pack, _ in hooks)


def region_frames(hooks: tuple[tuple[Any, Any], ...]) -> list[Any]:
    """The `_CheckpointFrame`s of the regions whose forward encloses a point with these hooks, outermost first."""
    return _forward_regions(hooks)


def _is_forward_hook(pack: Any) -> bool:
    fn = inspect.unwrap(pack)
    return getattr(fn, "__qualname__", "") == _FORWARD_HOOK and fn.__module__ == "torch.utils.checkpoint"


def _forward_regions(hooks: tuple[tuple[Any, Any], ...]) -> list[Any]:
    """The `_CheckpointFrame`s of the checkpointed regions whose forward encloses this point (whose hooks are
    `hooks`), outermost first."""
    frames = []
    for pack, _ in hooks:
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
