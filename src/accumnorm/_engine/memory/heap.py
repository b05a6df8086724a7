"""Handing the C heap's free memory back to the OS: where the segments schedule lets go of a region, and where a
CPU step nears its memory budget.

A CPU tensor's memory comes from the C library's `malloc`. glibc keeps what is freed in its heap for the next
requests, resident, and a freed block can serve only requests that fit in it. The segments schedule frees one
region's recomputation after another, each of other sizes (a net's activations grow towards its input), so the
blocks its backward freed hold pages the next, larger requests cannot use: the process's resident memory grows
well past its live tensors, and a budget on the CPU (where running out is the kernel ending the process) is a
budget of resident memory. `malloc_trim(0)` hands every free page of glibc's heaps back to the OS; the memory a
later request touches again costs a page fault.

Beside those trims at fixed points, `ResidentBound` keeps a step's resident growth under its memory budget: the
lockstep schedules' micro-batches, interleaved, free blocks of one size while others need blocks of another, and
their recomputations in the backward free one region's blocks after another, so the pages glibc keeps can grow
far past the live tensors (passes' too, one micro-batch's blocks after another's). It reads the process's resident
size at each micro-batch's turn (passes: after each micro-batch's pass), before each recomputation in the backward
and at each saved tensor a lockstep's backward unpacks (`saved_tensor_hooks`), and trims only once the step has
added more than four fifths of its budget (the
rest is room for what a turn adds before the next check): each trim hands pages back that the next requests fault
in again, a cost paid only where the budget needs it. Where "auto" runs a schedule by an earlier step's measurement
of what it needs, and that is at most a sixteenth of the budget, the step runs without the checks, which would never
trim there (`ResidentBound.waived`).

Why not torch's way: on CUDA the caching allocator frees its cached blocks and retries before it runs out, and
the budget counts allocated bytes there (`torch.cuda.max_memory_allocated`), so nothing is done on CUDA. Where
the C library is not glibc (macOS, musl, Windows), there is no such call, and nothing is done either.
"""
from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor

from ..safety import untraced
from .store import keep, unkeep

__all__ = ["ResidentBound", "release_free_memory"]

_TRIGGER = 0.8  # of the budget, the step's resident growth past which `ResidentBound` trims
# A schedule measured to need at most this share of the budget runs without the bound's checks (`waived`): the
# resident growth would reach the trigger only through free pages over 12 times its live tensors, where the most
# measured (MONAI's UNet under recompute, docs/schedules.md) is 8 times.
_FAR = 1 / 16


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def release_free_memory(device: torch.device) -> None:
    """Hand the free pages of the C heap back to the OS, for a step on the CPU (module doc); nothing on another
    device, or without glibc."""
    if device.type == "cpu" and _TRIM is not None:
        _TRIM(0)


class ResidentBound:
    """Trims the C heap (module doc) whenever the process's resident memory has grown by more than four fifths of
    `budget` bytes since the bound was made (at the start of an `accumnorm.backward` call, which every attempt of its
    step shares): for a step on the CPU with glibc and Linux's /proc; nothing elsewhere, or without a budget. The
    checks read the resident size between `start` and `close` (a schedule's lockstep). After a trim that leaves the
    growth past that point (the live tensors near the budget), the next one waits until half of what is left of the
    budget has come on top, so that trims do not follow every turn."""

    def __init__(self, budget: int | None, device: torch.device) -> None:
        self.budget = budget
        self.active = budget is not None and device.type == "cpu" and _TRIM is not None and _PAGE is not None
        self.fd: int | None = None
        self.base = self._resident() if self.active else 0
        self.trigger = int(_TRIGGER * budget) if self.active else 0

    def start(self) -> None:
        """Let `check` read the resident size, until `close`."""
        if self.active and self.fd is None:
            self.fd = os.open("/proc/self/statm", os.O_RDONLY)

    def check(self) -> None:
        """Trim if the resident growth since the bound was made has passed the trigger."""
        if self.fd is None or self._resident() - self.base <= self.trigger:
            return
        _TRIM(0)
        grown = self._resident() - self.base
        self.trigger = max(int(_TRIGGER * self.budget), grown + max(0, self.budget - grown) // 2)

    def saved_tensor_hooks(self, store: Any = None) -> AbstractContextManager:
        """`store`'s saved-tensor hooks (a `Store`'s or a `Meter`'s; None: none). While the bound is active, their
        unpack first reads it (`check`), with a plain pair where there is no store: a backward that frees one layer's
        saved tensors of the whole batch and makes gradients in their place, blocks of other sizes, grows the heap's
        free pages between the schedule's own readings."""
        if not self.active:
            return store.hooks() if store is not None else nullcontext()
        pack = store.pack if store is not None else keep
        unpack = store.unpack if store is not None else unkeep

        def checked(packed: Any) -> Tensor:
            self.check()
            return unpack(packed)

        return torch.autograd.graph.saved_tensors_hooks(untraced.wrap(pack), untraced.wrap(checked))

    @contextmanager
    def waived(self, need: int | None) -> Iterator[None]:
        """No checks in the block if it runs a schedule measured to need `need` bytes (None: not measured) at most
        `_FAR` of the budget: far below it, where they would never trim. Their hooks run at every tensor autograd
        saves, and on a model of small layers cost the step a sixth of its time."""
        was = self.active
        self.active = was and (need is None or need > _FAR * self.budget)
        try:
            yield
        finally:
            self.active = was

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _resident(self) -> int:
        if self.fd is not None:
            return int(os.pread(self.fd, 64, 0).split()[1]) * _PAGE
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * _PAGE
        except OSError:  # no /proc: nothing to read, nothing done
            self.active = False
            return 0


def _page_size() -> int | None:
    """The page size, where /proc/self/statm gives the resident size in pages (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    return os.sysconf("SC_PAGE_SIZE")


_PAGE = _page_size()
