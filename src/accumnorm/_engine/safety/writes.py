"""Which micro-batches' forwards change a number a module holds: `NumberWrites`.

Under the interleaved schedules the K forwards run in turns. A number each forward moves (a counter that anneals a
temperature, a scheduler stepped per call) is moved K times where whole-batch torch moves it once, and the later
micro-batches run with what the earlier ones left. A number every micro-batch sets to one value (the next step's
temperature, set once the forward is over) is changed by the first alone, and ends as the whole batch's. So while
the forwards run, `nn.Module.__setattr__` notes which micro-batch's turn it is when a module's int, float or bool
attribute gets another value than it holds (`training` aside: the step keeps the modes itself); a number two
micro-batches or more changed is refused (`StateChanged`). An attribute set through `vars(module)`, or by a class
whose own `__setattr__` does not call nn.Module's, is not seen.

Why the noting `__setattr__` is installed at the first exact step and then kept, where the step's other process-wide
settings are put back as it ends: a method set on `nn.Module` makes Python drop what it cached of every module
class's attributes (over a millisecond a step, twice, in a process with timm and transformers loaded). Outside a
step it only calls the `__setattr__` it replaced.
"""
from __future__ import annotations

import numbers
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

__all__ = ["NumberWrites", "StateChanged", "install_noting"]


class StateChanged(ValueError):
    """Two micro-batches' forwards or more changed a number a module holds; `reason` says which, in a few words."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


_NOTING = threading.local()  # .writes: the NumberWrites of the step whose forwards run on this thread, if any


def _noting_setattr(module: nn.Module, name: str, value: Any) -> None:
    if module is _PROBE:
        _NOTING.probed = True
    else:
        writes = getattr(_NOTING, "writes", None)
        if writes is not None:
            writes.saw(module, name, value)
    _replaced(module, name, value)


_replaced = nn.Module.__dict__["__setattr__"]  # what `_noting_setattr` calls: the `__setattr__` it replaced
_PROBE = nn.Module()  # set by `_reached` to learn whether nn.Module.__setattr__ reaches `_noting_setattr`
_INSTALLING = threading.Lock()


def install_noting() -> None:
    """Make `nn.Module.__setattr__` tell the `NumberWrites` its thread's forwards run under (`NumberWrites.begin`), if
    any: at an exact step's start. Installed once (module doc), and again around whatever replaced it since, unless
    that calls it on."""
    global _replaced
    if nn.Module.__dict__["__setattr__"] is not _noting_setattr:
        with _INSTALLING:
            if not _reached():
                _replaced = nn.Module.__dict__["__setattr__"]
                nn.Module.__setattr__ = _noting_setattr


def _reached() -> bool:
    """Whether nn.Module.__setattr__ calls `_noting_setattr` (a wrapper another library set around it since)."""
    _NOTING.probed = False
    nn.Module.__setattr__(_PROBE, "probe", 0)
    return _NOTING.probed


class NumberWrites:
    """The numbers of modules that each micro-batch's turns changed (module doc); `current()` is the micro-batch whose
    turn it is (None between turns)."""

    def __init__(self, current: Callable[[], int | None]) -> None:
        self.current = current
        self.changed: dict[tuple[int, str], tuple[nn.Module, set[int]]] = {}

    def begin(self) -> None:
        """Note the writes of this thread's forwards from now (under `install_noting`)."""
        _NOTING.writes = self

    def end(self) -> None:
        _NOTING.writes = None

    def saw(self, module: nn.Module, name: str, value: Any) -> None:
        k = self.current()
        if k is None or name == "training" or not _number(value):
            return
        held = module.__dict__.get(name)  # None where it held none: not a number
        if _number(held) and held != value:
            self.changed.setdefault((id(module), name), (module, set()))[1].add(k)

    def refuse_moved_by_several(self, names: dict[nn.Module, str], micro_batches: int,
                                undo: Callable[[], None]) -> None:
        """Raise `StateChanged`, after `undo()` (the attributes as the step found them), if two micro-batches' turns or
        more changed one number."""
        for (_, name), (module, by) in self.changed.items():
            if len(by) > 1:
                undo()
                what = (f"{len(by)} of the micro-batches' interleaved forwards changed the attribute {name!r} of "
                        f"{type(module).__name__} {names.get(module) or '(the model)'}")
                raise StateChanged(
                    f"bn='exact': {what}: each of the {micro_batches} forwards moves it where the whole batch's "
                    "forward would once, and each later micro-batch runs with what the earlier ones left, so the step "
                    "would not be the whole batch's. Nothing was changed. Use schedule='passes' (\"auto\" does), "
                    "which gives each forward the attributes as the step found them, change such state outside the "
                    "step (once, before or after it), or pass bn='micro' for plain accumulation", what)


def _number(value: Any) -> bool:
    return isinstance(value, numbers.Number) and not isinstance(value, torch.Tensor)
