"""A region's function run again as its forward ran it, for its recomputation in the backward.

The forward's random state (the CPU generator's, and that of each other device its inputs are on), its modes
(`threadstate.Modes`) and its `torch.device` context, re-entered afresh: torch's checkpoint's choices. The thread's
own are put back after the run.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext

from ..safety.threadstate import Modes

__all__ = ["rerun_later"]


def rerun_later(fn: Callable[..., Any], inputs: Sequence[Tensor], cpu_state: Tensor) -> Callable[..., Any]:
    """`fn`, to be run again on the same inputs later as it is about to run now: from `cpu_state` (the CPU
    generator's state now, which the caller may share between calls), the other devices' generators' states, the
    modes and the device context of this point."""
    devices = {t.device for t in inputs if t.device.type not in ("cpu", "meta")}
    return functools.partial(_rerun, fn, _random_state(devices, cpu_state), Modes.current(), _device_context())


RandomState = tuple[Tensor, list[tuple[torch.device, Tensor]]]  # the CPU generator's, and some devices' generators'


def _random_state(devices: Iterable[torch.device], cpu: Tensor | None = None) -> RandomState:
    """The CPU generator's state (`cpu`, else read now), and that of each of `devices`."""
    cpu = torch.get_rng_state() if cpu is None else cpu
    return cpu, [(d, getattr(torch, d.type).get_rng_state(d)) for d in devices]


def _set_random_state(state: RandomState) -> None:
    cpu, devices = state
    torch.set_rng_state(cpu)
    for d, device_state in devices:
        getattr(torch, d.type).set_rng_state(device_state, d)


def _device_context() -> torch.device | None:
    """The device of a `torch.device` context the forward runs in, if any (re-entered afresh: torch's choice)."""
    return next((mode.device for mode in reversed(_get_current_function_mode_stack())
                 if isinstance(mode, DeviceContext)), None)


def _rerun(fn: Callable[..., Any], random_state: RandomState, modes: Modes, device: torch.device | None,
           *inputs: Tensor) -> Any:
    """`fn(*inputs)` with the random state and modes its forward began with; the thread's own put back after."""
    before = _random_state(d for d, _ in random_state[1])
    _set_random_state(random_state)
    try:
        with modes.entered(Modes.current()), (nullcontext() if device is None else DeviceContext(device)):
            return fn(*inputs)
    finally:
        _set_random_state(before)
