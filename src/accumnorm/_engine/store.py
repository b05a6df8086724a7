"""Where the layerwise schedule keeps the whole batch's saved tensors: `store=`.

The K micro-batches' graphs live together until the backward. On a GPU their saved tensors can go to
pinned host memory instead (the default there), copied back when the backward needs them, so that the
device holds about what one micro-batch needs.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

__all__ = ["Store", "resolve_store", "store_for"]


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


class Store:
    """Saved-tensor hooks that keep what autograd saves on `device` (pinned when it is the host of a GPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pin = device.type == "cpu" and torch.cuda.is_available()

    def hooks(self) -> AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: Tensor) -> Any:
        # Parameters are kept by reference: copying a weight once per micro-batch would only waste memory.
        if t.device == self.device or isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad):
            return t
        packed = torch.empty_like(t, device=self.device, pin_memory=self.pin)
        packed.copy_(t, non_blocking=self.pin)
        return t.device, packed

    @staticmethod
    def unpack(packed: Any) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        device, t = packed
        return t.to(device, non_blocking=True)


def store_for(store: torch.device, model_device: torch.device) -> Store | None:
    """The hooks that move saved tensors from the model's device to `store`; None where they would stay put."""
    return Store(store) if store != model_device else None
