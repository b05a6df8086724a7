"""What the recompute schedule measured of a model at its last steps, by module name: part of a checkpoint.

Recompute chooses its regions, the convolutions whose outputs it keeps and the region outputs it leaves unread from
the last step's measurements (`regions`, `kept`, `handoff`). A BatchNorm call inside a checkpointed region is
normalized piece by piece, one in a region that runs as it is over the whole batch at once: the same statistics,
rounded otherwise. So a process's first step, which has measured nothing, rounds otherwise than the step a run that
never stopped takes at that point. A checkpoint that holds these measurements beside the weights resumes as that run.
"""
from __future__ import annotations

from typing import Any

import torch.nn as nn

from .handoff import HANDED_ON
from .kept import load_output_bytes, output_bytes_by_name
from .regions import SAVED

__all__ = ["check_measurements", "load_measurements", "measurements"]

_KEYS = ("saved", "handed_on", "output_bytes")


def measurements(model: nn.Module) -> dict[str, dict[str, Any]]:
    """The measurements of `model`'s modules, by their names in it."""
    names = {m: name for name, m in model.named_modules()}
    return {"saved": SAVED.by_name(names), "handed_on": HANDED_ON.by_name(names),
            "output_bytes": output_bytes_by_name(names)}


def check_measurements(state: Any) -> None:
    """Raise a ValueError unless `state` is what `measurements` gives: before anything is loaded."""
    if not (isinstance(state, dict) and set(state) == set(_KEYS) and all(isinstance(state[k], dict) for k in _KEYS)):
        raise ValueError(f"its recompute measurements are not a dict of {', '.join(_KEYS)}: not an accumnorm "
                         "checkpoint, or a damaged one")


def load_measurements(model: nn.Module, state: dict[str, dict[str, Any]]) -> None:
    """`model`'s measurements as `measurements` gave them (checked by `check_measurements`); none where they have
    none."""
    modules = dict(model.named_modules())
    SAVED.load_by_name(modules, state["saved"])
    HANDED_ON.load_by_name(modules, state["handed_on"])
    load_output_bytes(modules, state["output_bytes"])
