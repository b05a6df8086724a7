"""What every schedule shares: the micro-batches of one `accumnorm.backward` call, their loss weights,
their random numbers, and plain accumulation (the schedule of `bn="micro"`)."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from ..distributed import Collectives
from ..functional import moments, normalize_joint, stack_moments
from ..intercept import BNCall

__all__ = ["Step", "LossFn", "GradModes", "RngStates", "plain", "replay_rng"]

LossFn = Callable[[nn.Module, Any], Tensor]


class Step:
    """One `accumnorm.backward` call: the micro-batches, each one's share of the loss, and what the schedule found.

    A schedule fills `losses` (one detached loss per micro-batch) and, in exact mode, `calls`: the
    whole-batch BN calls in forward order, each with its statistics, for the running-statistics update.
    """

    def __init__(self, model: nn.Module, micro_batches: list[Any], weights: list[float], loss_fn: LossFn,
                 collectives: Collectives, grad_scaler: torch.amp.GradScaler | None,
                 owners: dict[int, _BatchNorm]) -> None:
        self.model, self.micro_batches, self.weights, self.loss_fn = model, micro_batches, weights, loss_fn
        self.collectives, self.grad_scaler, self.owners = collectives, grad_scaler, owners
        self.losses: list[Tensor | None] = [None] * len(micro_batches)
        self.calls: list[BNCall] = []
        self.seeds: list[int | None] = [None] * len(micro_batches)
        self.cuda_devices = sorted({p.device.index for p in model.parameters() if p.device.type == "cuda"})

    def restart(self) -> None:
        """Forget what a failed schedule did, for another to run the step from the start."""
        for p in self.model.parameters():
            if p.requires_grad:
                p.grad = None  # the caller's gradients are set aside until the step succeeds
        self.losses = [None] * len(self.micro_batches)
        self.calls = []

    def draw_seeds(self) -> None:
        """One seed per micro-batch, so that every pass over it draws the same random numbers (dropout).

        Drawn once per step: a schedule that takes over after another failed replays the same numbers.
        """
        if self.seeds[0] is None:
            self.seeds = torch.randint(2**62, (len(self.micro_batches),)).tolist()

    def loss(self, k: int) -> Tensor:
        """loss_fn on micro-batch k, checked to be a scalar tensor."""
        loss = self.loss_fn(self.model, self.micro_batches[k])
        if not isinstance(loss, Tensor):
            raise TypeError(f"loss_fn must return a scalar Tensor, got {type(loss).__name__} for micro-batch {k}")
        if loss.dim() != 0:
            raise ValueError(
                f"loss_fn must return a scalar (0-dim) Tensor, got shape {tuple(loss.shape)} for micro-batch {k}")
        return loss

    def weighted(self, loss: Tensor, k: int) -> Tensor:
        """Micro-batch k's share of the whole-batch mean loss (times the AMP scale, if any)."""
        loss = loss * self.weights[k]
        return self.grad_scaler.scale(loss) if self.grad_scaler is not None else loss

    def normalize_jointly(self, calls: list[BNCall]) -> list[Tensor]:
        """The K micro-batches' calls of one BatchNorm call, normalized with their joint (and all ranks')
        statistics by one autograd node; the call is recorded for the running-statistics update."""
        first = calls[0]
        with torch.no_grad():
            local = stack_moments([moments(bn.input) for bn in calls])
        first.stats = self.collectives.merge_moments(local)
        self.calls.append(first)
        return list(normalize_joint([bn.input for bn in calls], first.stats, first.weight, first.bias, first.eps,
                                    self.collectives.sum_))

    @contextmanager
    def rng(self, k: int) -> Iterator[None]:
        """Micro-batch k's random numbers: the same in every pass over it."""
        with replay_rng(self.seeds[k], self.cuda_devices):
            yield


@contextmanager
def replay_rng(seed: int | None, cuda_devices: list[int]) -> Iterator[None]:
    """Run the block from a generator state seeded with `seed`, then give the caller's state back (None: as is)."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=cuda_devices):
        # Seed only the generators in use: torch.manual_seed would also queue a lazy CUDA seeding
        # (with a captured traceback) on every call, a large cost on CPU.
        torch.default_generator.manual_seed(seed)
        for d in cuda_devices:
            torch.cuda.default_generators[d].manual_seed(seed)
        yield


@dataclass(frozen=True)
class GradModes:
    """This thread's grad, inference and autocast modes: taken where a forward is called, entered where it runs
    (a worker thread, or the model's graph run outside loss_fn), compared where a change would go unrecorded."""

    grad: bool
    inference: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...]  # (device type, enabled, dtype)

    @classmethod
    def current(cls) -> GradModes:
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                   tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")))

    @contextmanager
    def enter(self) -> Iterator[None]:
        with ExitStack() as stack:
            if self.inference:  # NOTE: inference_mode(False) would turn grad mode back on
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for device, enabled, dtype in self.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            yield


class RngStates:
    """One generator state per micro-batch of a step (seeded from `Step.seeds`), switched in and out as the
    micro-batches take turns, so that each draws the numbers it would draw running alone."""

    def __init__(self, seeds: list[int], cuda_devices: list[int]) -> None:
        self.seeds, self.cuda_devices = seeds, cuda_devices
        self.states: list[list[Tensor] | None] = [None] * len(seeds)

    def generators(self) -> list[torch.Generator]:
        return [torch.default_generator] + [torch.cuda.default_generators[d] for d in self.cuda_devices]

    def switch_in(self, k: int) -> None:
        state = self.states[k]
        for i, g in enumerate(self.generators()):
            if state is None:
                g.manual_seed(self.seeds[k])
            else:
                g.set_state(state[i])

    def switch_out(self, k: int) -> None:
        self.states[k] = [g.get_state() for g in self.generators()]


def plain(step: Step) -> None:
    """Plain accumulation: forward and backward of each micro-batch in turn (BatchNorm sees micro-batches)."""
    for k in range(len(step.micro_batches)):
        with step.rng(k):
            loss = step.loss(k)
        step.losses[k] = loss.detach()
        step.weighted(loss, k).backward()
