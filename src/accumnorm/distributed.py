"""Process-group helpers for training with ``torchrun``: start from its environment, split a
global batch by rank, and keep every collective under a bounded timeout.

    env = accumnorm.distributed.init_from_env()      # gloo on CPU, nccl on GPU, or one process
    model.to(env.device)
    ...
    trainer.step(accumnorm.distributed.shard(global_batch))
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ._dist import map_batch, num_samples, rank_and_size

__all__ = ["DEFAULT_TIMEOUT", "DistEnv", "init_from_env", "shard", "ShardedLoader"]

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


class ShardedLoader:
    """Wraps a loader that yields global batches so that each rank iterates over its own shard."""

    def __init__(self, loader: Iterable, group: ProcessGroup | None = None):
        self.loader, self.group = loader, group

    def __iter__(self) -> Iterator:
        return (shard(batch, self.group) for batch in self.loader)

    def __len__(self) -> int:
        return len(self.loader)
