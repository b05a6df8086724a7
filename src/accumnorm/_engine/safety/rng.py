"""Random numbers of a step: each micro-batch draws from a stream of its own, the caller's advance by one draw.

A schedule may run a micro-batch's forward more than once (the passes schedule), or interleave the K
forwards (layerwise): if they drew from the caller's generators, their dropout masks would depend on
the schedule and the split, and so would the caller's next `torch.rand()` and a DataLoader's next
shuffle. So every step takes one 64-bit draw from the caller's CPU generator, whatever the split and
schedule, derives one seed per micro-batch from it, and leaves the caller's generators (CPU and CUDA)
as they were after that draw. What the step draws outside the micro-batches' turns (in its backward: a region
recomputed without `preserve_rng_state`, a hook; in a loss over the whole batch) comes from a stream of the step's
own, seeded from the same draw (`outside_turns`).

torch's default generators are process-wide, and other threads draw from them too: the micro-batches'
streams are in them only for their turns (`begin` to `end`; a schedule whose turns follow one another, as
layerwise's do, goes from one micro-batch's to the next's and ends once its forwards are over), and the
process's own stream the rest of the time, so a draw of another thread outside the turns continues the
process's stream. (The swaps take no lock another thread's draw respects: a draw that lands between a
swap's get_state and set_state can come again.)
During a turn, another thread's draw comes from that micro-batch's stream (as draws of several threads
interleave in any forward); so do the draws of a step on another thread whose turn overlaps this one's:
the swaps are bookkept per generator (`_HOLDERS`: which stream each holds now), so that whatever the
overlap, each stream goes on from where it was last left.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

__all__ = ["StepRng"]

_MASK = (1 << 64) - 1

_SWAPS = threading.Lock()  # held only while streams are swapped, never while a forward runs
# The micro-batch stream each generator (by device) holds now: (its StepRng, micro-batch, generator index); the
# process's own stream, set aside meanwhile, is in _OUTSIDE.
_HOLDERS: dict[torch.device, tuple[StepRng, int, int]] = {}
_OUTSIDE: dict[torch.device, Tensor] = {}


def _splitmix64(x: int) -> int:
    """A well-mixed 64-bit value from x (Steele et al.'s SplitMix64 finalizer): nearby inputs, unrelated seeds."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return (x ^ (x >> 31)) >> 1  # 63 bits: every torch generator takes it


class StepRng:
    """The random streams of one step's K micro-batches over the CPU and the given CUDA devices.

    `start()` draws the seeds; `begin(k)` makes micro-batch k's stream current (from its start, or from where
    `end(k)` left it; `restart=True`: from its start again, for a schedule that replays the micro-batch), setting
    the process's stream aside, or, from another of the step's turns, setting that one's stream aside; `end(k)`
    puts the process's stream back (`end_turns()`: whichever turn is open); `close()` leaves the caller's stream
    one draw on, or, if the step failed and no other thread drew meanwhile, as it was before the step.
    """

    def __init__(self, num_micro_batches: int, cuda_devices: list[int]) -> None:
        self.generators = [torch.default_generator] + [torch.cuda.default_generators[d] for d in cuda_devices]
        self.before = [g.get_state() for g in self.generators]
        self.after = self.before
        self.seeds: list[int] = []
        self.own = num_micro_batches  # the step's own stream, after the micro-batches' (`outside_turns`)
        self.states: list[list[Tensor | None]] = [[None] * len(self.generators) for _ in range(num_micro_batches + 1)]
        self.slots = [(i, g, g.device) for i, g in enumerate(self.generators)]  # each generator's index and device
        self.shared: list[list[Tensor]] = [[] for _ in self.states]  # `shared_states`' last, by turn

    def start(self) -> None:
        """The one draw from the caller's stream (the DataLoader draws its base seed the same way), and the seeds."""
        base = int(torch.empty((), dtype=torch.int64).random_(generator=torch.default_generator))
        self.after = [g.get_state() for g in self.generators]
        # The step's own stream from the value before the micro-batches', whatever their number: a loss over the
        # whole batch draws the same at any split.
        self.seeds = [_splitmix64(base + k) for k in range(self.own)] + [_splitmix64((base - 1) & _MASK)]

    def begin(self, k: int, restart: bool = False) -> None:
        states = self.states[k]
        with _SWAPS:
            for i, g, device in self.slots:
                holder = _HOLDERS.get(device)
                if holder is None:
                    _OUTSIDE[device] = g.get_state()
                else:  # another turn's stream (of a step on another thread): it goes on from here next time
                    rng, j, gi = holder
                    rng.states[j][gi] = g.get_state()
                state = None if restart else states[i]
                if state is None:
                    g.manual_seed(self.seeds[k])
                else:
                    g.set_state(state)
                _HOLDERS[device] = (self, k, i)

    def end(self, k: int) -> None:
        states = self.states[k]
        with _SWAPS:
            for i, g, device in self.slots:
                holder = _HOLDERS.get(device)
                if holder is not None and holder[0] is self and holder[1] == k:
                    states[i] = g.get_state()
                    g.set_state(_OUTSIDE.pop(device))
                    del _HOLDERS[device]

    @contextmanager
    def outside_turns(self) -> Iterator[None]:
        """The block's draws from the step's own stream, unless a turn of the step's is open (then from its stream):
        for what the step runs outside the micro-batches' turns, so that the caller's stream advances by the one
        draw of `start` alone."""
        if self._open_turn() is not None:
            yield
            return
        self.begin(self.own)
        try:
            yield
        finally:
            self.end(self.own)

    def shared_states(self) -> list[Tensor]:
        """Each generator's state now, for a region call to begin its recomputation with. In a micro-batch's turn, a
        state unchanged since that micro-batch's last read is the same tensor again: its region calls between which
        nothing random ran keep one copy, not one each (the CPU generator's state is 5 KB, per region call and
        micro-batch)."""
        states = [g.get_state() for g in self.generators]
        k = self._open_turn()
        if k is None:
            return states
        last = self.shared[k]
        if last:
            states = [old if torch.equal(old, new) else new for old, new in zip(last, states)]
        self.shared[k] = states
        return states

    def _open_turn(self) -> int | None:
        """The stream of this step's that the generators hold now (a micro-batch's, or the step's own), if one."""
        holder = _HOLDERS.get(self.slots[0][2])
        return holder[1] if holder is not None and holder[0] is self else None

    def rewind(self) -> None:
        """Every micro-batch's stream back to its start, for a schedule that starts the step over."""
        self.states = [[None] * len(self.generators) for _ in self.states]
        self.shared = [[] for _ in self.shared]

    def end_turns(self) -> None:
        """End whichever of this step's turns is open: the process's stream back in the generators."""
        for _, _, device in self.slots:
            holder = _HOLDERS.get(device)
            if holder is not None and holder[0] is self:
                self.end(holder[1])

    def close(self, failed: bool) -> None:
        """End the step's streams: a turn still open (a schedule's generator of turns that an error left suspended,
        whose `finally` runs only when it is collected) ends now; on failure, the caller's stream as before."""
        self.end_turns()
        self.shared = [[] for _ in self.shared]
        if not failed:
            return
        for g, before, after in zip(self.generators, self.before, self.after):
            if torch.equal(g.get_state(), after):  # else another thread drew since: its values must not come again
                g.set_state(before)
