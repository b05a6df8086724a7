"""BatchNorm inside `torch.utils.checkpoint(..., use_reentrant=False)` regions.

A checkpointed region saves none of its activations in the forward; in the backward, unpacking one of
them runs the region's function again (its "recomputation") to save them then. A BatchNorm call inside
the region thus runs twice: in the step's forward, where the schedule normalizes it with the whole
batch's statistics, and in the recomputation, which runs in the backward, outside the step's
TorchFunctionMode (torch does not carry modes into the backward), where torch's BatchNorm would
normalize the micro-batch alone and update the running statistics again.

torch's checkpoint keeps a `_CheckpointFrame` per region call, and the recompute schedule's own regions a
`recomputation.RegionFrame` (`frames`); the recomputation of either calls the frame's `recompute_fn`.
`RecordedRegions` records, in the forward, the BatchNorm calls each region makes, in order, with a way to give each
one's output again; and wraps the frame's `recompute_fn` so that its recomputation runs under the step's
TorchFunctionMode, where the i-th BatchNorm call gets the i-th recorded output (and no running statistic moves). A
region with an InstanceNorm call that tracks running statistics recomputes under it too, for the same reason. The
wrapper lives on the frame, which lives as long as the step's graph.
"""
from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from ..bn.replay import CallReplay
from ..intercept.calls import BNCall, INCall, NormCalls, Watch
from ..memory.budget import Meter
from ..memory.heap import ResidentBound
from ..safety import untraced
from ..safety.threadstate import dispatch_modes_below, saved_tensor_hooks
from .frames import forward_regions, in_recomputation
from .kept import Kept, KeptCall
from .recomputation import RegionFrame

__all__ = ["RecordedRegions", "Replay"]

Replay = Callable[[Tensor], Tensor]  # a recorded call's output given again from its input

_RECORDS = (RegionFrame, CallReplay, KeptCall)  # what "auto"'s meter opens of a region call's record (`memory.objects`)


def _below(depth: int, replay: Replay, x: Tensor) -> Tensor:
    with dispatch_modes_below(depth):
        return replay(x)


class RecordedRegions:
    """The checkpointed regions of one step and the BatchNorm calls each made in its forward.

    `watch`: what the step's modes share, for the mode each recomputation runs under; `bound`: the step's resident
    memory, checked before each recomputation (what the backward freed since the last) and, in the recompute
    schedule's own regions, at each saved tensor their backward reads.
    """

    def __init__(self, watch: Watch, bound: ResidentBound) -> None:
        self.watch, self.bound = watch, bound
        # id(frame) -> (a weak reference to the frame, its calls in order, the frame's own recompute_fn). Weak: a
        # frame holds its region's inputs, which the backward frees region by region as it goes down, as torch's
        # checkpoint would.
        self.calls: dict[int, tuple[weakref.ref, list[Replay], Any]] = {}
        self.kept: Kept | None = None  # the recompute schedule's kept convolution outputs, while it runs

    def count_records(self, meter: Meter) -> None:
        """Count on "auto"'s `meter` what the step keeps for its regions' recomputations beside their inputs: the
        tables of recorded calls and kept convolution calls, and each frame still alive (`memory.objects`)."""
        tables = [self.calls] if self.kept is None else [self.calls, self.kept.frames]
        frames = {id(f): f for table in tables for ref, *_ in table.values() if (f := ref()) is not None}
        meter.count_objects([*tables, *frames.values()], _RECORDS)

    def keep_convolutions(self, modules: Iterable[Any], allowance: float, micro_batches: int) -> None:
        """Let the convolutions among `modules` keep their outputs for the recomputation of the regions that `own`
        names, in `allowance` bytes per sample, over the step's `micro_batches` (`kept`), until `clear`."""
        self.kept = Kept(modules, allowance, micro_batches)

    def attach(self, mode: NormCalls) -> None:
        """Give a mode of the step's forwards the kept convolutions' calls, while the recompute schedule keeps any."""
        if self.kept is not None:
            mode.convolutions = self.convolution

    def own(self, frame: RegionFrame) -> None:
        """A region frame of the recompute schedule's own (not the user's checkpoint)."""
        if self.kept is not None:
            self.kept.own(frame)
        if self.bound.active:
            # Its backward, for every micro-batch at once, frees and makes much between two recomputations: the bound
            # reads the resident size at each saved tensor the backward reads, to trim what the heap kept of it.
            frame.on_unpack = self.bound.check

    def convolution(self, module: Any, forward: Callable[..., Tensor], args: tuple, kwargs: dict) -> Tensor:
        """A convolution layer's call in a micro-batch's forward: measured and perhaps kept, in an owned region."""
        if self.kept is not None and module in self.kept.candidates and len(args) == 1 and not kwargs:
            top = torch._C._autograd._top_saved_tensors_default_hooks(False)
            frames = forward_regions((top,)) if top is not None else ()  # in the region, no hooks of the user's
            if frames and self.kept.owns(frames[0]):
                return self.kept.run(frames[0], module, forward, args[0])
        return forward(module, *args, **kwargs)

    def enter_forward_call(self, replay: Replay, hooks: tuple[tuple[Any, Any], ...] | None = None,
                           dispatch_depth: int | None = None) -> None:
        """Record a forward call, with how to give its output again, in every region it is made in (`hooks`: the
        thread's saved-tensor hooks, when the caller has just read them). `dispatch_depth`: the call was made under
        the bottom `dispatch_depth` of the thread's dispatch modes alone (by the driver, without the micro-batch's),
        and its output is given again under those alone (`threadstate.dispatch_modes_below`); None: under the
        recomputation's."""
        if dispatch_depth is not None:
            replay = functools.partial(_below, dispatch_depth, replay)
        for frame in forward_regions(saved_tensor_hooks() if hooks is None else hooks):
            self._recorded(frame).append(replay)

    def enter_instance_norm(self) -> None:
        """An InstanceNorm call with running statistics in a forward: every region it is made in recomputes under the
        step's mode too, where the call gives the same output (the path without running statistics, as in the
        forward: torch's, with them, saves other tensors) and moves no statistic a second time."""
        for frame in forward_regions(saved_tensor_hooks()):
            self._recorded(frame)

    def _recorded(self, frame: Any) -> list[Replay]:
        """The calls recorded for `frame`'s region, its recomputation made to run under the step's mode."""
        key = id(frame)
        entry = self.calls.get(key)
        if entry is None or entry[0]() is not frame:
            entry = self.calls[key] = (weakref.ref(frame, untraced.forgetting(self.calls, key)), [], frame.recompute_fn)
            self._recompute_in_step(frame, entry[1])
        return entry[1]

    def _recompute_in_step(self, frame: Any, recorded: list[Replay]) -> None:
        """Make the region's recomputation run under the step's mode, replaying the recorded calls in order."""
        original, frame_ref = frame.recompute_fn, weakref.ref(frame)  # weak: the frame holds this function

        def recompute_fn(*args: Any) -> Any:
            self.bound.check()
            pending = iter(recorded)

            def batch_norm(call: BNCall) -> Tensor:
                replay = next(pending, None)
                if replay is None:
                    raise ValueError("bn='exact': a checkpointed region's recomputation made more BatchNorm calls "
                                     "than its forward; the region's function must make the same calls each time")
                return replay(call.input)

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
        # InstanceNorm: the same output, no update
        mode = NormCalls(batch_norm, INCall.output, self.watch, replays=True)
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


