"""Random numbers of a step: each micro-batch draws from a stream of its own, the caller's advance by one draw.

A schedule may run a micro-batch's forward more than once (the passes schedule), or interleave the K
forwards (layerwise): if they drew from the caller's generators, their dropout masks would depend on
the schedule and the split, and so would the caller's next `torch.rand()` and a DataLoader's next
shuffle. So every step takes one 64-bit draw from the caller's CPU generator, whatever the split and
schedule, derives one seed per micro-batch from it, and gives the caller's generators (CPU and CUDA)
back as they were after that draw.

NOTE: torch's default generators are process-wide, so while a step runs, draws made by other threads
come from the step's streams (as they would interleave with any forward); steps themselves take turns
(`accumnorm.backward` holds a lock).
"""
from __future__ import annotations

import torch

__all__ = ["StepRng"]

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """A well-mixed 64-bit value from x (Steele et al.'s SplitMix64 finalizer): nearby inputs, unrelated seeds."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return (x ^ (x >> 31)) >> 1  # 63 bits: every torch generator takes it


class StepRng:
    """The random streams of one step's K micro-batches over the CPU and the given CUDA devices.

    `start()` draws the seeds; `begin(k)` makes micro-batch k's stream current (from its start, or from where
    `end(k)` left it; `restart=True`: from its start again, for a schedule that replays the micro-batch);
    `close()` gives the caller's state back: one draw on, or as it was before the step if the step failed.
    """

    def __init__(self, num_micro_batches: int, cuda_devices: list[int]) -> None:
        self.generators = [torch.default_generator] + [torch.cuda.default_generators[d] for d in cuda_devices]
        self.before = [g.get_state() for g in self.generators]
        self.after = self.before
        self.seeds: list[int] = []
        self.states: list[list[torch.Tensor] | None] = [None] * num_micro_batches

    def start(self) -> None:
        """The one draw from the caller's stream (the DataLoader draws its base seed the same way), and the seeds."""
        base = int(torch.empty((), dtype=torch.int64).random_(generator=torch.default_generator))
        self.after = [g.get_state() for g in self.generators]
        self.seeds = [_splitmix64(base + k) for k in range(len(self.states))]

    def begin(self, k: int, restart: bool = False) -> None:
        state = None if restart else self.states[k]
        for i, g in enumerate(self.generators):
            if state is None:
                g.manual_seed(self.seeds[k])
            else:
                g.set_state(state[i])

    def rewind(self) -> None:
        """Every micro-batch's stream back to its start, for a schedule that starts the step over."""
        self.states = [None] * len(self.states)

    def end(self, k: int) -> None:
        self.states[k] = [g.get_state() for g in self.generators]

    def close(self, failed: bool) -> None:
        for g, state in zip(self.generators, self.before if failed else self.after):
            g.set_state(state)
