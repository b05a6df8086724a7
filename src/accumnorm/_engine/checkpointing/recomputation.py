"""The recompute schedule's own checkpoint: one call of a region, whose saved tensors a recomputation gives back.

What `torch.utils.checkpoint(..., use_reentrant=False)` does for one region call, for the regions the schedule
makes itself (the user's own checkpoints stay torch's):

- in the forward, the region's function runs under saved-tensor hooks that keep, for each tensor it saves, only
  its place and its metadata (shape, dtype, device);
- the frame keeps the region's inputs, packed by the hooks below its own (the step's host store or meter, where
  there is one), the random state the forward began with, and the modes it ran in (`threadstate.Modes`: grad
  mode, autocast, the process's flags; and a `torch.device` context), to run it again with (`rerun`);
- in the backward, the first unpack of a graph task runs the function again (`recompute_fn`, which the step may
  wrap: `recorded`) with those, under a hook that keeps what it saves, in order; each unpack takes its tensor
  and lets it go.

It refuses what torch's refuses, with torch's `CheckpointError`: a recomputation that saves more or fewer tensors,
or tensors of other metadata. It also refuses an input changed in place since the forward, and a tensor changed
in place after the recomputation saved it, as autograd refuses for the tensors it keeps itself; and a recomputation
whose outputs are not the forward's (`again`: a number drawn outside torch's generators, a draw another thread took
from the region's stream), which would back-propagate through another forward than the one that ran.

Why not torch's: its frame is general (several device types, selective checkpointing, early stop, debug logs),
and each call walks its arguments with `tree_map` twice, makes a holder and a weak reference per saved tensor, a
dict of metadata per saved tensor, and a garbage cycle. On a net of small regions that is most of the
recomputation's time (`docs/cost.md`). The recomputation runs to the function's end (torch's stops once the last
tensor is saved again): a region's tail after its last saved tensor is one op or none.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import CheckpointError

from ..safety import untraced
from .again import RegionStateChanged, check_kept, check_outputs, fingerprint, tensor_leaves
from .rerun import rerun_later

__all__ = ["RegionFrame", "is_recomputation_hook", "region_frame"]

_autograd = torch._C._autograd
_push, _pop, _top = (_autograd._push_saved_tensors_default_hooks, _autograd._pop_saved_tensors_default_hooks,
                     _autograd._top_saved_tensors_default_hooks)
_graph_task = torch._C._current_graph_task_id

Metadata = tuple[torch.Size, torch.dtype, torch.device]  # a saved tensor's, which its recomputation must match


class RegionFrame:
    """One call of a region: its inputs, what its forward saved, and its recomputation in the backward.

    `recompute_fn(*inputs)` runs the region's function again as the forward ran it; the step may replace it with a
    wrapper (`recorded.RecordedRegions`). `metadata`: (shape, dtype, device) of each tensor the forward saved, each
    the one tuple `interned` holds for it (shared by the frames of a step, which save tensors of few shapes, over
    many region calls and micro-batches).
    """

    def __init__(self, fn: Callable[..., Any], inputs: Sequence[Tensor], cpu_state: Tensor,
                 interned: dict[Metadata, Metadata]) -> None:
        self.metadata: list[Metadata] = []
        self._interned = interned
        self.recompute_fn = rerun_later(fn, inputs, cpu_state)
        below = _top(False)  # the step's store or meter: the inputs are tensors the step keeps for its backward
        self.inputs_as_given = below is None  # kept as the tensors given, not packed by a hook below
        if below is None:
            self._inputs = [(None, t, t._version, t.requires_grad) for t in inputs]
        else:
            self._inputs = [(below[1], below[0](t), t._version, t.requires_grad) for t in inputs]
        self._recomputed: dict[int, list[Any]] = {}  # graph task -> the saved tensors again, each until unpacked
        self._recomputing = False
        self.on_unpack: Callable[[], None] | None = None  # called as the backward reads each saved tensor (`unpack`)
        self.outputs: Tensor | None = None  # the fingerprints of the forward's tensor outputs (`again`)
        # the forward's one output and its version: not yet fingerprinted (`forward`), or held by the next region as
        # its input (`hand_on`), which the recomputation's is compared with
        self.pending: tuple[Tensor, int] | None = None
        self.handed_on: tuple[Tensor, int] | None = None
        self._missed: Callable[[], None] | None = None
        # the forwards are over: the next recomputation is the step's backward's, the last, which lets go of the
        # output handed on once compared (it is a whole boundary of the batch, which the backward would have freed)
        self.last_recomputation = False
        self._let_go = False

    def forward(self, fn: Callable[..., Any], inputs: Sequence[Tensor], later: Callable[[], None] | None = None
                ) -> Any:
        """`fn(*inputs)`, its saved tensors left to the recomputation. With `later`, an output that is one tensor is
        not fingerprinted yet: the next region may keep it as its input (`hand_on`); `settle` takes it otherwise, or
        calls `later()` where it can no longer be read as the forward made it."""
        _push(self.pack, self.unpack)
        try:
            out = fn(*inputs)
        finally:
            _pop()
        if later is not None and type(out) is Tensor:
            self.pending, self._missed = (out, out._version), later
        else:
            self.outputs = fingerprint(tensor_leaves(out))
        return out

    def hand_on(self) -> None:
        """The output left for later is the next region's input, kept unchanged until the recomputation: the output
        it must give again, in place of a fingerprint."""
        self.handed_on, self.pending = self.pending, None

    def let_go(self) -> None:
        """Let go of the output held (left for later, or handed on): nothing is left to check a recomputation
        against."""
        if self.pending is not None or self.handed_on is not None:
            self.pending = self.handed_on = self._missed = None
            self._let_go = True

    def settle(self) -> None:
        """Fingerprint the output left for later, which no region kept: as the forward made it, or a refusal where
        it has changed in place since, which leaves nothing to check the recomputation against."""
        if self.pending is None:
            return
        (out, version), self.pending = self.pending, None
        if out._version != version:
            if self._missed is not None:
                self._missed()
            raise RegionStateChanged(
                "the recompute schedule checks a region's recomputation against its forward's output, but that output "
                "was changed in place after the region returned it, before the step could read it; the next steps "
                "read it at once")
        self.outputs = fingerprint([out])

    def pack(self, t: Tensor) -> int:
        metadata, key = self.metadata, (t.shape, t.dtype, t.device)
        metadata.append(self._interned.setdefault(key, key))
        return len(metadata) - 1

    def unpack(self, index: int) -> Tensor:
        if self.on_unpack is not None:
            self.on_unpack()
        task = _graph_task()
        saved = self._recomputed.get(task)
        if saved is None:
            saved = untraced.call(_recompute)(self)
            if task != -1:  # outside a backward (a saved tensor read by hand) each read recomputes, as torch's does
                self._recomputed[task] = saved
        entry, saved[index] = saved[index], None
        if entry is None:
            raise CheckpointError("torch.utils.checkpoint: Unpack is being triggered for a tensor that was already "
                                  "unpacked once, in a region of accumnorm's recompute schedule: a backward must read "
                                  "each saved tensor once")
        t, version = entry
        if t._version != version:
            raise _changed_in_place(
                "a tensor", "saved inside", t, version, "the region's forward changes it in place after an op saved "
                "it, which whole-batch torch refuses too", ". Nothing was changed. Change a copy (.clone()) instead")
        saved[-1] -= 1
        if saved[-1] == 0:
            self._recomputed.pop(task, None)
        return t

    def inputs(self) -> list[Tensor]:
        """The region's inputs as the forward had them: a hook below may give back a tensor that has let go of its
        place in the graph (a copy from the host store), which then requires grad as the forward's did."""
        inputs = []
        for unpack, packed, version, requires_grad in self._inputs:
            t = packed if unpack is None else unpack(packed)
            if t.requires_grad != requires_grad:
                t = t.detach().requires_grad_(requires_grad)
            elif t is packed and t._version != version:
                raise _changed_in_place("an input", "of", t, version,
                                        "changed in place after the region's forward, which whole-batch torch refuses "
                                        "too")
            inputs.append(t)
        return inputs


class _Recomputing:
    """A recomputation's pack hook: each tensor it saves, with its version, in order (`is_recomputation_hook`)."""

    def __init__(self) -> None:
        self.saved: list[Any] = []

    def __call__(self, t: Tensor) -> Tensor:
        t = t.detach() if t.requires_grad else t  # the recomputation's own graph is never back-propagated
        self.saved.append((t, t._version))
        return t


def _identity(t: Tensor) -> Tensor:
    return t


_OTHER_OUTPUTS = ("the recompute schedule runs a region's forward again in the backward, but its recomputation gave "
                  "other outputs than its forward (a number drawn outside torch's generators, state its forward "
                  "changed, or draws another thread took from torch's default generators meanwhile): it would not be "
                  "exact")


@untraced.untraced
def _recompute(frame: RegionFrame) -> list[Any]:
    """The tensors `frame`'s forward saved, made again, with a count of those not yet unpacked at the end."""
    if frame._recomputing:
        raise RuntimeError("bn='exact': a region of the recompute schedule read, in its recomputation, a tensor its "
                           "own forward saved (torch's selective checkpointing inside the region?), which only the "
                           "recomputation being run can give; use schedule='layerwise' for this model")
    hook = _Recomputing()
    inputs = frame.inputs()
    frame._recomputing = True
    _push(hook, _identity)
    try:
        with torch.enable_grad():
            out = frame.recompute_fn(*inputs)
    finally:
        _pop()
        frame._recomputing = False
    frame.settle()  # a recomputation before the forwards' end (an autograd.grad in a loss)
    if frame.handed_on is not None:
        _check_handed_on(frame, out)
    elif frame.outputs is not None:
        check_outputs(tensor_leaves(out), frame.outputs, _OTHER_OUTPUTS)
    elif frame._let_go:
        raise RegionStateChanged("a region of the recompute schedule ran again after the step's backward had checked "
                                 "and let go of its forward's output (a backward inside a backward hook?): nothing is "
                                 "left to check that run against")
    saved, metadata = hook.saved, frame.metadata
    if len(saved) != len(metadata):
        raise CheckpointError("torch.utils.checkpoint: A different number of tensors was saved during the original "
                              f"forward and recomputation (forward: {len(metadata)}, recomputation: {len(saved)}), in "
                              "a region of accumnorm's recompute schedule: its function must do the same each time")
    different = [(i, m, (t.shape, t.dtype, t.device)) for i, ((t, _), m) in enumerate(zip(saved, metadata))
                 if (t.shape, t.dtype, t.device) != m]
    if different:
        raise CheckpointError(
            "torch.utils.checkpoint: Recomputed values for the following tensors have different metadata than during "
            "the forward pass, in a region of accumnorm's recompute schedule: "
            + "; ".join(f"tensor at position {i}: saved {m}, recomputed {r}" for i, m, r in different[:5]))
    saved.append(len(metadata))
    return saved


def _check_handed_on(frame: RegionFrame, out: Any) -> None:
    """Check a recomputation against the forward's output that the next region kept (`again.check_kept`); let go of
    that output after the step's backward's recomputation."""
    kept, version = frame.handed_on
    if kept._version != version:
        raise _changed_in_place("the output", "of", kept, version, "changed in place after the next region took it, "
                                "which leaves nothing to check the region's recomputation against")
    check_kept(tensor_leaves(out), kept, _OTHER_OUTPUTS)
    if frame.last_recomputation:
        frame.let_go()


def _changed_in_place(what: str, where: str, t: Tensor, version: int, why: str, then: str = "") -> RuntimeError:
    """autograd's error for a tensor it needs that changed in place since it was kept: which one (`what`, `where`
    in a region), `why`, and what `then`."""
    return RuntimeError(
        f"one of the variables needed for gradient computation has been modified by an inplace operation: {what} of "
        f"shape {tuple(t.shape)} {where} a region of the recompute schedule is at version {t._version}; expected "
        f"version {version} instead ({why}){then}")


def region_frame(pack: Any) -> RegionFrame | None:
    """The frame whose forward's pack hook `pack` is, if it is one."""
    frame = getattr(pack, "__self__", None)
    return frame if type(frame) is RegionFrame else None


def is_recomputation_hook(pack: Any) -> bool:
    """Whether `pack` is a recomputation's pack hook."""
    return isinstance(pack, _Recomputing)
