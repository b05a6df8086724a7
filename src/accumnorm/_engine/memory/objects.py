"""What the Python objects a step keeps for its backward take, beside its tensors' storages: `Meter.count_objects`.

The checkpointing schedules keep a record for every region call of every micro-batch: the call's arguments, its
random state and modes, the BatchNorm calls it made. On a deep net of small tensors these records outweigh the
tensors they name (docs/cost.md, "What a region call keeps beside its tensors"), and a meter of tensors alone let
such a step pass its budget several times over. `object_bytes` measures them with `sys.getsizeof`, each object once:
it opens containers, the record types it is given, and the closures and weak-reference callbacks made for them; it
counts anything else as the one object it is (a tensor's Python object, whose storage the meter counts where the
step keeps it; a module, a bound method, a node the records share), never what that refers to, so that a walk from
a record cannot reach the model or the step.
"""
from __future__ import annotations

import functools
import sys
import types
import weakref
from typing import Any

__all__ = ["object_bytes"]

_CONTAINERS = (list, tuple, set, frozenset)


def object_bytes(root: Any, records: tuple[type, ...]) -> int:
    """The bytes of `root` and of the objects it holds (module doc), each once; `records`: the types whose attributes
    are opened."""
    total, stack, seen = 0, [root], set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, _CONTAINERS):
            stack.extend(obj)
        elif isinstance(obj, functools.partial):
            stack.extend(obj.args)
            stack.append(obj.keywords)
        elif isinstance(obj, types.FunctionType):  # a closure made for the record: what its cells hold
            stack.extend(cell.cell_contents for cell in obj.__closure__ or () if _filled(cell))
        elif isinstance(obj, weakref.ref) and obj.__callback__ is not None:
            stack.append(obj.__callback__)
        elif isinstance(obj, records):
            stack.extend(_attributes(obj))
    return total


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _attributes(obj: Any) -> list[Any]:
    """A record's attributes: its `__dict__` (a dict, opened in turn), and its slots' values."""
    found = [vars(obj)] if hasattr(obj, "__dict__") else []
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                found.append(getattr(obj, name))
    return found
