"""Process-group helpers that the Trainer and the engine share: ranks, batches, one step's reductions.

`accumnorm.distributed` is the public side (joining a group under torchrun, sharding a global batch).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from .functional import Moments, combine_moments

__all__ = ["rank_and_size", "map_batch", "num_samples", "broadcast_module", "all_gather_object", "unwrap_ddp",
           "Collectives"]


def rank_and_size(group: ProcessGroup | None) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size; (0, 1) when ``group`` is None."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def map_batch(fn: Callable[[torch.Tensor], torch.Tensor], batch: Any) -> Any:
    """``fn`` applied to each tensor of a batch (a tensor, or a tuple/namedtuple/list/dict of tensors); anything
    else is left as it is, for ``accumnorm.backward`` to refuse with a clear error."""
    def apply(t: Any) -> Any:
        return fn(t) if torch.is_tensor(t) else t

    if isinstance(batch, dict):
        return {k: apply(v) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple takes its fields one by one
        return type(batch)(*(apply(t) for t in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(apply(t) for t in batch)
    return apply(batch)


def num_samples(batch: Any) -> int:
    """The length of dim 0 that a batch's tensors share."""
    first = batch if torch.is_tensor(batch) else next(iter(batch.values() if isinstance(batch, dict) else batch))
    return first.shape[0]


def broadcast_module(module: torch.nn.Module, group: ProcessGroup) -> None:
    """Copy the parameters and buffers of the group's rank 0 to every rank, as DDP does at start."""
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in module.state_dict().values():
            dist.broadcast(tensor, src, group=group)


def all_gather_object(obj: Any, group: ProcessGroup | None) -> list:
    """``[obj of rank 0, obj of rank 1, ...]``; ``[obj]`` without a group."""
    if group is None:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def unwrap_ddp(model: nn.Module, process_group: ProcessGroup | None) -> tuple[nn.Module, ProcessGroup | None]:
    """A DDP-wrapped model runs as its inner module: ``accumnorm.backward`` reduces gradients itself, once per step."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.module, process_group if process_group is not None else model.process_group
    return model, process_group


class Collectives:
    """The reductions of one ``accumnorm.backward`` call over a process group; no-ops without one."""

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group

    def sum_(self, t: Tensor) -> Tensor:
        """Sum ``t`` over the ranks, in place."""
        if self.group is not None:
            dist.all_reduce(t, group=self.group)
        return t

    def max_(self, n: int, device: torch.device) -> int:
        """The largest of the ranks' ``n`` (sent as a tensor on ``device``, one the group's backend reaches)."""
        if self.group is None:
            return n
        t = torch.tensor([n], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def merge_moments(self, m: Moments) -> Moments:
        """This rank's moments merged with every other rank's (one all_gather)."""
        if self.group is None:
            return m
        flat = m.pack()
        out = [torch.empty_like(flat) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(out, flat, group=self.group)
        return combine_moments(Moments.unpack(torch.stack(out)))

    def sum_each(self, tensors: list[Tensor]) -> list[Tensor]:
        """Each tensor summed over the ranks, in one flat all-reduce: views of the one flat sum."""
        flat = self.sum_(torch.cat([t.reshape(-1) for t in tensors]))
        return [chunk.view_as(t) for t, chunk in zip(tensors, flat.split([t.numel() for t in tensors]))]

    def sum_grads_(self, params: list[nn.Parameter]) -> None:
        """Sum this step's gradients over the ranks in one flat all-reduce (unused parameters count as 0)."""
        if self.group is None or not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        for p, summed in zip(params, self.sum_each(grads)):
            p.grad = summed.clone() if p.grad is None else p.grad.copy_(summed)
