"""What the recompute schedule measured of a model at its last steps, by module name: part of a checkpoint.

Recompute chooses its regions, the convolutions whose outputs it keeps and the region outputs it leaves unread from
the last step's measurements (`regions`, `kept`, `handoff`). A BatchNorm call inside a checkpointed region is
normalized piece by piece, one in a region that runs as it is over the whole batch at once: the same statistics,
rounded otherwise. So a process's first step, which has measured nothing, rounds otherwise than the step a run that
never stopped takes at that point. A checkpoint that holds these measurements beside the weights resumes as that run.
"""
from __future__ import annotations

import copy
from typing import Any

import torch.nn as nn

from ..memory.budget import trained_module
from .handoff import HANDED_ON
from .kept import OUTPUT_BYTES
from .regions import SAVED

__all__ = ["CHECKPOINT_KEY", "check_measurements", "load_measurements", "measurements"]

CHECKPOINT_KEY = "accumnorm_measurements"  # where a framework's checkpoint holds them
# each measurement's name in a checkpoint -> its table, module -> value, weakly
_TABLES = {"saved": SAVED.by_module, "handed_on": HANDED_ON.by_module, "output_bytes": OUTPUT_BYTES}


def measurements(model: nn.Module) -> dict[str, dict[str, Any]]:
    """The measurements of the modules of `model` (without its DDP or compile wrapper), by their names in it."""
    names = {m: name for name, m in trained_module(model).named_modules()}
    return {key: {names[m]: copy.copy(value) for m, value in table.items() if m in names}
            for key, table in _TABLES.items()}


def check_measurements(state: Any) -> None:
    """Raise a ValueError unless `state` is what `measurements` gives."""
    if not (isinstance(state, dict) and set(state) == set(_TABLES)
            and all(isinstance(value, dict) for value in state.values())):
        raise ValueError(f"its recompute measurements are not a dict of {', '.join(_TABLES)}: not an accumnorm "
                         "checkpoint, or a damaged one")


def load_measurements(model: nn.Module, state: Any) -> None:
    """`model`'s measurements as `measurements` gave them, none where they have none; checked first
    (`check_measurements`), so that a damaged `state` changes nothing."""
    check_measurements(state)
    for name, m in trained_module(model).named_modules():
        for key, table in _TABLES.items():
            if name in state[key]:
                table[m] = copy.copy(state[key][name])
            else:
                table.pop(m, None)
