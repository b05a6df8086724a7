"""Convolutions whose outputs a recompute region keeps, so that its recomputation need not run them again.

A checkpointed region runs its whole forward again in the backward. Most of that time goes to convolutions,
and a convolution that sums many products for each value it outputs (`in_channels / groups` x kernel size: its
reduction) costs much time for the memory its output takes. Inside the recompute schedule's own regions, the
convolutions of reduction `MIN_REDUCTION` or more are candidates, and each step measures the bytes their outputs
take per sample. From the next step on, the candidates of the largest reductions keep their outputs, as many as
fit in an allowance per sample (a tenth of the largest region's saved bytes, `regions.keep_allowance`). Kept, a
convolution runs once per step:

- in the region's forward it runs as usual, under a pack hook that notes which of its arguments autograd saved;
  a copy of its output is kept, packed by the step's own saved-tensor hooks (the hooks below the region's: the
  host store or the budget's meter, where there is one), as any tensor the step keeps for its backward;
- in the recomputation the same call packs those same arguments in the region's place, as the convolution
  did, and gives the kept output back instead of running.

Only a call of the forward's, in its order, with the same module and input shape, gets its output back; an
argument autograd saved that is not the call's own (an autocast copy), or a call the recomputation makes
otherwise runs again as usual, which is what the region would have done. What is kept is a copy of the output
as the convolution made it, so that what the forward did to the output afterwards, in place too (a
`ReLU(inplace=True)`, a write through `.data`), the recomputation does again to the copy: the result is the
forward's, bit for bit, so exactness is unchanged.

Why not torch's selective checkpointing (`context_fn`): its TorchDispatchMode sees every op of every region,
in the forward and again in the recomputation, a Python call per op, and it refuses a kept output changed in
place instead of running that op again.
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from ..intercept.forwards import CONVOLUTIONS
from ..safety import untraced
from ..safety.threadstate import saved_tensor_hooks

__all__ = ["MIN_REDUCTION", "OUTPUT_BYTES", "Kept", "KeptCall", "choose", "keeps", "output_bytes"]

MIN_REDUCTION = 256  # in_channels / groups x kernel size: a convolution that does this much per output value
# a candidate convolution -> the bytes per sample of its outputs in the regions, as its last step measured them
OUTPUT_BYTES: weakref.WeakKeyDictionary[nn.Module, float] = weakref.WeakKeyDictionary()


def keeps(conv: nn.Module) -> bool:
    """Whether a convolution's output may be worth keeping: a candidate (module doc)."""
    return type(conv) in CONVOLUTIONS and _reduction(conv) >= MIN_REDUCTION


def output_bytes(conv: nn.Module) -> float | None:
    """The bytes per sample of a candidate's outputs in the regions, as its last step measured them (None: not yet)."""
    return OUTPUT_BYTES.get(conv)


class KeptCall:
    """One kept convolution call of a region's forward: a copy of its output, packed by the step's own saved-tensor
    hooks. A copy, not the output: the forward may change its output in place afterwards (`ReLU(inplace=True)`, or
    through `.data`, which no version counter sees), and the recomputation does that again to what it is given."""

    __slots__ = ("module", "shape", "packed", "unpack", "roles")

    def __init__(self, module: nn.Module, shape: torch.Size, output: Tensor, roles: list[int] | None,
                 hooks: tuple[Any, Any] | None) -> None:
        self.module, self.shape, self.roles = module, shape, roles
        self.packed = self.unpack = None  # nothing kept of a call that cannot give its output back
        if roles is not None:
            kept = output.detach().clone()
            self.unpack = None if hooks is None else hooks[1]
            self.packed = kept if hooks is None else hooks[0](kept)

    def given(self) -> Tensor:
        return self.packed if self.unpack is None else self.unpack(self.packed)


class Kept:
    """The kept convolution outputs of one step's regions, per region frame (a micro-batch's call of a region)."""

    def __init__(self, modules: Iterable[nn.Module], allowance: float, micro_batches: int) -> None:
        """`allowance`: the bytes per sample the kept outputs may take; `micro_batches`: the step's K."""
        candidates = [m for m in modules if keeps(m)]  # in the model's order, which breaks the choice's ties
        self.candidates = frozenset(candidates)
        self.modules = choose(candidates, allowance)  # the convolutions that keep their outputs
        self.micro_batches = micro_batches
        # each candidate's output bytes per sample, summed over its calls in every micro-batch of this step
        self.sizes: dict[nn.Module, float] = dict.fromkeys(self.candidates, 0.0)
        # each owned frame's kept calls, in order (lists: one per region call and micro-batch, most left empty)
        self.frames: dict[int, tuple[weakref.ref, list[KeptCall]]] = {}

    def own(self, frame: Any) -> None:
        """Keep convolution outputs in this region frame (one of the schedule's own regions, not the user's)."""
        key = id(frame)
        self.frames[key] = (weakref.ref(frame, untraced.forgetting(self.frames, key)), [])

    def owns(self, frame: Any) -> bool:
        entry = self.frames.get(id(frame))
        return entry is not None and entry[0]() is frame

    def run(self, frame: Any, module: nn.Module, forward: Callable[..., Tensor], input: Tensor) -> Tensor:  # noqa: A002
        """A candidate's call directly in an owned region frame's forward: measured, and kept if it is chosen."""
        out = self._record(frame, module, forward, input) if module in self.modules else forward(module, input)
        self.sizes[module] += out.numel() * out.element_size() / max(1, input.shape[0])
        return out

    def _record(self, frame: Any, module: nn.Module, forward: Callable[..., Tensor],
                input: Tensor) -> Tensor:  # noqa: A002
        """Run a convolution, keeping its output. The output is packed by the hooks below the region's (the step's
        store or meter, if any), as a tensor the step saves."""
        hooks = saved_tensor_hooks()
        pack, unpack = hooks[-1]
        packed: list[Tensor] = []

        def observe(t: Tensor) -> Any:
            packed.append(t)
            return pack(t)

        with torch.autograd.graph.saved_tensors_hooks(observe, unpack):
            out = forward(module, input)
        args = _arguments(module, input)
        roles = [next((i for i, a in enumerate(args) if a is t), -1) for t in packed]
        self.frames[id(frame)][1].append(KeptCall(module, input.shape, out, None if -1 in roles else roles,
                                               hooks[-2] if len(hooks) > 1 else None))
        return out

    def seal(self) -> None:
        """The forwards are over: note the candidates' sizes."""
        for m, size in self.sizes.items():
            if size:
                OUTPUT_BYTES[m] = size / self.micro_batches

    def replay(self, frame: Any, module: nn.Module, forward: Callable[..., Tensor], input: Tensor) -> Tensor:  # noqa: A002
        """A convolution of a region's recomputation: the forward's output again where it can be (module doc)."""
        entry = self.frames.get(id(frame))
        calls = entry[1] if entry is not None and entry[0]() is frame else None
        call = calls.pop(0) if calls else None
        if call is None or call.module is not module or call.shape != input.shape:
            if calls:
                calls.clear()  # out of step with the forward: the rest of the region runs as it is
            return forward(module, input)
        if call.roles is None:
            return forward(module, input)
        pack = torch._C._autograd._top_saved_tensors_default_hooks(False)[0]
        args = _arguments(module, input)
        for role in call.roles:
            pack(args[role])
        if torch.is_grad_enabled() and any(a is not None and a.requires_grad for a in args):
            return _Given.apply(call.given, *(a for a in args if a is not None))
        return call.given()

    def clear(self) -> None:
        self.frames.clear()


def choose(candidates: list[nn.Module], allowance: float) -> frozenset[nn.Module]:
    """The measured candidates of the largest reductions whose outputs fit in `allowance` bytes per sample."""
    chosen, left = [], allowance
    for m in sorted((m for m in candidates if m in OUTPUT_BYTES), key=lambda m: (-_reduction(m), OUTPUT_BYTES[m])):
        if OUTPUT_BYTES[m] <= left:
            chosen.append(m)
            left -= OUTPUT_BYTES[m]
    return frozenset(chosen)


def _arguments(conv: nn.Module, input: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:  # noqa: A002
    """A convolution call's tensors, in the order its saved tensors' roles name them."""
    return input, conv.weight, conv.bias


def _reduction(conv: nn.Module) -> int:
    w = conv.weight
    return w.shape[1] * math.prod(w.shape[2:])


class _Given(torch.autograd.Function):
    """A kept output given back in a recomputation, as a non-leaf that requires grad (what comes next in the region
    saves what it saved in the forward), made in the forward rather than passed in: not a view of an input, so that
    the region may go on in place (`ReLU(inplace=True)`). The recomputation's graph is never back-propagated: the
    forward's is."""

    @staticmethod
    def forward(ctx, given, *arguments):  # type: ignore[override]
        return given()

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        raise RuntimeError("bn='exact': a backward through a checkpointed region's recomputation of a convolution, "
                           "which has no gradient of its own (the forward's call has)")
