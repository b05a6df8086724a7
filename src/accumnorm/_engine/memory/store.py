"""Where the layerwise schedule keeps the whole batch's saved tensors: `store=`.

The K micro-batches' graphs live together until the backward. On a GPU their saved tensors can go to
pinned host memory instead (the default there), copied back when the backward needs them, so that the
device holds about what one micro-batch needs.

On CUDA the copies keep out of the compute's way (`_HostCopies`). Each runs on a side stream of its own
device, after the work that made the tensor; the source's memory is not reused before its copy is done
(`record_stream`). The host blocks come from torch's caching host allocator (`pin_memory=True`), which is
the pool: it hands a freed pinned block to the next allocation of its size once the copies recorded on it
are done, so after the first step no pinned memory is allocated. In the backward, fetching a tensor also
starts the copies back of the next few in reverse packing order, the order the backward needs them in,
and the compute stream waits on an event of each copy it reads, not on the side stream's later work.
"""
from __future__ import annotations

import weakref
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch import Tensor

from ..safety import untraced

__all__ = ["Saved", "Store", "keep", "python_tensor", "resolve_store", "store_for", "unkeep"]

# Copies back started ahead of the backward: enough to hide one copy behind the compute of the previous ones,
# few enough that the device holds little beyond what the backward reads next.
_FETCH_AHEAD = 4


def python_tensor(t: Tensor) -> bool:
    """Whether `t`'s ops run its class's `__torch_dispatch__` (a wrapper subclass): its own storage holds none of its
    values, which are in tensors it keeps as attributes."""
    return torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python)


def resolve_store(store: Any) -> torch.device:
    """The device `store=` names: None for the default (the host: on CUDA pinned memory), "cpu", or a torch.device."""
    if store is None:
        return torch.device("cpu")
    if isinstance(store, str):
        try:
            return resolve_store(torch.device(store))
        except RuntimeError:
            raise ValueError(f"store must be None, 'cpu' or a torch.device, got the string {store!r}") from None
    if isinstance(store, torch.device):
        if store.type == "meta" or (store.type == "cuda" and not torch.cuda.is_available()):
            raise ValueError(f"store must be a device that can hold tensors here, got {store} "
                             f"(CUDA available: {torch.cuda.is_available()}); use None or 'cpu'")
        if store.type == "cuda" and store.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return store
    raise TypeError(f"store must be None, 'cpu' or a torch.device, got {type(store).__name__} {store!r}")


class Saved(NamedTuple):
    """A saved tensor kept where it is, and its version when autograd saved it (`keep`)."""

    tensor: Tensor
    version: int


def keep(t: Tensor) -> Saved:
    """A saved tensor kept where it is: itself, but a node's output as a detached alias (which shares its version
    counter), which would otherwise hold its own node, a cycle through autograd's C++ that Python's collector cannot
    see and that keeps a failed step's graph (and its model) alive. With its version: saved-tensor hooks turn off
    torch's check that nothing changed a saved tensor in place before the backward, which `unkeep` makes again."""
    return Saved(t if t.grad_fn is None else t.detach(), t._version)


def unkeep(kept: Saved) -> Tensor:
    """The kept tensor, refused as torch's backward refuses it if it was changed in place since it was saved."""
    t, version = kept
    if t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{t.type()} {list(t.shape)}] is at version {t._version}; expected version {version} instead. Hint: "
            "autograd saved it in a forward of accumnorm's step, and it was changed in place before the backward read "
            "it, which torch refuses")
    return t


class Store:
    """Saved-tensor hooks that keep what autograd saves on `device` (pinned when it is the host of a GPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pin = device.type == "cpu" and torch.cuda.is_available()
        self._host = _HostCopies() if self.pin else None

    def hooks(self) -> AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(untraced.wrap(self.pack), untraced.wrap(self.unpack))

    def pack(self, t: Tensor) -> Any:
        # Parameters are kept by reference: copying a weight once per micro-batch would only waste memory.
        if isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad) or t.device == self.device:
            return keep(t)
        if self._host is not None and t.is_cuda:
            return self._host.pack(t)
        packed = torch.empty_like(t, device=self.device)
        packed.copy_(t)
        return t.device, packed

    def unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, Saved):
            return unkeep(packed)
        if isinstance(packed, _OnHost):
            return self._host.unpack(packed)
        device, t = packed
        return t.to(device, non_blocking=True)


class _OnHost:
    """A saved CUDA tensor's pinned host copy, and its copy back to the device once one is started."""

    __slots__ = ("host", "device", "index", "fetched", "ready", "__weakref__")

    def __init__(self, host: Tensor, device: torch.device, index: int) -> None:
        self.host, self.device, self.index = host, device, index
        self.fetched: Tensor | None = None  # the copy back, on the device, until the backward reads it
        self.ready: torch.cuda.Event | None = None  # recorded on the side stream after that copy


class _HostCopies:
    """CUDA tensors to pinned host memory and back on side streams, fetched ahead in the backward (module doc)."""

    def __init__(self) -> None:
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self.packed: list[weakref.ref[_OnHost]] = []  # in packing order; a copy autograd let go of is gone

    def _side(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]

    def pack(self, t: Tensor) -> _OnHost:
        compute, side = torch.cuda.current_stream(t.device), self._side(t.device)
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        side.wait_stream(compute)  # the tensor's values are computed before they are read
        with torch.cuda.stream(side):
            host.copy_(t, non_blocking=True)
        t.record_stream(side)  # its memory is not reused until the copy is done
        saved = _OnHost(host, t.device, len(self.packed))
        self.packed.append(weakref.ref(saved))
        return saved

    def unpack(self, saved: _OnHost) -> Tensor:
        self._fetch(saved)
        for i in range(saved.index - 1, max(saved.index - 1 - _FETCH_AHEAD, -1), -1):
            ahead = self.packed[i]()
            if ahead is not None:
                self._fetch(ahead)
        t, ready = saved.fetched, saved.ready
        saved.fetched = saved.ready = None  # read once; a second backward (retain_graph) copies it back again
        compute = torch.cuda.current_stream(saved.device)
        compute.wait_event(ready)
        t.record_stream(compute)  # allocated on the side stream, read on this one
        return t

    def _fetch(self, saved: _OnHost) -> None:
        """Start the copy back of `saved` on its side stream, unless it is under way."""
        if saved.fetched is not None:
            return
        side = self._side(saved.device)
        with torch.cuda.stream(side):  # after the copy out, which ran on this stream
            saved.fetched = saved.host.to(saved.device, non_blocking=True)
            saved.ready = side.record_event()


def store_for(store: torch.device, model_device: torch.device) -> Store | None:
    """The hooks that move saved tensors from the model's device to `store`; None where they would stay put."""
    return Store(store) if store != model_device else None
