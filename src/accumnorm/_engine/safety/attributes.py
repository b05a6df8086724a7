"""The modules' Python attributes as a step found them, for the schedules that run a forward again.

A forward or loss_fn may set a module's attribute (a temperature, a flag, `model.eval()` at its end) that a later
run of the same forward reads. Whole-batch torch runs the forward once, from the state the step began in. A
schedule that runs it again (passes, once per pass; recompute and segments, when they start over under layerwise)
gives each run the attributes as the step found them (`restore`), and a step that fails puts them back so. An
attribute is the same while it holds the same object: a value changed in place inside one (a list appended to) is
not seen. A lazy module, whose first forward changes its class and attributes, is left out (the transaction puts it
back as it was if the step fails).
"""
from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import torch.nn as nn
from torch.nn.parameter import is_lazy

__all__ = ["ModuleAttributes", "differs"]


class ModuleAttributes:
    """The attributes (`vars`) of `modules` now, each value by identity (module doc)."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self.saved = {m: dict(vars(m)) for m in modules if not _lazy(m)}

    def restore(self) -> None:
        """Every module's attributes as saved: the same objects, in the same order, none added."""
        for m, before in self.saved.items():
            now = vars(m)
            if differs(before, now) is not None:
                now.clear()
                now.update(before)

    def close(self) -> None:
        """Let go of the attributes saved (they may hold the step's own forwards, and through them the step)."""
        self.saved = {}


def _lazy(m: nn.Module) -> bool:
    return any(t is not None and is_lazy(t) for t in (*m._parameters.values(), *m._buffers.values()))


_MISSING = object()


def differs(before: dict[str, Any], now: dict[str, Any]) -> str | None:
    """The first attribute whose value is not the same object in `now` as in `before`, if any (a check at every
    region call: the same keys in the same order, each value the same object, is the quick test, in C)."""
    if len(before) == len(now) and all(map(operator.is_, before.values(), now.values())) and list(before) == list(now):
        return None
    return next((key for key in before.keys() | now.keys() if before.get(key, _MISSING) is not now.get(key, _MISSING)),
                None)  # the same attributes in another order
