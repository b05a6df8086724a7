"""The C heap's free memory handed back to the OS (`memory.heap`): what the call does, where it is made."""
from __future__ import annotations

import sys

import pytest
import torch

from accumnorm._engine.memory import heap


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(heap._TRIM is None, reason="the C library is not glibc: there is no malloc_trim")
def test_the_free_pages_a_fragmented_heap_keeps_go_back_to_the_os():
    """Blocks freed between blocks still in use cannot be joined and handed back from the heap's top: they stay
    resident until the call."""
    freed, kept = [], []
    for _ in range(400):  # blocks of 80 KiB and 4 KiB in turn, under glibc's mmap threshold: from the heap
        freed.append(torch.ones(20_000))
        kept.append(torch.ones(1024))
    del freed
    before = _resident()
    heap.release_free_memory(torch.device("cpu"))
    assert before - _resident() > 16 << 20  # of the 31 MiB freed; pages a block shares with its neighbours stay
    assert all(bool((t == 1).all()) for t in kept)


def test_only_a_cpu_step_calls_it(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "_TRIM", lambda pad: calls.append(pad) or 1)
    heap.release_free_memory(torch.device("meta"))
    assert calls == []
    heap.release_free_memory(torch.device("cpu"))
    assert calls == [0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim is looked for on Linux only")
def test_glibc_is_found_where_it_is_the_c_library():
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("the C library is not glibc")
    assert heap._TRIM is not None
