"""Process-group helpers for training with ``torchrun``: start from its environment, split a
global batch by rank, and keep every collective under a bounded timeout.

    env = accumnorm.distributed.init_from_env()      # gloo on CPU, nccl on GPU, or one process
    model.to(env.device)
    ...
    trainer.step(accumnorm.distributed.shard(global_batch))
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from .functional import Moments, combine_moments

# A rank that dies or stops calling collectives makes the others fail after this long instead of
# waiting forever (torch's own default is 30 minutes with gloo).
DEFAULT_TIMEOUT = timedelta(minutes=5)


class DistEnv(NamedTuple):
    """Where this process stands: its rank among ``world_size`` processes and its device."""
    rank: int
    local_rank: int
    world_size: int
    device: torch.device


def init_from_env(backend: str | None = None, timeout: timedelta = DEFAULT_TIMEOUT) -> DistEnv:
    """Join the process group that ``torchrun`` describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT). Without those variables this is one process and no group is started.

    ``backend`` defaults to nccl when CUDA is available, else gloo. Each rank uses GPU ``LOCAL_RANK``
    when CUDA is available, else the CPU. ``timeout`` bounds every collective, so a failed rank makes
    the others raise instead of hang.
    """
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        return DistEnv(0, 0, 1, torch.device("cuda" if cuda else "cpu"))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if cuda:
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK {local_rank} has no GPU: this node has "
                             f"{torch.cuda.device_count()}; start at most that many processes per node")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # nccl and the object collectives use the current device
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend or ("nccl" if cuda else "gloo"), rank=rank, world_size=world_size,
                            timeout=timeout)
    return DistEnv(rank, local_rank, world_size, device)


def rank_and_size(group: ProcessGroup | None) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size; (0, 1) when ``group`` is None."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def shard(batch: Any, group: ProcessGroup | None = None) -> Any:
    """This rank's part of a global batch (a tensor, or a tuple/list/dict of tensors sharing dim 0).

    Every rank passes the same global batch; rank r gets the r-th of ``world_size`` contiguous parts,
    whose sizes differ by at most one (as ``torch.tensor_split``), so an uneven last batch is split
    too. ``group`` defaults to the default group when torch.distributed is initialized.
    """
    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    rank, world_size = rank_and_size(group)
    n = num_samples(batch)
    if n < world_size:
        raise ValueError(f"a global batch of {n} samples leaves rank {world_size - 1} of world size "
                         f"{world_size} with no samples; use at least {world_size} per batch")
    return map_batch(lambda t: t.tensor_split(world_size)[rank], batch)


def map_batch(fn: Callable[[torch.Tensor], torch.Tensor], batch: Any) -> Any:
    """``fn`` applied to each tensor of a batch (a tensor, or a tuple/list/dict of tensors); anything
    else is left as it is, for ``accumnorm.backward`` to refuse with a clear error."""
    apply = lambda t: fn(t) if torch.is_tensor(t) else t
    if isinstance(batch, dict):
        return {k: apply(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(apply(t) for t in batch)
    return apply(batch)


def num_samples(batch: Any) -> int:
    """The length of dim 0 that a batch's tensors share."""
    first = batch if torch.is_tensor(batch) else next(iter(batch.values() if isinstance(batch, dict) else batch))
    return first.shape[0]


class ShardedLoader:
    """Wraps a loader that yields global batches so that each rank iterates over its own shard."""

    def __init__(self, loader: Iterable, group: ProcessGroup | None = None):
        self.loader, self.group = loader, group

    def __iter__(self) -> Iterator:
        return (shard(batch, self.group) for batch in self.loader)

    def __len__(self) -> int:
        return len(self.loader)


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

    def merge_moments(self, m: Moments) -> Moments:
        """This rank's moments merged with every other rank's (one all_gather)."""
        if self.group is None:
            return m
        flat = m.pack()
        out = [torch.empty_like(flat) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(out, flat, group=self.group)
        return combine_moments(Moments.unpack(torch.stack(out)))

    def sum_grads_(self, params: list[nn.Parameter]) -> None:
        """Sum this step's gradients over the ranks in one flat all-reduce (unused parameters count as 0)."""
        if self.group is None or not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = self.sum_(torch.cat([g.reshape(-1) for g in grads]))
        for p, chunk in zip(params, flat.split([g.numel() for g in grads])):
            p.grad = chunk.view_as(p).clone() if p.grad is None else p.grad.copy_(chunk.view_as(p))
