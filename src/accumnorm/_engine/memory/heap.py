"""Handing the C heap's free memory back to the OS, where the segments schedule's CPU steps let go of a region.

A CPU tensor's memory comes from the C library's `malloc`. glibc keeps what is freed in its heap for the next
requests, resident, and a freed block can serve only requests that fit in it. The segments schedule frees one
region's recomputation after another, each of other sizes (a net's activations grow towards its input), so the
blocks its backward freed hold pages the next, larger requests cannot use: the process's resident memory grows
well past its live tensors, and a budget on the CPU (where running out is the kernel ending the process) is a
budget of resident memory. `malloc_trim(0)` hands every free page of glibc's heaps back to the OS; the memory a
later request touches again costs a page fault.

Why not torch's way: on CUDA the caching allocator frees its cached blocks and retries before it runs out, and
the budget counts allocated bytes there (`torch.cuda.max_memory_allocated`), so nothing is done on CUDA. Where
the C library is not glibc (macOS, musl, Windows), there is no such call, and nothing is done either.
"""
from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

import torch

__all__ = ["release_free_memory"]


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
